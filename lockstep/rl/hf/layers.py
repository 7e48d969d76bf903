"""The decoder layer of a patched Hugging Face model, computed as ``lockstep.models.llama`` computes it, on the
Hugging Face modules' own parameters.

Op for op the engine's sequence, through the trainer's kernel set (``rl.policy.TRAINABLE``: the engine's ops with
autograd): q, k and v (and gate and up) in one stacked matmul, as the engine stacks the checkpoint's matrices; the
per-head q/k RMSNorm of Qwen3; rotary from the engine's cos/sin table; the new K/V written into a zeroed paged
cache and attended over by ``ops.paged_attention``; the residual add fused into the next RMSNorm (the stream is
carried as ``(hidden, residual)`` between layers, as in the engine); SiLU-and-mul; the router and experts of a
mixture of experts. With ``tree`` (``tp_invariant``) o_proj, down_proj and the experts' down projections reduce
through the chunk tree, as a tensor-parallel engine does. With ``fp8`` (``patch_model(quantization="fp8")``) the
projections are online FP8 linears on their master weights (``ops.autograd.fp8_linear``), as the engine holds them,
and the experts online FP8 experts on theirs (``ops.autograd.moe_experts_fp8``; the router stays full precision).

The layers read the modules' weights at every call (``weights.merged_weight``), so PEFT wrappers added after
patching are seen; a projection that cannot be merged runs as its module.
"""

from functools import partial

import torch
from torch import nn

from lockstep.layers.batch import AttentionMetadata
from lockstep.models.quantization import ONLINE, Fp8ExpertsTrain
from lockstep.ops import autograd, fp8
from lockstep.ops.matmul import linear as _linear
from lockstep.ops.matmul import mm
from lockstep.rl.hf.batch import PAGE
from lockstep.rl.hf.weights import merged_weight
from lockstep.rl.policy import TRAINABLE

K = TRAINABLE


class _StackedLinear(torch.autograd.Function):
    """``linear(x, cat(weights), cat(biases))`` without keeping the concatenated weight for the backward (it is
    rebuilt there): the engine's stacked q/k/v and gate/up matmul on the checkpoint's separate matrices."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, num: int, *params: torch.Tensor | None):
        weights, biases = params[:num], params[num:]
        ctx.save_for_backward(x, *weights)
        ctx.num = num
        ctx.has_bias = [b is not None for b in biases]
        bias = None
        if any(ctx.has_bias):
            bias = torch.cat([_bias_or_zeros(b, w) for b, w in zip(biases, weights, strict=True)])
        return _linear(x, torch.cat(weights), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *weights = ctx.saved_tensors
        sizes = [w.shape[0] for w in weights]
        weight = torch.cat(weights)  # [N, K]
        g2 = grad.reshape(-1, grad.shape[-1]).to(weight.dtype)  # [tokens, N]
        x2 = x.reshape(-1, x.shape[-1]).to(weight.dtype)  # [tokens, K]
        grad_x = mm(g2, weight).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_ws: list[torch.Tensor | None] = [None] * ctx.num
        if any(ctx.needs_input_grad[2 : 2 + ctx.num]):
            n, k = weight.shape
            grad_w = mm(x2.t(), g2).t() if n > k else mm(g2.t(), x2)  # [N, K], as autograd.linear
            grad_ws = list(grad_w.split(sizes))
        grad_bs: list[torch.Tensor | None] = [None] * ctx.num
        if any(ctx.has_bias):
            grad_b = g2.float().sum(0).to(weight.dtype).split(sizes)
            grad_bs = [g if has else None for g, has in zip(grad_b, ctx.has_bias, strict=True)]
        return grad_x, None, *grad_ws, *grad_bs


def _bias_or_zeros(bias: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    return bias if bias is not None else weight.new_zeros(weight.shape[0])


def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tree: bool) -> torch.Tensor:
    # Online FP8 as the engine holds it: per-output-channel scales from the weight, activations per token.
    w8, scale = fp8.quantize_weight(weight.detach())
    return autograd.fp8_linear(x, weight, bias, w8, scale, None, tree)


def stacked_linear(x: torch.Tensor, modules: list[nn.Module], fp8_weights: bool = False) -> torch.Tensor:
    """The outputs of the linear ``modules`` side by side, ``x: [n, K]`` -> ``[n, sum(N_i)]``, as one invariant
    matmul over their stacked weights (``fp8_weights``: one FP8 linear, each row quantized on its own as the engine
    quantizes each checkpoint matrix); modules without an exact merged weight (LoRA with dropout) run on their own
    and are concatenated."""
    merged = [merged_weight(m) for m in modules]
    if any(m is None for m in merged):
        return torch.cat([m(x) for m in modules], dim=-1)
    weights = [w for w, _ in merged]
    biases = [b for _, b in merged]
    if fp8_weights:
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([_bias_or_zeros(b, w) for b, w in zip(biases, weights, strict=True)])
        return _fp8_linear(x, torch.cat(weights), bias, False)
    return _StackedLinear.apply(x, len(weights), *weights, *biases)


def linear(x: torch.Tensor, module: nn.Module, tree: bool = False, fp8_weights: bool = False) -> torch.Tensor:
    """``module(x)`` through the invariant linear (the chunk tree with ``tree``; FP8 with ``fp8_weights``), or the
    module itself where it has no exact merged weight."""
    merged = merged_weight(module)
    if merged is None:
        return module(x)
    if fp8_weights:
        return _fp8_linear(x, *merged, tree)
    return (K.tree_linear if tree else K.linear)(x, *merged)


def _attention(attn: nn.Module, x: torch.Tensor, rope, meta: AttentionMetadata, num_blocks: int, shape, eps: float,
               tree: bool, fp8_weights: bool = False) -> torch.Tensor:  # fmt: skip
    # x: [n, hidden]; shape = (num_heads, num_kv_heads, head_dim)
    num_heads, num_kv_heads, head_dim = shape
    n = x.shape[0]
    qkv = stacked_linear(x, [attn.q_proj, attn.k_proj, attn.v_proj], fp8_weights)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(n, num_heads, head_dim)
    k = k.reshape(n, num_kv_heads, head_dim)
    v = v.reshape(n, num_kv_heads, head_dim)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3
        q, k = K.rms_norm_q_and_k(q, k, attn.q_norm.weight, attn.k_norm.weight, eps)
    # A zeroed cache of this call's own: a checkpointed layer's recomputation writes into a fresh one.
    cache_shape = (num_blocks, PAGE, num_kv_heads, head_dim)
    k_cache = k.new_zeros(cache_shape)
    v_cache = v.new_zeros(cache_shape)
    q = K.rotary_and_write_kv(q, k, v, *rope, k_cache, v_cache, meta.slot_mapping)
    out = K.attention(q, k_cache, v_cache, meta, head_dim**-0.5)  # [n, num_heads, head_dim]
    return linear(out.reshape(n, num_heads * head_dim), attn.o_proj, tree, fp8_weights)


def _mlp(
    mlp: nn.Module, x: torch.Tensor, top_k: int, renormalize: bool, tree: bool, fp8_weights: bool = False
) -> torch.Tensor:
    # x: [n, hidden] -> [n, hidden]
    experts = getattr(mlp, "experts", None)
    if experts is None:  # the gated MLP
        gate_up = stacked_linear(x, [mlp.gate_proj, mlp.up_proj], fp8_weights)  # [n, 2 * intermediate]
        return linear(K.silu_and_mul(gate_up), mlp.down_proj, tree, fp8_weights)
    # A sparse MoE block (transformers 5 keeps the experts fused: gate_up_proj [E, 2I, H], down_proj [E, H, I]).
    logits = K.linear(x, mlp.gate.weight, None)  # [n, E] in the model dtype, as the engine's router
    weights, ids = K.moe_route(logits, top_k, renormalize)
    if fp8_weights:  # online FP8 experts: each expert's gate, up and down quantized per channel, as the engine's
        w13, w2 = experts.gate_up_proj, experts.down_proj
        quantized = Fp8ExpertsTrain(ONLINE).quantize(w13.detach(), w2.detach())
        return autograd.moe_experts_fp8(x, w13, w2, weights, ids, quantized, ONLINE.act_group, tree)
    run = K.moe_experts_tree if tree else K.moe_experts
    return run(x, experts.gate_up_proj, experts.down_proj, weights, ids)


def _layer_body(layer: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None, *, rope, layout, spec):
    """``LlamaDecoderLayer.forward`` of the engine on ``layer``'s parameters: ``(hidden, residual)`` in and out."""
    eps = spec.eps
    if residual is None:
        hidden, residual = K.rms_norm(hidden, layer.input_layernorm.weight, eps, None), hidden
    else:
        hidden, residual = K.rms_norm(hidden, layer.input_layernorm.weight, eps, residual)
    attn = layer.self_attn
    hidden = _attention(attn, hidden, rope, layout.attn, layout.num_blocks, spec.heads, eps, spec.tree, spec.fp8)
    hidden, residual = K.rms_norm(hidden, layer.post_attention_layernorm.weight, eps, residual)
    return _mlp(layer.mlp, hidden, spec.top_k, spec.renormalize, spec.tree, spec.fp8), residual


def layer_forward(self: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None, rope, layout, spec):
    """The patched ``forward`` of a decoder layer. Gradient checkpointing as transformers does it for its layers
    (``GradientCheckpointingLayer``), around the body only, so module hooks (FSDP's) stay outside."""
    body = partial(_layer_body, self, rope=rope, layout=layout, spec=spec)
    if getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
        return self._gradient_checkpointing_func(body, hidden, residual)
    return body(hidden, residual)
