"""Batch-invariant ``softmax`` and ``log_softmax``, computed in fp32.

The contract: a row's max and its sum of exponentials are combined in an order fixed by N alone.

CUDA runs one Triton program per ``rows`` rows, shaped by ``reduce.row_config(N)``. A row of up to ``MAX_FUSED``
columns is read once into registers (max, exp, sum, write: one read and one write per element). A longer row
takes two passes: an online pass keeps a running max and a ``[rows, block]`` accumulator of exponentials,
rescaled whenever the max grows, reduced once at the end; the second pass reads the row again (last chunk first,
for L2 hits) and writes the result. The CPU folds the max pairwise (``reduce.fold_rows``) and sums with
``reduce.row_sums``, over the whole batch; torch's CPU ``exp``/``log`` gave an element the same bits at any
position and in any shape (the tests move rows around to check it).
"""

import math

import torch
import triton
import triton.language as tl

from lockstep.ops._common import cast_for_reduction
from lockstep.ops.reduce import RowConfig, fold_rows, row_config, row_sums


@triton.jit
def _store_stats(stats_ptr, rows, M, row_max, log_total):
    # row_max, log_total: [ROWS, 1] -> stats[row] = (row_max, log_total)
    at = stats_ptr + rows[:, None] * 2
    ok = (rows < M)[:, None]
    tl.store(at, row_max, mask=ok)
    tl.store(at + 1, log_total, mask=ok)


@triton.jit
def _softmax_kernel(
    x_ptr, out_ptr, stats_ptr,
    M, N, stride_xm, stride_om,
    LOG: tl.constexpr, STATS: tl.constexpr, SINGLE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # STATS: instead of the output, store each row's max and log of its sum of exponentials (stats_ptr: [M, 2]
    # fp32): log_softmax's element is then (x - max) - log_sum, the two subtractions below (log_softmax_at).
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = (rows < M)[:, None]
    # Rows past M re-read row M - 1 (no all-masked rows, no NaN); their results are never stored.
    safe_rows = tl.minimum(rows, M - 1).to(tl.int64)[:, None]
    x_rows = x_ptr + safe_rows * stride_xm
    o_rows = out_ptr + safe_rows * stride_om
    dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)[None, :]
    if SINGLE:  # the row fits in registers: one read, one write
        mask = cols < N
        x = tl.load(x_rows + cols, mask=mask, other=-float("inf")).to(tl.float32)
        row_max = tl.max(x, axis=1)[:, None]
        shifted = x - row_max
        e = tl.exp(shifted)
        total = tl.sum(e, axis=1)[:, None]
        if STATS:
            _store_stats(stats_ptr, rows, M, row_max, tl.log(total))
        else:
            if LOG:
                y = shifted - tl.log(total)
            else:
                y = e * tl.div_rn(tl.full((ROWS, 1), 1.0, tl.float32), total)
            tl.store(o_rows + cols, y.to(dtype), mask=mask & row_ok)
    else:
        run_max = tl.full((ROWS,), -float("inf"), tl.float32)
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for start in range(0, N, BLOCK):
            mask = cols < N - start
            x = tl.load(x_rows + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
            new_max = tl.maximum(run_max, tl.max(x, axis=1))
            # A row that is all -inf so far keeps exp(-inf - 0) = 0 terms instead of NaN.
            shift = tl.where(new_max == -float("inf"), 0.0, new_max)
            acc = acc * tl.exp(run_max - shift)[:, None] + tl.exp(x - shift[:, None])
            run_max = new_max
        row_max = run_max[:, None]
        total = tl.sum(acc, axis=1)[:, None]
        inv_total = tl.div_rn(tl.full((ROWS, 1), 1.0, tl.float32), total)
        log_total = tl.log(total)
        if STATS:
            _store_stats(stats_ptr, rows, M, row_max, log_total)
        else:
            # Last chunk first: the chunks read most recently are the likeliest still in L2.
            num_chunks = tl.cdiv(N, BLOCK)
            for i in range(0, num_chunks):
                start = (num_chunks - 1 - i) * BLOCK
                mask = cols < N - start
                x = tl.load(x_rows + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
                shifted = x - row_max
                if LOG:
                    y = shifted - log_total
                else:
                    y = tl.exp(shifted) * inv_total
                tl.store(o_rows + start + cols, y.to(dtype), mask=mask & row_ok)


def _softmax_triton(
    x: torch.Tensor, log: bool, out_dtype: torch.dtype, config: RowConfig | None = None, stats: bool = False
) -> torch.Tensor:
    # x: [M, N] with unit column stride -> [M, N] in out_dtype, or with stats [M, 2] fp32 (max, log of the sum)
    m, n = x.shape
    out = torch.empty((m, 2) if stats else (m, n), device=x.device, dtype=torch.float32 if stats else out_dtype)
    if m == 0 or n == 0:
        return out
    cfg = config or row_config(n)
    _softmax_kernel[(triton.cdiv(m, cfg.rows),)](
        x, out, out, m, n, x.stride(0), out.stride(0),
        LOG=log, STATS=stats, SINGLE=n <= cfg.block, ROWS=cfg.rows, BLOCK=cfg.block, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def _softmax_cpu(x: torch.Tensor, log: bool, out_dtype: torch.dtype) -> torch.Tensor:
    # x: [M, N] -> [M, N] in out_dtype
    if x.shape[1] == 0:
        return torch.empty(x.shape, dtype=out_dtype)
    xf = x.float()
    shifted = xf - fold_rows(xf, torch.maximum)[:, None]
    e = torch.exp(shifted)
    total = row_sums(e)[:, None]
    y = shifted - torch.log(total) if log else e * (1.0 / total)
    return y.to(out_dtype)


def _softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None, log: bool) -> torch.Tensor:
    x, out_dtype = cast_for_reduction(x, dtype)
    if x.dim() == 0:
        return _softmax(x.reshape(1), 0, out_dtype, log).reshape(())
    dim = dim % x.dim()
    last = dim == x.dim() - 1
    xt = x if last else x.movedim(dim, -1)
    # xt: [*lead, N] -> [num_rows, N]
    x2 = xt.reshape(math.prod(xt.shape[:-1]), xt.shape[-1])
    if x2.shape[1] > 0 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = _softmax_triton(x2, log, out_dtype) if x.is_cuda else _softmax_cpu(x2, log, out_dtype)
    out = out.reshape(xt.shape)
    return out if last else out.movedim(-1, dim).contiguous()


def softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.softmax(x, dim, dtype)``, batch-invariant; computed in fp32, returned in ``dtype or x.dtype``.

    A ``dtype`` narrower than fp32 casts ``x`` first, as torch does.
    """
    return _softmax(x, dim, dtype, log=False)


def log_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.log_softmax(x, dim, dtype)``, batch-invariant; computed in fp32, returned in ``dtype or x.dtype``."""
    return _softmax(x, dim, dtype, log=True)


def log_softmax_at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(x)[r, index[r]]`` for ``x: [rows, N]`` fp32 and ``index: [rows]`` int64, with the same bits (a
    row with nothing above -inf gives NaN either way).

    On CUDA the [rows, N] result is never written: the kernel's first pass stores each row's max and log-sum
    (the very values its second pass uses), and the chosen element takes the second pass's two fp32
    subtractions. A sampler that wants only the sampled tokens' logprobs reads the logits once instead of twice
    and writes nothing that size."""
    if x.dim() != 2 or index.shape != (x.shape[0],):
        raise ValueError(f"log_softmax_at: x {tuple(x.shape)} and index {tuple(index.shape)} do not fit")
    if not (x.is_cuda and x.dtype == torch.float32 and x.shape[1] > 0 and x.stride(1) == 1):
        return log_softmax(x, -1).gather(1, index[:, None])[:, 0]
    stats = _softmax_triton(x, True, torch.float32, stats=True)
    return (x.gather(1, index[:, None])[:, 0] - stats[:, 0]) - stats[:, 1]
