"""Batch-invariant varlen bidirectional attention: ``vision_attention``, the vision towers' self-attention.

A vision tower attends within each image (or, in Qwen2.5-VL, each window of one): a batch of images is a varlen
batch of segments, every query of a segment seeing every key of it. The contract: a row's bits depend only on
its own segment's q, k, v and its offset inside it, never on the other segments or where its segment sits. So
one query row's KV reduction is a function of its segment's length and fixed constants only:
- KV is reduced in tiles of ``TILE`` keys from the segment's first key, in order, with an online softmax in fp32
  (running max m, denominator den, numerator acc); the last tile's keys past the segment's end score -inf;
- query rows are cut into tiles of ``BLOCK_M`` rows from the segment's first row, so a tile never mixes segments.
Every tile of keys holds at least one real key, so m is finite from the first tile on and no -inf needs care.

This is not the paged kernel with a non-causal flag: K and V come straight from the projections (no cache, no
block table), there is no split (a vision forward has enough query tiles to fill the GPU), and a segment's rows
all see the same keys; a kernel of its own is a third of the size and leaves the text path's tuning alone.

CUDA runs one Triton program per (query tile of one segment, head), its segment found by a binary search over
``cu_seqlens`` (no host sync). The CPU runs the same scheme with its own tile sizes, batched matmuls of one fixed
per-entry shape (``_CPU_ROWS`` query rows x ``_CPU_TILE`` keys, the last tile zero-padded and masked), entries of
every segment side by side in each call: aten.bmm's per-entry bits do not depend on the number of entries
(tests/ops/test_attention.py and test_vision_attention.py check it), and the rest is elementwise, exact (max,
where) or a sum over a fixed tile. CPU and GPU bits differ (other tiles; the GPU rounds P to V's dtype for the P@V
dot, as FlashAttention does).
"""

import math

import torch
import triton
import triton.language as tl

from lockstep.ops._common import FLOATS, interpreting, next_power_of_2, pdl_launch, pdl_wait

# Keys per reduction tile (part of the numerics: a row's softmax sums run over tiles of this size).
TILE = 64
# Query rows per program on CUDA, and its warps: not part of the numerics (a row's reduction is the same in any
# block; the H200 sweep, bench/vision_attention_sweep.py, gave the same bits for 64 and 128 rows, 4 and 8 warps).
# Long segments (images) take 128 rows and 8 warps: 2.2-2.4x faster than 64/4 at Qwen3-VL-8B's shapes on the
# H200 (784 patches: 58.8 vs 132.6 us; 4096: 969 vs 2344); Qwen2.5-VL's 64-patch windows keep 64/4 (106.5 vs
# 186.9 us), where a 128-row block would be half empty. Chosen from the shapes alone (no host sync).
BLOCK_M = 64
_LONG_BLOCK_M, _LONG_WARPS = 128, 8
# The CPU's tiles: a bmm entry is [_CPU_ROWS, D] x [D, _CPU_TILE] (query rows of one segment x keys of it). Of six
# pairs from 32 x 64 to 128 x 256 tried on a 784-patch image (16 heads x 72, the shared 2-core machine, noisy),
# 64 x 128 was among the fastest, still ~3x torch's fused SDPA there: the elementwise softmax passes dominate.
_CPU_ROWS = 64
_CPU_TILE = 128
# Bytes of fp32 scores one CPU call holds at most (heads x entries x _CPU_ROWS x _CPU_TILE): bounds a big batch's
# memory.
_CPU_CHUNK_BYTES = 16 << 20


@triton.jit(do_not_specialize=["num_segments", "search_steps"])
def _vision_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr,
    num_segments, search_steps, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    tile = tl.program_id(0)
    head = tl.program_id(1)
    # The last segment s with first_tile(s) <= tile, first_tile(s) = cu[s] // BLOCK_M + s: every segment owns
    # cdiv(len, BLOCK_M) tiles, plus at most one spare that returns here.
    lo = tile * 0
    hi = lo + num_segments
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        right = tl.load(cu_ptr + mid) // BLOCK_M + mid <= tile
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    seg_start = tl.load(cu_ptr + lo)
    seg_end = tl.load(cu_ptr + lo + 1)
    tok0 = seg_start + (tile - (seg_start // BLOCK_M + lo)) * BLOCK_M
    if tok0 >= seg_end:
        return
    rows = tok0 + tl.arange(0, BLOCK_M)
    row_ok = rows < seg_end
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh
    q = tl.load(q_rows + dims[None, :], mask=io_mask, other=0.0)
    if UPCAST:  # the interpreter's bf16/fp16 dot is wrong; run it in fp32 there
        q = q.to(tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for kv0 in range(seg_start, seg_end, TILE):
        offs = kv0 + tl.arange(0, TILE)
        kv_ok = offs < seg_end
        k_t = tl.load(
            k_ptr + offs.to(tl.int64)[None, :] * stride_kt + head * stride_kh + dims[:, None],
            mask=kv_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )  # [D_PAD, TILE]
        v = tl.load(
            v_ptr + offs.to(tl.int64)[:, None] * stride_vt + head * stride_vh + dims[None, :],
            mask=kv_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [TILE, D_PAD]
        if UPCAST:
            k_t = k_t.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale  # log2 units
        s = tl.where(kv_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: the tile holds a real key
        alpha = tl.exp2(m - m_new)  # 0 at the first tile
        p = tl.exp2(s - m_new[:, None])
        den = den * alpha + tl.sum(p, 1)  # BLOCK_M and the layout are constants: a fixed order
        p = p.to(v.dtype)  # rounded to V's dtype for the dot, like FlashAttention
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m = m_new
    out = acc / den[:, None]
    o = o_ptr + rows.to(tl.int64)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=io_mask)


def _vision_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    # q, k, v: [total, heads, head_dim] with unit last stride; cu_seqlens: [num_segments + 1] int32, cu[-1] = total.
    # Decided from shapes alone: no host sync.
    total, heads, head_dim = q.shape
    out = torch.empty((total, heads, head_dim), device=q.device, dtype=q.dtype)
    num_segments = cu_seqlens.shape[0] - 1
    if total == 0 or num_segments == 0:
        return out
    long = total >= _LONG_BLOCK_M * num_segments  # segments of 128 rows or more on average
    block_m, warps = (_LONG_BLOCK_M, _LONG_WARPS) if long else (BLOCK_M, 4)
    _vision_attention_kernel[(total // block_m + num_segments, heads)](
        q, k, v, out, cu_seqlens,
        num_segments, max(1, num_segments.bit_length()), scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_PAD=max(16, next_power_of_2(head_dim)), BLOCK_M=block_m, TILE=TILE,
        UPCAST=interpreting() and q.dtype != torch.float32,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=2, **pdl_launch(q),
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------------ CPU
# An entry is _CPU_ROWS consecutive query rows of one segment (the last zero-padded); entries of all segments go
# through each call together, KV tile j of every entry in the same bmm. An entry whose segment has fewer tiles
# than the call's longest gets tiles that see nothing there (all -inf): m stays, alpha is exactly 1, P is 0, so
# den and acc keep their bits (an exact zero of acc may change sign: the output turns -0.0 into +0.0).


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # aten.bmm.out, not torch.bmm: inside batch_invariant_mode torch.bmm would come back to lockstep.
    return torch.ops.aten.bmm.out(a, b, out=a.new_empty((a.shape[0], a.shape[1], b.shape[2])))


def _attend_entries(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_rows: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    # q, k, v: [heads, total + 1, D] fp32, head-major, the last row zeros (q pre-scaled); q_rows: [E, R] row
    # indices (padding: the zero row); starts, ends: [E] the entries' segments -> [heads, E, R, D]
    e, r = q_rows.shape
    heads, zero_row, head_dim = q.shape[0], q.shape[1] - 1, q.shape[2]
    t = _CPU_TILE
    qe = q.index_select(1, q_rows.flatten()).view(heads * e, r, head_dim)  # bmm entry (head, entry)
    m = torch.full((heads, e, r), float("-inf"))
    den = torch.zeros((heads, e, r))
    acc = torch.zeros((heads, e, r, head_dim))
    num_tiles = int(((ends - starts + t - 1) // t).max())
    offs = torch.arange(t)
    for j in range(num_tiles):
        keys = starts[:, None] + j * t + offs  # [E, TILE]
        key_ok = keys < ends[:, None]
        rows = torch.where(key_ok, keys, zero_row).flatten()
        kt = k.index_select(1, rows).view(heads * e, t, head_dim)
        vt = v.index_select(1, rows).view(heads * e, t, head_dim)
        s = _bmm(qe, kt.transpose(1, 2)).view(heads, e, r, t)
        if j == num_tiles - 1 or not bool(key_ok.all()):  # some entry's segment ends inside this tile
            s.masked_fill_(~key_ok[None, :, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        # An entry past its segment's tiles sees only -inf: m_new = m there, and the base below is m itself.
        base = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha = torch.where(m == m_new, 1.0, torch.exp(m - base))
        p = s.sub_(base[..., None]).exp_()
        den = den * alpha + p.sum(-1)
        pv = _bmm(p.view(heads * e, r, t), vt).view(heads, e, r, head_dim)
        acc = acc.mul_(alpha[..., None]).add_(pv)
        m = m_new
    return acc.div_(den[..., None])


def _vision_attention_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    total, heads, head_dim = q.shape
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
        raise ValueError(f"cu_seqlens must rise from 0 to {total}, got {cu}")
    # Entries: (segment start, segment end, first row), longest segment first so a call's entries need about as
    # many tiles each (an entry's slot in a call does not change its bits).
    entries = []
    for s in sorted(range(len(cu) - 1), key=lambda s: cu[s] - cu[s + 1]):
        entries += [(cu[s], cu[s + 1], row) for row in range(cu[s], cu[s + 1], _CPU_ROWS)]
    if not entries:
        return torch.empty_like(q)
    zeros = q.new_zeros((heads, 1, head_dim), dtype=torch.float32)
    # [heads, total + 1, D]: head-major, so a tile's K of every entry is one index_select; the last row pads
    qh, kh, vh = (torch.cat([t.float().transpose(0, 1), zeros], 1) for t in (q * scale, k, v))
    table = torch.tensor(entries)  # [E, 3]
    rows = table[:, 2:3] + torch.arange(_CPU_ROWS)  # [E, R]
    q_rows = torch.where(rows < table[:, 1:2], rows, total)
    per_call = max(1, _CPU_CHUNK_BYTES // (heads * _CPU_ROWS * _CPU_TILE * 4))
    out = torch.empty((total + 1, heads, head_dim))
    for lo in range(0, len(entries), per_call):
        part = slice(lo, lo + per_call)
        o = _attend_entries(qh, kh, vh, q_rows[part], table[part, 0], table[part, 1])  # [heads, E, R, D]
        out[q_rows[part].flatten()] = o.permute(1, 2, 0, 3).reshape(-1, heads, head_dim)
    return out[:total].add_(0.0).to(q.dtype)  # + 0.0 turns -0.0 into +0.0 (see above)


def vision_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Bidirectional attention within each segment of a varlen batch, batch-invariant.

    ``q, k, v: [total, heads, head_dim]`` (one head count: vision towers are MHA; head_dim up to 256, padded to a
    power of two inside the kernel); ``cu_seqlens: [num_segments + 1]`` int32 on q's device, rising from 0 to
    ``total``: segment s is rows ``[cu[s], cu[s + 1])``, and its queries see exactly its keys. Returns
    ``[total, heads, head_dim]`` in q's dtype.
    """
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must be [total, heads, head_dim] alike, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")  # fmt: skip
    if q.dtype not in FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"expected matching float dtypes, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be [num_segments + 1] on {q.device}, got {tuple(cu_seqlens.shape)} "
                         f"on {cu_seqlens.device}")  # fmt: skip
    if q.shape[2] > 256:
        raise ValueError(f"head_dim up to 256, got {q.shape[2]}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if q.is_cuda:
        return _vision_attention_triton(q, k, v, cu_seqlens.to(torch.int32), scale)
    return _vision_attention_cpu(q, k, v, cu_seqlens, scale)
