"""Differentiable versions of the batch-invariant ops: ``linear``, ``tree_linear``, ``rms_norm``, ``log_softmax``.

Each forward calls the op itself, so a trainer's forward values are the engine's bits. The backward passes are
deterministic run to run and use no atomics:

- ``linear`` and ``tree_linear`` (the chunk tree of ``ops.tp_linear``, which orders the forward's sum only):
  ``grad_x = grad @ W`` and ``grad_W = grad^T @ x`` with the same invariant ``mm`` (one sequential reduction over
  K per output element); ``grad_b`` is an fp32 column sum.
- ``rms_norm`` and ``log_softmax``: the textbook gradients in fp32 from the saved inputs/outputs. The roundings
  of the forward (to the model dtype before and after the weight) are treated as identities, as every
  framework does.

Only the forward carries the bitwise contract; a backward's bits may follow the batch (its column sums run over
the tokens of the micro-batch), but never the run.
"""

import torch

from lockstep.ops.matmul import linear as _linear
from lockstep.ops.matmul import mm
from lockstep.ops.rms_norm import rms_norm as _rms_norm
from lockstep.ops.softmax import log_softmax as _log_softmax
from lockstep.ops.tp_linear import tree_linear as _tree_linear

__all__ = ["linear", "log_softmax", "rms_norm", "tree_linear"]


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
        # h: [..., N]; y = (h * rstd) * w, rstd = 1 / sqrt(mean(h^2) + eps)
        hf, g = h.float(), grad_out.float()
        rstd = torch.rsqrt((hf * hf).mean(-1, keepdim=True) + ctx.eps)
        normed = hf * rstd
        grad_normed = g * weight.float() if weight is not None else g
        grad_hf = rstd * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        if grad_h is not None:
            grad_hf = grad_hf + grad_h.float()
        grad_x = grad_hf.to(h.dtype)
        grad_w = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = (g * normed).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype)
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
