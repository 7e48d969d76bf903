"""Shared helpers for the op tests: inputs, bitwise comparison and the two invariance checks."""

import torch

SIZES = [1, 3, 17, 127, 1000]
INVARIANCE_MS = [1, 2, 3, 7, 17, 64, 127, 128, 129, 1000]
# (batch size, position) for a row moved among other rows.
MOVES = [(1, 0), (2, 1), (16, 15), (17, 16), (40, 3), (129, 128)]


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(as_int), b.view(as_int))


def check_prefixes(op, x, ms):
    """``op(x[:m]) == op(x)[:m]`` bit for bit, for each m."""
    full = op(x)
    for m in ms:
        assert same_bits(op(x[:m]), full[:m]), f"rows differ at m={m}"


def check_moved_row(op, x, moves):
    """Row 0 of x placed at other positions among other neighbours must keep its bits."""
    full0 = op(x[:1])[0]
    for m, pos in moves:
        batch = randn(m, *x.shape[1:], dtype=x.dtype, seed=100 + m)
        batch[pos] = x[0]
        assert same_bits(op(batch)[pos], full0), f"row moved to {pos} of {m} differs"
