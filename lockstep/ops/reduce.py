"""Batch-invariant row reductions: ``sum`` and ``mean``; also the row layout that rms_norm and softmax share.

The contract: a row's terms are combined in an order fixed by the row length N alone.

CUDA runs one Triton program per ``rows`` rows. Each program walks its rows in chunks of ``block`` columns,
adding chunk after chunk into a ``[rows, block]`` fp32 accumulator, then reduces the accumulator once with
``tl.sum``. ``row_config`` picks (block, rows, warps) from N only, so the order of every addition is fixed by N.
The CPU sums a row shorter than ATen's threading grain with torch's own ``sum`` (``row_sums``): ATen splits a
reduction across threads only over its outputs, or, for a lone output, once the row reaches the grain, so a short
row is always reduced whole by one thread, in a loop fixed by n, whatever the batch. A longer row folds pairwise
with elementwise ops (``fold_rows``): element j meets element j + ceil(n / 2), and so on until one is left.
Elementwise IEEE arithmetic gives the same bits in any lane, tensor shape or thread, so the whole batch folds at
once, with no row tiles and no padding. torch's own CPU ``sum`` gave one such long row other bits at M = 1 than at
M >= 2 (see tests/ops/test_reduce.py).
"""

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lockstep.ops._common import ATEN_GRAIN, cast_for_reduction, cdiv, next_power_of_2

# Rows up to this long are held in registers in one piece (rms_norm and softmax then read them once).
MAX_FUSED = 16384
# Longer rows are walked in chunks of this many columns.
CHUNK = 4096


@dataclass(frozen=True)
class RowConfig:
    block: int  # columns per chunk; a row of N <= block is one chunk
    rows: int  # rows per program
    num_warps: int


@functools.lru_cache(maxsize=1024)  # a pure function of n, asked at every launch of the row kernels
def row_config(n: int) -> RowConfig:
    """The program shape for rows of length ``n``. A function of ``n`` alone: it fixes every row's order."""
    if n > MAX_FUSED:
        return RowConfig(block=CHUNK, rows=1, num_warps=8)
    block = next_power_of_2(max(n, 1))
    rows = max(1, 2048 // block)  # short rows (head_dim norms): several per program
    return RowConfig(block=block, rows=rows, num_warps=min(16, max(4, rows * block // 512)))


@triton.jit
def _row_sum_kernel(
    x_ptr, out_ptr,
    M, N, stride_xm,
    divisor,
    MEAN: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    # Rows past M re-read row M - 1 (no masked-out rows to special-case); their results are never stored.
    x_rows = x_ptr + tl.minimum(rows, M - 1).to(tl.int64)[:, None] * stride_xm
    cols = tl.arange(0, BLOCK)[None, :]
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        acc += tl.load(x_rows + start + cols, mask=cols < N - start, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=1)
    if MEAN:
        total = tl.div_rn(total, tl.zeros_like(total) + divisor)
    tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=row_ok)


def _row_sum_triton(
    x: torch.Tensor, mean: bool, out_dtype: torch.dtype, config: RowConfig | None = None
) -> torch.Tensor:
    # x: [M, N] with unit column stride -> [M]
    m, n = x.shape
    out = torch.empty(m, device=x.device, dtype=out_dtype)
    if m == 0:
        return out
    cfg = config or row_config(n)
    _row_sum_kernel[(cdiv(m, cfg.rows),)](
        x, out, m, n, x.stride(0), float(n),
        MEAN=mean, ROWS=cfg.rows, BLOCK=cfg.block, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def fold_rows(x: torch.Tensor, combine: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Reduce the last dim of ``x: [M, n]`` (n >= 1) pairwise with an elementwise ``combine`` -> ``[M]``.

    Each step combines column j with column j + ceil(w / 2) of the current width w, so the order is a function
    of n alone. ``combine`` is ``torch.add`` or ``torch.maximum`` (it must take ``out=``).
    """
    while x.shape[1] > 1:
        width = x.shape[1]
        half = (width + 1) // 2
        if width % 2 == 0:
            x = combine(x[:, :half], x[:, half:])
        else:  # the middle column carries over unchanged
            head = x[:, :half].clone()
            combine(head[:, : width - half], x[:, half:], out=head[:, : width - half])
            x = head
    return x[:, 0]


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """Sum the last dim of ``x: [M, n]`` (n >= 1) -> ``[M]`` on the CPU, in an order fixed by n (module docstring).

    Short rows are one torch call (a few microseconds); the pairwise fold is ~log2(n) calls.
    """
    return x.sum(-1) if x.shape[1] < ATEN_GRAIN else fold_rows(x, torch.add)


def _row_sum_cpu(x: torch.Tensor, mean: bool, out_dtype: torch.dtype) -> torch.Tensor:
    # x: [M, N] -> [M]; fp32 accumulation, rounded once to out_dtype
    total = row_sums(x.float())
    return (total / x.shape[1] if mean else total).to(out_dtype)


def _row_sum(x: torch.Tensor, mean: bool, out_dtype: torch.dtype) -> torch.Tensor:
    # x: [M, N] -> [M]
    m, n = x.shape
    if n == 0:
        return torch.full((m,), math.nan if mean else 0.0, device=x.device, dtype=out_dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    if x.is_cuda:
        return _row_sum_triton(x, mean, out_dtype)
    return _row_sum_cpu(x, mean, out_dtype)


def _reduce(
    x: torch.Tensor, dim: int | Sequence[int] | None, keepdim: bool, dtype: torch.dtype | None, mean: bool
) -> torch.Tensor:
    x, out_dtype = cast_for_reduction(x, dtype)
    if x.dim() == 0:
        return _reduce(x.reshape(1), 0, False, out_dtype, mean).reshape(())
    # An empty dim list means every dim, as in torch.sum.
    dims = range(x.dim()) if dim is None or (not isinstance(dim, int) and len(dim) == 0) else dim
    dims = sorted({d % x.dim() for d in ([dims] if isinstance(dims, int) else dims)})
    kept = [d for d in range(x.dim()) if d not in dims]
    # Reduced dims go last and are flattened: [*kept, *reduced] -> [M, n]
    lead = [x.shape[d] for d in kept]
    rows = x.permute(*kept, *dims).reshape(math.prod(lead), math.prod(x.shape[d] for d in dims))
    out = _row_sum(rows, mean, out_dtype).reshape(lead)
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


def sum(
    x: torch.Tensor, dim: int | Sequence[int] | None = -1, keepdim: bool = False, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``torch.sum(x, dim, keepdim, dtype)`` for float tensors, batch-invariant; fp32 accumulation.

    ``dim`` is one dim, several (flattened into one reduction) or ``None`` for all. Output dtype is ``dtype``
    or ``x.dtype``; a ``dtype`` narrower than fp32 casts ``x`` first, as torch does.
    """
    return _reduce(x, dim, keepdim, dtype, mean=False)


def mean(
    x: torch.Tensor, dim: int | Sequence[int] | None = -1, keepdim: bool = False, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``torch.mean(x, dim, keepdim, dtype)``: ``sum`` divided (correctly rounded, in fp32) by the count."""
    return _reduce(x, dim, keepdim, dtype, mean=True)
