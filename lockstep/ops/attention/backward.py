"""The gradient of causal attention over whole packed sequences, in Triton: ``causal_attention_backward``.

A trainer's backward (``rl/attention.py``) needs the gradient only, never the engine's bits: it must be
deterministic run to run, and accurate. This is FlashAttention-2's backward without atomics:

- ``_stats_kernel`` (a program per query tile and head): each row's log-sum-exp over its causal keys (log2 units,
  an online max and sum in fp32) and ``delta = rowsum(dO * O)``, from the forward's own output;
- ``_dkdv_kernel`` (a program per key tile and KV head): the tile's dK and dV, summed over every query head of its
  group and every query tile at or after it, in that order, in fp32 registers: one program owns each dK/dV row;
- ``_dq_kernel`` (a program per query tile and head): dQ over the row's causal key tiles, in order.

So every gradient element is reduced by one program in a fixed order: the same bits at every run. Scores are
recomputed in fp32 from the operands' dtype (bf16 products, fp32 sums, as the forward); P and dS are rounded to
the operands' dtype for the dV, dK and dQ products, as FlashAttention does. A sequence's queries are its own keys,
from position 0 (the trainer's fresh cache; ``rl/attention.py`` falls back to its reference otherwise).
"""

import math

import torch
import triton
import triton.language as tl

from lockstep.ops._common import interpreting, next_power_of_2

# Tile shapes: launch choices only (every reduction runs over all its terms in a fixed order whatever they are).
_STATS_M, _STATS_N = 64, 64
_DKDV_M, _DKDV_N = 32, 64
_DQ_M, _DQ_N = 64, 32
# 8 warps: at head_dim 128 in bf16 each kernel then fits in registers (4 warps spilled; ptxas, sm_90).
_WARPS = 8
_STAGES = 2  # software-pipeline depth of the stats and dQ kernels' loops
# The dK/dV kernel's loop nest (query heads, then query tiles) runs unpipelined: on the H200 (Triton 3.6) a pipelined
# build gave dK that differed from run to run and was wrong (max error 4.9e-2 to 1.3e-1 of max |dK| against fp64 at
# 2 stages, and at 3 stages with 4 warps; 3.9e-3, the same bits every run, at 1 stage), while dQ and dV were right at
# every depth (session 15, bench/_tmp probe; `bench/hf_trainer.py --components` repeats the check).
_DKDV_STAGES = 1


@triton.jit
def _scores(q, k_t, row, col, row_end, qk_scale, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # q: [M, D], k_t: [D, N] -> s: [M, N] fp32 in log2 units, -inf off the causal triangle and past the sequence.
    if UPCAST:  # the interpreter's bf16/fp16 dot is wrong; run it in fp32 there
        q = q.to(tl.float32)
        k_t = k_t.to(tl.float32)
    s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale
    ok = (col[None, :] <= row[:, None]) & (row[:, None] < row_end)
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _stats_kernel(
    q_ptr, k_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, blocks_ptr, total,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_dot, stride_doh, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # blocks: [num_blocks, 3] int32 = (the tile's first row, its sequence's first token, its end); lse, delta:
    # [heads, total] fp32.
    block, head = tl.program_id(0), tl.program_id(1)
    m0 = tl.load(blocks_ptr + 3 * block)
    seq_start = tl.load(blocks_ptr + 3 * block + 1)
    seq_end = tl.load(blocks_ptr + 3 * block + 2)
    rows = m0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D_PAD)
    row_ok = rows < seq_end
    io = row_ok[:, None] & (dims[None, :] < HEAD_DIM)
    rows64 = rows.to(tl.int64)[:, None]
    q = tl.load(q_ptr + rows64 * stride_qt + head * stride_qh + dims[None, :], mask=io, other=0.0)
    o = tl.load(o_ptr + rows64 * stride_ot + head * stride_oh + dims[None, :], mask=io, other=0.0)
    do = tl.load(do_ptr + rows64 * stride_dot + head * stride_doh + dims[None, :], mask=io, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    kv_head = head // GROUP
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(seq_start, tl.minimum(m0 + BLOCK_M, seq_end), BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k_t = tl.load(k_ptr + cols.to(tl.int64)[None, :] * stride_kt + kv_head * stride_kh + dims[:, None],
                      mask=(cols[None, :] < seq_end) & (dims[:, None] < HEAD_DIM), other=0.0)  # fmt: skip
        s = _scores(q, k_t, rows, cols, seq_end, qk_scale, UPCAST, PRECISION)
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past the end see no key
        den = den * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m = m_new
    out = head.to(tl.int64) * total + rows
    tl.store(lse_ptr + out, m + tl.log2(tl.where(row_ok, den, 1.0)), mask=row_ok)
    tl.store(delta_ptr + out, delta, mask=row_ok)


@triton.jit
def _dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, blocks_ptr, total,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, qk_scale, scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # A program: the BLOCK_N keys from blocks[program, 0] of one KV head; dK, dV summed over the GROUP query heads
    # (in order) and, for each, the query tiles from the key tile's first row to the sequence's end (in order).
    block, kv_head = tl.program_id(0), tl.program_id(1)
    n0 = tl.load(blocks_ptr + 3 * block)
    seq_end = tl.load(blocks_ptr + 3 * block + 2)
    cols = n0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D_PAD)
    col_ok = cols < seq_end
    kv_io = col_ok[:, None] & (dims[None, :] < HEAD_DIM)
    cols64 = cols.to(tl.int64)[:, None]
    k = tl.load(k_ptr + cols64 * stride_kt + kv_head * stride_kh + dims[None, :], mask=kv_io, other=0.0)
    v = tl.load(v_ptr + cols64 * stride_vt + kv_head * stride_vh + dims[None, :], mask=kv_io, other=0.0)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for m0 in range(n0, seq_end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < seq_end
            io = row_ok[:, None] & (dims[None, :] < HEAD_DIM)
            rows64 = rows.to(tl.int64)[:, None]
            q = tl.load(q_ptr + rows64 * stride_qt + head * stride_qh + dims[None, :], mask=io, other=0.0)
            do = tl.load(do_ptr + rows64 * stride_dot + head * stride_doh + dims[None, :], mask=io, other=0.0)
            stat = head.to(tl.int64) * total + rows
            lse = tl.load(lse_ptr + stat, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)
            s = _scores(q, tl.trans(k), rows, cols, seq_end, qk_scale, UPCAST, PRECISION)  # [M, N]
            p = tl.exp2(s - lse[:, None])  # 0 off the triangle
            dv += _dot(tl.trans(p.to(do.dtype)), do, UPCAST, PRECISION)
            dp = _dot(do, tl.trans(v), UPCAST, PRECISION)  # [M, N]
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(ds.to(q.dtype)), q, UPCAST, PRECISION)
    tl.store(dk_ptr + cols64 * stride_dkt + kv_head * stride_dkh + dims[None, :],
             (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_io)  # fmt: skip
    tl.store(dv_ptr + cols64 * stride_dvt + kv_head * stride_dvh + dims[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=kv_io)  # fmt: skip


@triton.jit
def _dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, blocks_ptr, total,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, qk_scale, scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # A program: dQ of the BLOCK_M rows from blocks[program, 0] of one query head, over their key tiles in order.
    block, head = tl.program_id(0), tl.program_id(1)
    m0 = tl.load(blocks_ptr + 3 * block)
    seq_start = tl.load(blocks_ptr + 3 * block + 1)
    seq_end = tl.load(blocks_ptr + 3 * block + 2)
    rows = m0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D_PAD)
    row_ok = rows < seq_end
    io = row_ok[:, None] & (dims[None, :] < HEAD_DIM)
    rows64 = rows.to(tl.int64)[:, None]
    q = tl.load(q_ptr + rows64 * stride_qt + head * stride_qh + dims[None, :], mask=io, other=0.0)
    do = tl.load(do_ptr + rows64 * stride_dot + head * stride_doh + dims[None, :], mask=io, other=0.0)
    stat = head.to(tl.int64) * total + rows
    lse = tl.load(lse_ptr + stat, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)
    kv_head = head // GROUP
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for n0 in range(seq_start, tl.minimum(m0 + BLOCK_M, seq_end), BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        kv_io = (cols[:, None] < seq_end) & (dims[None, :] < HEAD_DIM)
        cols64 = cols.to(tl.int64)[:, None]
        k = tl.load(k_ptr + cols64 * stride_kt + kv_head * stride_kh + dims[None, :], mask=kv_io, other=0.0)
        v = tl.load(v_ptr + cols64 * stride_vt + kv_head * stride_vh + dims[None, :], mask=kv_io, other=0.0)
        s = _scores(q, tl.trans(k), rows, cols, seq_end, qk_scale, UPCAST, PRECISION)
        p = tl.exp2(s - lse[:, None])
        dp = _dot(do, tl.trans(v), UPCAST, PRECISION)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, UPCAST, PRECISION)
    tl.store(dq_ptr + rows64 * stride_dqt + head * stride_dqh + dims[None, :],
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=io)  # fmt: skip


def _tiles(starts: list[int], ends: list[int], size: int, device: torch.device) -> torch.Tensor:
    """``[num_tiles, 3]`` int32: (first row, sequence start, sequence end) of every ``size``-row tile."""
    rows = [(t, a, b) for a, b in zip(starts, ends, strict=True) for t in range(a, b, size)]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 3).to(device)


def causal_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    cu_seqlens: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``out = causal_attention(q, k, v) * scale`` over packed sequences: ``q, out, grad_out:
    [total, Hq, D]``, ``k, v: [total, Hkv, D]`` (unit last stride), sequence ``i`` the rows ``cu_seqlens[i] ..
    cu_seqlens[i + 1]`` attending to its own keys causally; the gradients in the operands' dtypes."""
    total, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads")
    for t in (q, k, v, out, grad_out):
        if t.stride(-1) != 1:
            raise ValueError("causal_attention_backward needs a unit last stride")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if total == 0:
        return dq, dk, dv
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    lse = torch.empty((heads, total), device=q.device, dtype=torch.float32)
    delta = torch.empty_like(lse)
    common = dict(
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, D_PAD=max(16, next_power_of_2(head_dim)),
        UPCAST=interpreting() and q.dtype != torch.float32, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    qk_scale = scale * math.log2(math.e)
    tiles = _tiles(starts, ends, _STATS_M, q.device)
    _stats_kernel[(tiles.shape[0], heads)](
        q, k, out, grad_out, lse, delta, tiles, total,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1),
        grad_out.stride(0), grad_out.stride(1), qk_scale,
        BLOCK_M=_STATS_M, BLOCK_N=_STATS_N, num_warps=_WARPS, num_stages=_STAGES, **common,
    )  # fmt: skip
    tiles = _tiles(starts, ends, _DKDV_N, q.device)
    _dkdv_kernel[(tiles.shape[0], kv_heads)](
        q, k, v, grad_out, lse, delta, dk, dv, tiles, total,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        qk_scale, scale, BLOCK_M=_DKDV_M, BLOCK_N=_DKDV_N, num_warps=_WARPS, num_stages=_DKDV_STAGES, **common,
    )  # fmt: skip
    tiles = _tiles(starts, ends, _DQ_M, q.device)
    _dq_kernel[(tiles.shape[0], heads)](
        q, k, v, grad_out, lse, delta, dq, tiles, total,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1),
        qk_scale, scale, BLOCK_M=_DQ_M, BLOCK_N=_DQ_N, num_warps=_WARPS, num_stages=_STAGES, **common,
    )  # fmt: skip
    return dq, dk, dv
