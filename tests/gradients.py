"""Gradient checks against float64 finite differences, shared by the op and RL tests."""

import torch


def randn(*shape, seed=1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_directional(fn32, fn64, inputs: list[torch.Tensor], eps: float = 1e-6, rtol: float = 2e-3) -> None:
    """``sum(fn32(*inputs) * w)``'s gradient, dotted with a random direction, vs. fp64 finite differences."""
    gen = torch.Generator().manual_seed(0)
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn32(*leaves)
    w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out.double() * w).sum().backward()
    for x in leaves:
        assert torch.isfinite(x.grad).all()
    dirs = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in inputs]
    analytic = sum((x.grad.double() * d).sum() for x, d in zip(leaves, dirs, strict=True))
    x64 = [x.detach().double() for x in inputs]

    def f(sign: float) -> torch.Tensor:
        return (fn64(*[x + sign * eps * d for x, d in zip(x64, dirs, strict=True)]) * w).sum()

    numeric = (f(1.0) - f(-1.0)) / (2 * eps)
    assert abs(float(analytic) - float(numeric)) <= rtol * max(1.0, abs(float(numeric))), (analytic, numeric)
