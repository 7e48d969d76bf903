"""Differentiable versions of the batch-invariant ops: ``linear``, ``tree_linear``, ``rms_norm``, ``log_softmax``,
``moe_route``, ``moe_experts``, and the vision towers' ``layer_norm``, ``gelu``, ``vision_attention``.

Each forward calls the op itself, so a trainer's forward values are the engine's bits. The backward passes are
deterministic run to run and use no atomics:

- ``linear`` and ``tree_linear`` (the chunk tree of ``ops.tp_linear``, which orders the forward's sum only):
  ``grad_x = grad @ W`` and ``grad_W = grad^T @ x`` with the same invariant ``mm`` (one sequential reduction over
  K per output element); ``grad_b`` is an fp32 column sum.
- ``fp8_linear`` (a trainer's FP8 layer: its full-precision master weight quantized to the sampler's e4m3 values
  and scales, ``ops.fp8.fp8_linear`` or its chunk tree ``ops.fp8_tree`` in the forward): the straight-through
  estimator. The forward's two quantizations (the weight's and the activations') are treated as identities, so
  ``grad_x = grad @ dequantize(w8, scale)`` (the weight the forward used) and ``grad_W = grad^T @ x`` (the
  unquantized activations) land on the master weight, in its dtype; ``grad_b`` is an fp32 column sum. A weight
  element that the forward saturated at +-448 x its scale still gets its gradient (no clipping mask).
- ``rms_norm`` and ``log_softmax``: the textbook gradients in fp32 from the saved inputs/outputs (RMSNorm's in one
  Triton pass on CUDA, ``ops.rms_norm_backward``). The roundings
  of the forward (to the model dtype before and after the weight) are treated as identities, as every
  framework does.
- ``moe_route``: the gradient of the chosen experts' (renormalised) softmax probabilities in fp32 into the
  router logits; the choice itself is piecewise constant.
- ``moe_experts`` and ``moe_experts_tree`` (the chunk tree over each expert's down projection, which orders the
  forward's sum only): recomputed in fp32 with plain torch ops (``ops.moe.experts_reference``) and
  differentiated by autograd, as the trainer's attention backward does (``rl/attention.py``).
- ``moe_experts_fp8`` (a trainer's FP8 experts: its masters quantized to the sampler's e4m3 values and scales,
  ``ops.moe_fp8`` or its chunk tree in the forward): straight-through, as ``fp8_linear``: the experts' fp32
  recomputation with the dequantized weights the forward used, the activations' quantizations (before each
  matmul) treated as identities; the weights' gradients land on the masters, in their dtype.
- ``layer_norm``, ``gelu`` and ``vision_attention`` likewise: recomputed in fp32 with ``F.layer_norm``, ``F.gelu``
  and one ``F.scaled_dot_product_attention`` per segment, differentiated by autograd.

Only the forward carries the bitwise contract; a backward's bits may follow the batch (its column sums run over
the tokens of the micro-batch), but never the run.
"""

import torch

from lockstep.ops import fp8 as _fp8
from lockstep.ops import fp8_tree as _fp8_tree
from lockstep.ops import rms_norm_backward as _rms_norm_backward
from lockstep.ops.gelu import gelu as _gelu
from lockstep.ops.layer_norm import layer_norm as _layer_norm
from lockstep.ops.matmul import linear as _linear
from lockstep.ops.matmul import mm
from lockstep.ops.moe import experts as _moe_experts
from lockstep.ops.moe import experts_reference as _moe_experts_reference
from lockstep.ops.moe import experts_tree as _moe_experts_tree
from lockstep.ops.moe import route as _moe_route
from lockstep.ops.moe_fp8 import experts_fp8 as _experts_fp8
from lockstep.ops.moe_fp8_tree import experts_fp8_tree as _experts_fp8_tree
from lockstep.ops.rms_norm import rms_norm as _rms_norm
from lockstep.ops.softmax import log_softmax as _log_softmax
from lockstep.ops.tp_linear import tree_linear as _tree_linear
from lockstep.ops.vision_attention import vision_attention as _vision_attention

__all__ = [
    "fp8_linear",
    "gelu",
    "layer_norm",
    "linear",
    "log_softmax",
    "moe_experts",
    "moe_experts_fp8",
    "moe_experts_tree",
    "moe_route",
    "rms_norm",
    "tree_linear",
    "vision_attention",
]


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _linear_backward(ctx, grad)


class _TreeLinear(torch.autograd.Function):
    """The chunk-tree linear's forward (``ops.tp_linear``); its gradient is the linear's: the tree only orders
    the forward's sum, and the backward's bits need not be invariant."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _tree_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _linear_backward(ctx, grad)


class _Fp8Linear(torch.autograd.Function):
    """The FP8 linear's forward from the quantized master weight; the straight-through backward (see above)."""

    @staticmethod
    def forward(ctx, x, weight, bias, w8, w_scale, act_group, tree):
        ctx.save_for_backward(x, _fp8.dequantize(w8, w_scale, weight.dtype))
        ctx.has_bias = bias is not None
        if tree:
            return _fp8_tree.tree_linear(x, w8, w_scale, bias, act_group)
        return _fp8.fp8_linear(x, w8, w_scale, bias, act_group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (*_linear_backward(ctx, grad), None, None, None, None)


def _linear_backward(ctx, grad: torch.Tensor):
    """The gradients of ``x @ weight.T + bias`` from the saved ``x`` and ``weight``."""
    x, weight = ctx.saved_tensors
    # grad: [..., N], x: [..., K], weight: [N, K]
    g2 = grad.reshape(-1, grad.shape[-1]).to(weight.dtype)
    x2 = x.reshape(-1, x.shape[-1])
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = mm(g2, weight).reshape(x.shape).to(x.dtype)
    if ctx.needs_input_grad[1]:
        # [N, K], each element reduced over the tokens in one sequential loop. The operand with fewer columns
        # goes on the left (fewer row tiles on the CPU); both orders reduce the same terms in the same order.
        x2 = x2.to(weight.dtype)
        n, k = weight.shape
        grad_w = mm(x2.t(), g2).t().contiguous() if n > k else mm(g2.t(), x2)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = g2.float().sum(0).to(weight.dtype)
    return grad_x, grad_w, grad_b


def rms_norm_backward_reference(
    h: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    grad_out: torch.Tensor,
    grad_h: torch.Tensor | None,
    weight_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm's ``(dh, dw)`` in torch ops, fp32 (the CPU's path; CUDA's is ``ops.rms_norm_backward``)."""
    # h: [..., N]; y = (h * rstd) * w, rstd = 1 / sqrt(mean(h^2) + eps)
    hf, g = h.float(), grad_out.float()
    rstd = torch.rsqrt((hf * hf).mean(-1, keepdim=True) + eps)
    normed = hf * rstd
    grad_normed = g * weight.float() if weight is not None else g
    grad_hf = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
    if grad_h is not None:
        grad_hf = grad_hf + grad_h.float()
    grad_w = None
    if weight is not None and weight_grad:
        grad_w = (g * normed).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype)
    return grad_hf.to(h.dtype), grad_w


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps: float):
        out, h = _rms_norm(x, weight, eps, residual) if residual is not None else (_rms_norm(x, weight, eps), x)
        ctx.save_for_backward(h, weight)
        ctx.eps = eps
        ctx.has_residual = residual is not None
        if residual is None:
            return out
        return out, h

    @staticmethod
    def backward(ctx, grad_out, grad_h=None):
        h, weight = ctx.saved_tensors
        if h.is_cuda and h.shape[-1] <= _rms_norm_backward.MAX_N:  # the same formula in one Triton pass
            grad_x, grad_w = _rms_norm_backward.rms_norm_backward(h, weight, ctx.eps, grad_out, grad_h)
            if not ctx.needs_input_grad[1]:
                grad_w = None
            return grad_x, grad_w, grad_x if ctx.has_residual else None, None
        grad_x, grad_w = rms_norm_backward_reference(h, weight, ctx.eps, grad_out, grad_h, ctx.needs_input_grad[1])
        return grad_x, grad_w, grad_x if ctx.has_residual else None, None


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = _log_softmax(x, -1)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        g = grad.float()
        return (g - out.float().exp() * g.sum(-1, keepdim=True)).to(out.dtype)


class _MoERoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, top_k: int, renormalize: bool):
        weights, ids = _moe_route(logits, top_k, renormalize)
        ctx.save_for_backward(logits, ids)
        ctx.renormalize = renormalize
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx, grad_weights: torch.Tensor, _grad_ids):
        logits, ids = ctx.saved_tensors
        probs = torch.softmax(logits.float(), dim=-1)  # [n, E]
        chosen = probs.gather(1, ids)  # [n, k]
        g = grad_weights.float()
        if ctx.renormalize:  # w = q / sum(q): dq = (g - sum(g * w)) / sum(q)
            total = chosen.sum(-1, keepdim=True)
            g = (g - (g * (chosen / total)).sum(-1, keepdim=True)) / total
        grad_probs = torch.zeros_like(probs).scatter(1, ids, g)  # a token's k ids are distinct
        grad_logits = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))
        return grad_logits.to(logits.dtype), None, None


class _MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w13, w2, weights, ids):
        ctx.save_for_backward(x, w13, w2, weights, ids)
        return _moe_experts(x, w13, w2, weights, ids)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # The gradients of the routed experts' combined output, recomputed in fp32 from the saved inputs.
        x, w13, w2, weights, ids = ctx.saved_tensors
        inputs = [t.detach().float().requires_grad_() for t in (x, w13, w2, weights)]
        with torch.enable_grad():
            out = _moe_experts_reference(*inputs, ids)
        wanted = [i for i in range(4) if ctx.needs_input_grad[i]]
        grads = torch.autograd.grad(out, [inputs[i] for i in wanted], grad.float(), allow_unused=True)
        result: list[torch.Tensor | None] = [None] * 5
        originals = (x, w13, w2, weights)
        for i, g in zip(wanted, grads, strict=True):
            result[i] = torch.zeros_like(originals[i]) if g is None else g.to(originals[i].dtype)
        return tuple(result)


class _MoEExpertsTree(_MoEExperts):
    """The chunk-tree experts' forward (``ops.moe.experts_tree``); the gradient is the experts' own."""

    @staticmethod
    def forward(ctx, x, w13, w2, weights, ids):
        ctx.save_for_backward(x, w13, w2, weights, ids)
        return _moe_experts_tree(x, w13, w2, weights, ids)


class _MoEExpertsFp8(_MoEExperts):
    """FP8 experts' forward (``ops.moe_fp8``, or its chunk tree) from the quantized masters; the straight-through
    backward: the experts' own fp32 recomputation with the dequantized weights the forward used in place of the
    masters, the activations' quantizations as identities; the weights' gradients land on the masters."""

    @staticmethod
    def forward(ctx, x, w13, w2, weights, ids, w13_8, s13, w2_8, s2, act_group, tree):
        deq13 = _fp8.dequantize(w13_8.reshape(-1, w13_8.shape[2]), s13.reshape(-1, s13.shape[2]), w13.dtype)
        deq2 = _fp8.dequantize(w2_8.reshape(-1, w2_8.shape[2]), s2.reshape(-1, s2.shape[2]), w2.dtype)
        ctx.save_for_backward(x, deq13.view(w13.shape), deq2.view(w2.shape), weights, ids)
        fn = _experts_fp8_tree if tree else _experts_fp8
        return fn(x, w13_8, s13, w2_8, s2, weights, ids, act_group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (*_MoEExperts.backward(ctx, grad), *([None] * 6))


def _recomputed_grads(ctx, grad: torch.Tensor, reference, inputs: tuple, num_args: int) -> tuple:
    # The gradients of ``reference(*inputs)`` (float tensors or None first, then other arguments), recomputed in
    # fp32 from the saved inputs; None for inputs that need none. ``num_args``: the Function's argument count.
    floats = [t.detach().float().requires_grad_() if isinstance(t, torch.Tensor) else t for t in inputs]
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and ctx.needs_input_grad[i]]
    with torch.enable_grad():
        out = reference(*floats)
    grads = torch.autograd.grad(out, [floats[i] for i in wanted], grad.float(), allow_unused=True)
    result: list[torch.Tensor | None] = [None] * num_args
    for i, g in zip(wanted, grads, strict=True):
        result[i] = torch.zeros_like(inputs[i]) if g is None else g.to(inputs[i].dtype)
    return tuple(result)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float):
        ctx.save_for_backward(x, weight, bias)
        ctx.eps = eps
        return _layer_norm(x, weight, bias, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, bias = ctx.saved_tensors
        eps = ctx.eps

        def reference(x, weight, bias):
            return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)

        return _recomputed_grads(ctx, grad, reference, (x, weight, bias), 4)


class _Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, approximate: str):
        ctx.save_for_backward(x)
        ctx.approximate = approximate
        return _gelu(x, approximate)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        approximate = ctx.approximate
        return _recomputed_grads(ctx, grad, lambda x: torch.nn.functional.gelu(x, approximate=approximate), (x,), 2)


class _VisionAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale: float):
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.scale = scale
        return _vision_attention(q, k, v, cu_seqlens, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, cu_seqlens = ctx.saved_tensors
        cu, scale = cu_seqlens.tolist(), ctx.scale

        def reference(q, k, v):
            # [L, heads, D] -> [heads, L, D] per segment, one SDPA call each
            outs = [
                torch.nn.functional.scaled_dot_product_attention(
                    *(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=scale
                ).transpose(0, 1)
                for a, b in zip(cu[:-1], cu[1:], strict=True)
                if b > a
            ]
            return torch.cat(outs) if outs else q * 0

        return _recomputed_grads(ctx, grad, reference, (q, k, v), 5)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``ops.layer_norm`` with autograd into ``x``, the weight and the bias."""
    return _LayerNorm.apply(x, weight, bias, eps)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``ops.gelu`` with autograd."""
    return _Gelu.apply(x, approximate)


def vision_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """``ops.vision_attention`` with autograd into ``q``, ``k`` and ``v``."""
    return _VisionAttention.apply(q, k, v, cu_seqlens, scale)


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.moe.route`` with autograd into the logits (through the weights; the ids carry no gradient)."""
    return _MoERoute.apply(logits, top_k, renormalize)


def moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``ops.moe.experts`` with autograd into ``x``, the expert weights and the routing weights."""
    return _MoEExperts.apply(x, w13, w2, weights, ids)


def moe_experts_tree(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``ops.moe.experts_tree`` (the tensor-parallel-invariant numerics in one process) with autograd."""
    return _MoEExpertsTree.apply(x, w13, w2, weights, ids)


def moe_experts_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    act_group: int | None,
    tree: bool = False,
) -> torch.Tensor:
    """``ops.moe_fp8.experts_fp8`` (``tree``: ``ops.moe_fp8_tree.experts_fp8_tree``) of ``quantized`` =
    ``(w13_8, s13, w2_8, s2)``, the master experts ``w13``/``w2`` quantized as the sampler holds them; gradients
    reach ``x``, the masters and the routing weights straight through the quantization."""
    return _MoEExpertsFp8.apply(x, w13, w2, weights, ids, *quantized, act_group, tree)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    act_group: int | None,
    tree: bool = False,
) -> torch.Tensor:
    """``ops.fp8.fp8_linear(x, w8, w_scale, bias, act_group)`` (``tree``: its chunk tree, ``ops.fp8_tree``), where
    ``w8``/``w_scale`` quantize the master ``weight``; gradients reach ``x``, ``weight`` and ``bias`` straight
    through the quantization."""
    return _Fp8Linear.apply(x, weight, bias, w8, w_scale, act_group, tree)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.linear`` with autograd: ``x: [..., K]``, ``weight: [N, K]``, ``bias: [N]`` -> ``[..., N]``."""
    return _Linear.apply(x, weight, bias)


def tree_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.tp_linear.tree_linear`` (the tensor-parallel-invariant numerics in one process) with autograd."""
    return _TreeLinear.apply(x, weight, bias)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``ops.rms_norm`` with autograd; the same signature and return values."""
    return _RMSNorm.apply(x, weight, residual, eps)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """``ops.log_softmax`` over the last dim with autograd."""
    return _LogSoftmax.apply(x)
