"""``combine``: a token's k expert outputs summed in fp32 in rank order (never atomics, never the sort's order)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _combine_kernel(
    y_ptr, w_ptr, rows_ptr, out_ptr, H, stride_y, stride_o, TOP_K: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    # out[t] = sum over j = 0, 1, ..., k - 1 of w[t, j] * y[rows[t, j]], in fp32, in that order.
    t = tl.program_id(0)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    mask = offs < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(rows_ptr + t * TOP_K + j)
        w = tl.load(w_ptr + t * TOP_K + j)
        y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        acc += w * y
    tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _combine_triton(y: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    num_tokens, top_k = weights.shape
    hidden = y.shape[1]
    out = torch.empty((num_tokens, hidden), device=y.device, dtype=y.dtype)
    if num_tokens == 0:
        return out
    bh = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, bh))](
        y, weights.contiguous(), rows.contiguous(), out, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BH=bh
    )
    return out


def _combine_cpu(y: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    # Elementwise products and sums: one correctly rounded operation per element, the same bits on every path.
    acc = weights[:, 0, None] * y[rows[:, 0]].float()
    for j in range(1, weights.shape[1]):
        acc = acc + weights[:, j, None] * y[rows[:, j]].float()
    return acc.to(y.dtype)


def combine(y: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * y[rows[t, j]]`` in fp32, j = 0 to k - 1 in order, rounded to y's dtype.

    ``y: [P, H]`` (expert outputs, sorted rows), ``weights: [n, k]`` fp32, ``rows: [n, k]`` int64.
    """
    if y.is_cuda:
        return _combine_triton(y, weights, rows)
    return _combine_cpu(y, weights, rows)
