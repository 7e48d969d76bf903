"""The trainer's model: the engine's own Llama-family model, on a kernel set that autograd can go through.

``TRAINABLE`` holds the same kernels as ``INVARIANT`` with the same forward bits, wrapped in autograd
Functions (``lockstep.ops.autograd``, ``lockstep.rl.attention``). ``load_policy`` loads a checkpoint for
training: the weights require grad, and the layers call ``TRAINABLE``. With ``batch_invariant=False`` the model
runs the ``torch`` kernel set (torch's own ops, differentiable as they are): the usual trainer, for comparison.
"""

from pathlib import Path

import torch

from lockstep import ops
from lockstep.layers.activation import silu_and_mul as _silu_and_mul
from lockstep.layers.kernels import INVARIANT, Kernels, get_kernels
from lockstep.layers.torch_kernels import torch_write_kv
from lockstep.models.llama import LlamaForCausalLM
from lockstep.models.loader import load_model
from lockstep.models.quantization import fp8_scheme, train_fp8
from lockstep.ops import autograd
from lockstep.ops.gated_backward import silu_and_mul_backward
from lockstep.rl import attention

__all__ = ["TRAINABLE", "load_policy", "make_trainable"]


class _SiluAndMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        return _silu_and_mul(gate_up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (gate_up,) = ctx.saved_tensors
        if gate_up.is_cuda and gate_up.dim() == 2:  # the same formula in one Triton pass (ops.gated_backward)
            return silu_and_mul_backward(gate_up, grad)
        return silu_and_mul_backward_reference(gate_up, grad)


def silu_and_mul_backward_reference(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """SiLU-and-mul's gradient in torch ops, fp32 (the CPU's path; CUDA's is ``ops.gated_backward``)."""
    # The textbook gradient in fp32: grad_gate = g * up * sig * (1 + gate * (1 - sig)), grad_up = g * gate * sig,
    # each product evaluated left to right (the same IEEE op per element, so the same values as those
    # expressions), with in-place steps on fresh temporaries and both halves rounded straight into one output:
    # fewer passes over [tokens, intermediate] than the expressions and an fp32 concatenation took.
    gate, up = gate_up.float().chunk(2, dim=-1)  # [n, I] each
    g = grad.float()
    sig = torch.sigmoid(gate)
    out = torch.empty_like(gate_up)  # [n, 2I]
    width = gate.shape[-1]
    grad_up = g * gate
    out[..., width:] = grad_up.mul_(sig)
    del grad_up
    slope = (1.0 - sig).mul_(gate).add_(1.0)  # 1 + gate * (1 - sig)
    out[..., :width] = (g * up).mul_(sig).mul_(slope)
    return out


class _Rotary(torch.autograd.Function):
    """``ops.rotary`` itself in the forward, so the trainer's bits are the engine's by construction."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        ctx.save_for_backward(cos, sin)
        return ops.rotary(q, k, cos, sin)

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):
        # The transpose of a rotation is the rotation back: (g1, g2) -> (g1 c + g2 s, g2 c - g1 s).
        cos, sin = (t.float() for t in ctx.saved_tensors)

        def back(g: torch.Tensor) -> torch.Tensor:
            g1, g2 = g.float().chunk(2, dim=-1)
            return (g.float() * cos + torch.cat((g2, -g1), dim=-1) * sin).to(g.dtype)

        return back(grad_q), back(grad_k), None, None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.rotary`` with autograd."""
    return _Rotary.apply(q, k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``layers.activation.silu_and_mul`` with autograd."""
    return _SiluAndMul.apply(gate_up)


TRAINABLE = Kernels(
    name="invariant-trainable",
    batch_invariant=True,
    linear=autograd.linear,
    rms_norm=autograd.rms_norm,
    silu_and_mul=silu_and_mul,
    write_kv=torch_write_kv,  # index_copy_ into the cache: exact, and recorded by autograd
    rotary=rotary,
    attention=attention.paged_attention,
    log_softmax=autograd.log_softmax,
    tree_linear=autograd.tree_linear,
    moe_route=autograd.moe_route,
    moe_experts=autograd.moe_experts,
    moe_experts_tree=autograd.moe_experts_tree,
    layer_norm=autograd.layer_norm,
    gelu=autograd.gelu,
    vision_attention=autograd.vision_attention,
)


def make_trainable(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Switch ``model`` (in place) to gradients: weights require grad; an invariant model runs ``TRAINABLE``, a
    ``default`` one (whose CUDA attention has no backward) the ``torch`` set; others keep theirs. Returns ``model``.
    """
    swap = {INVARIANT.name: TRAINABLE, "default": get_kernels("torch")}.get(model.kernels.name)
    if swap is not None:
        for module in model.modules():
            if isinstance(getattr(module, "kernels", None), Kernels):
                module.kernels = swap
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def load_policy(
    path: str | Path,
    *,
    batch_invariant: bool = True,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
    tp_invariant: bool = False,
    mm_processor_kwargs: dict | None = None,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """Load a checkpoint folder as a trainable policy (see ``make_trainable``).

    ``tp_invariant=True`` gives o_proj and down_proj the chunk-tree numerics of a tensor-parallel engine
    (``ops.tp_linear``, with autograd): the policy's logprobs then equal bit for bit those of an engine at any
    ``tensor_parallel_size`` (or at 1 with ``tp_invariant=True``). Without it they equal a one-process engine's
    default numerics.

    A vision-language checkpoint (Qwen3-VL, Qwen2.5-VL) gets ``image_processor``, the folder's own image
    preprocessing with ``mm_processor_kwargs`` (min/max pixels: the engine's, for the same pixels), so
    ``token_logprobs`` takes image prompts as ``LLM.generate`` does (``lockstep.rl.images``).

    FP8 (``models.quantization.train_fp8``): for an engine with FP8 weights (an FP8 checkpoint, or
    ``quantization="fp8"`` here as in ``LLM``), the policy holds full-precision master weights (the checkpoint's, or
    an FP8 checkpoint's e4m3 values times its scales) and its linear layers quantize them in the forward exactly as
    the engine holds them: the sampler's logprobs bit for bit, before and after ``LLM.load_weights`` of
    ``policy.checkpoint_tensors()``. The backward is straight-through (``ops.autograd.fp8_linear``)."""
    kernels = "invariant" if batch_invariant else "torch"
    model = load_model(
        path, dtype=dtype, device=device, kernels=kernels, max_model_len=max_model_len, tp_invariant=tp_invariant
    )
    scheme = getattr(model, "fp8_scheme", None) or fp8_scheme({}, quantization)
    if scheme is not None:
        train_fp8(model, scheme)
    if getattr(model, "is_multimodal", False) and (Path(path) / "preprocessor_config.json").is_file():
        from lockstep.multimodal.processor import ImageProcessor

        model.image_processor = ImageProcessor(path, model, None, mm_processor_kwargs)
    return make_trainable(model)
