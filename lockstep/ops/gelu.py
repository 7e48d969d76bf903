"""Batch-invariant GELU: ``gelu``, exact (erf) or the tanh approximation, the vision MLPs' activation.

Elementwise, so nothing is reduced; what can still follow the batch is where an element falls in a CPU kernel's
loop. torch's fused CPU ``F.gelu`` computes the vector body and the scalar tail of a tensor (and of each thread's
share of it) differently: the same value gave other bits at other offsets in fp32, bf16 and fp16, exact and tanh
(tests/ops/test_gelu.py keeps that as the negative control). ``torch.erf``, ``torch.exp`` and IEEE arithmetic give
the same bits in every lane, so the CPU path composes GELU from them in fp32 and rounds once (the tanh form as
``x / (1 + exp(-2u))``, the same function). A
CUDA elementwise kernel runs one function per element whatever its index, so CUDA keeps ``F.gelu``, which also
computes in fp32 and rounds once.
"""

import math

import torch
import torch.nn.functional as F

from lockstep.ops._common import FLOATS

_SQRT_HALF = math.sqrt(0.5)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715


def _gelu_cpu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    # x: any shape -> same shape and dtype; fp32 inside, one op at a time
    xf = x.float()
    if approximate == "tanh":
        # x / 2 * (1 + tanh(u)) = x / (1 + exp(-2u)): no cancellation where tanh(u) nears -1, and CPU exp is
        # several times faster than tanh.
        u = xf * xf
        u.mul_(xf).mul_(_KAPPA).add_(xf).mul_(-2.0 * _SQRT_2_OVER_PI).exp_().add_(1.0)
        return torch.div(xf, u).to(x.dtype)
    return (xf * _SQRT_HALF).erf_().add_(1.0).mul_(xf * 0.5).to(x.dtype)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x, approximate=approximate)`` (``"none"``: ``x / 2 * (1 + erf(x / sqrt 2))``; ``"tanh"``: with
    ``tanh(sqrt(2 / pi) * (x + 0.044715 x^3))``), in fp32, rounded to ``x``'s dtype; an element's bits never
    depend on the tensor around it."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if x.dtype not in FLOATS:
        raise TypeError(f"expected a float32/bfloat16/float16 tensor, got {x.dtype}")
    if x.is_cuda:
        return F.gelu(x, approximate=approximate)
    return _gelu_cpu(x, approximate)
