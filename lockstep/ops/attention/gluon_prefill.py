"""Causal prefill attention on Hopper in Gluon, warp-specialized: the invariant kernel's order, FA3's schedule.

``kernel._paged_attention_kernel``'s in-register walk compiles (Triton 3.6, sm_90) to a loop in which every wgmma
is waited for before anything else runs, so each warpgroup does QK, the softmax and P @ V one after the other, and
the two warpgroups of a program do so in step (docs/design.md, "Attention"). Here each warpgroup is a partition of
its own (64 of the program's 128 rows) and a one-warp producer brings K and V by TMA into a ring of STAGES buffers,
handing them over through mbarriers (``ready_k`` / ``ready_v`` filled, ``empty`` released by both consumers). Apart
from those, the consumers run on their own, so one warpgroup's softmax runs while the other's QK and P @ V occupy
the tensor cores; FA3 makes them take turns issuing (ping-pong), which timed no faster here (docs/perf.md, session
19). Each issues tile t's QK with tile t - 1's P @ V and denominator and runs tile t's softmax while those are in
flight.

The per-row operations are the Triton kernel's, in its order, tile by tile and split by split; only their grouping
into instructions differs: Q @ K^T over head_dim 128 is two wgmma calls over 64-column halves (the same eight
k-steps accumulated in the same order) and P @ V two calls of 64 output columns (each column's sum over positions
unchanged), because a TMA box and the 128-byte swizzle of a wgmma operand hold 64 bf16 columns. On the H200 every
output value matched the Triton kernel's in every case tried (one-shot, chunked and mixed prefills to 20k positions,
pages of 8 to 128, bf16 and fp16, NaN in unwritten cache slots; docs/perf.md, session 19).

A page of K/V arrives whole: positions past the sequence in its last page (and whole pages past it, read from
block 0) are whatever the cache holds there. Their scores are masked to -inf as in the Triton kernel; V rows there
are set to zero in shared memory before the last tile's P @ V, since P = 0 would not cancel a NaN.

Rows are (token, head of the group) pairs as in the Triton kernel; one program per (query tile, KV head).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Names that moved between Triton releases: 3.6 (the H200's) has ``thread_barrier`` and
# ``tma.async_copy_global_to_shared``, 3.9 ``barrier`` and ``tma.async_load``.
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
HALF = gl.constexpr(64)  # rows of a consumer warpgroup, and the columns of a TMA box / swizzled operand (128 bytes)


@gluon.jit
def _find_tile_seq(query_start_loc_ptr, num_seqs, search_steps, tile, BLOCK_Q: gl.constexpr):
    # The last sequence s with query_start_loc[s] // BLOCK_Q + s <= tile (kernel._find_seq's tile case).
    lo = tile * 0
    hi = lo + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        start = gl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        right = start <= tile
        lo = gl.where(right, mid, lo)
        hi = gl.where(right, hi, mid)
    return lo


@gluon.jit
def _merge(m_run, den_run, acc_run, m, den, acc):
    # kernel._merge, operation for operation (a Gluon kernel cannot call a triton.jit function).
    m_new = gl.maximum(m_run, m)
    base = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.where(m_run == m_new, 1.0, gl.exp2(m_run - base))
    beta = gl.where(m == m_new, 1.0, gl.exp2(m - base))
    seen = m > float("-inf")
    den_out = gl.where(seen, gl.fma(den_run, alpha, den * beta), den_run)
    acc_out = gl.where(seen[:, None], gl.fma(acc_run, alpha[:, None], acc * beta[:, None]), acc_run)
    return gl.where(seen, m_new, m_run), den_out, acc_out


@gluon.jit
def _p_tile(s, t, m, pos, qk_scale, cols_s, dtype: gl.constexpr, TILE: gl.constexpr):
    # Tile t's scores -> the running max, P (in the cache's dtype) and the rescale: kernel._attend_tile's
    # operations in its order.
    s = s * qk_scale
    s = gl.where((t * TILE + cols_s)[None, :] <= pos[:, None], s, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, 1))
    base = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.where(m == m_new, 1.0, gl.exp2(m - base))
    return m_new, gl.exp2(s - base[:, None]).to(dtype), alpha


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, ready_k, ready_v, empty, block_table, seq_len, last_tile, kv_head,
              page_size, TILE: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    # Tile t's K (then V) as TILE // ROWS pieces of ROWS positions (a page, or a TILE-long run of one) times
    # D // HALF column halves, into slot t % STAGES once both consumers have released that slot's last tile.
    for t in range(0, last_tile + 1):
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), (t // STAGES + 1) % 2, pred=t >= STAGES)
        _load_tile(k_desc, k_smem, ready_k.index(slot), slot, t, block_table, seq_len, kv_head, page_size, TILE, ROWS,
                   D)  # fmt: skip
        _load_tile(v_desc, v_smem, ready_v.index(slot), slot, t, block_table, seq_len, kv_head, page_size, TILE, ROWS,
                   D)  # fmt: skip


@gluon.jit
def _load_tile(desc, smem, ready, slot, t, block_table, seq_len, kv_head, page_size, TILE: gl.constexpr,
               ROWS: gl.constexpr, D: gl.constexpr):  # fmt: skip
    halves: gl.constexpr = D // HALF
    mbarrier.expect(ready, TILE * D * 2)
    for j in gl.static_range(TILE // ROWS):
        pos = t * TILE + j * ROWS
        block = gl.load(block_table + pos // page_size, mask=pos < seq_len, other=0)
        row = block * page_size + pos % page_size
        for h in gl.static_range(halves):
            _tma_load(desc, [row, kv_head * D + h * HALF], ready, smem.index(slot * halves + h).slice(j * ROWS, ROWS))


@gluon.jit
def _qk(q_mine, k_smem, slot, s0, halves: gl.constexpr):
    s = warpgroup_mma(q_mine.index(0), k_smem.index(slot * halves).permute((1, 0)), s0, use_acc=False, is_async=True)
    for h in gl.static_range(1, halves):
        s = warpgroup_mma(q_mine.index(h), k_smem.index(slot * halves + h).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _mma_inputs(p, alpha, acc0, acc1, den, p_o: gl.constexpr, p_d: gl.constexpr):
    # Tile t's P in the two MMAs' operand layouts and the accumulators rescaled for its P @ V and denominator,
    # computed before that batch is issued (see _consumer).
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, acc0.type.layout))[:, None]
    alpha_d = gl.convert_layout(alpha, gl.SliceLayout(1, den.type.layout))[:, None]
    return gl.convert_layout(p, p_o), gl.convert_layout(p, p_d), acc0 * alpha_o, acc1 * alpha_o, den * alpha_d


@gluon.jit
def _pv(p_v, p_den, v_smem, slot, ones_smem, acc0, acc1, den):
    # A tile's P @ V (two 64-column halves) and denominator issued, in flight.
    acc0 = warpgroup_mma(p_v, v_smem.index(slot * 2), acc0, is_async=True)
    acc1 = warpgroup_mma(p_v, v_smem.index(slot * 2 + 1), acc1, is_async=True)
    return acc0, acc1, warpgroup_mma(p_den, ones_smem, den, is_async=True)


@gluon.jit
def _fold(m_run, den_run, run0, run1, m, den, acc0, acc1):
    # A finished split (its max m, denominator den, accumulator halves) merged into the running state.
    row_o: gl.constexpr = gl.SliceLayout(1, acc0.type.layout)
    m_in = gl.convert_layout(m, row_o)
    den_in = gl.convert_layout(gl.max(den, 1), row_o)
    _, _, run1 = _merge(m_run, den_run, run1, m_in, den_in, acc1)
    m_run, den_run, run0 = _merge(m_run, den_run, run0, m_in, den_in, acc0)
    return m_run, den_run, run0, run1


@gluon.jit
def _consumer(q_ptr, o_ptr, q_mine, k_smem, v_smem, ones_smem, ready_k, ready_v, empty, row0, tok0, q_end, seq_len,
              last_tile, kv_head, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
              GROUP: gl.constexpr, D: gl.constexpr, TILE: gl.constexpr, TILES_PER_SPLIT: gl.constexpr,
              STAGES: gl.constexpr):  # fmt: skip
    # Rows row0 .. row0 + HALF of the program's tile: gluon_prefill's walk for one warpgroup.
    # D == 2 * HALF (gluon_prefill checks)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    p_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    p_d: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_d, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    row_o: gl.constexpr = gl.SliceLayout(1, mma_o)

    rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, blk))
    tok = tok0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    q_ok = (tok < q_end)[:, None] & (cols < HALF)[None, :]
    q_rows = q_ptr + tok.to(gl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + cols[None, :]
    q_mine.index(0).store(gl.load(q_rows, mask=q_ok, other=0.0))
    q_mine.index(1).store(gl.load(q_rows + HALF, mask=q_ok, other=0.0))
    fence_async_shared()
    _cta_barrier()

    tok_s = tok0 + (row0 + gl.arange(0, HALF, layout=row_s)) // GROUP
    pos = gl.where(tok_s < q_end, seq_len - q_end + tok_s, -1)
    cols_s = gl.arange(0, TILE, layout=gl.SliceLayout(0, mma_s))
    m_run = gl.full([HALF], float("-inf"), gl.float32, layout=row_o)
    den_run = gl.zeros([HALF], gl.float32, layout=row_o)
    run0 = gl.zeros([HALF, HALF], gl.float32, layout=mma_o)
    run1 = gl.zeros([HALF, HALF], gl.float32, layout=mma_o)
    m = gl.full([HALF], float("-inf"), gl.float32, layout=row_s)
    den = gl.zeros([HALF, 16], gl.float32, layout=mma_d)
    acc0 = gl.zeros([HALF, HALF], gl.float32, layout=mma_o)
    acc1 = gl.zeros([HALF, HALF], gl.float32, layout=mma_o)
    s0 = gl.zeros([HALF, TILE], gl.float32, layout=mma_s)

    # Tile 0's scores and P; its P @ V and denominator go with tile 1's QK. Every MMA's inputs are computed before
    # the batch it goes with is issued (ptxas serializes MMAs whose inputs are defined while an MMA of the same batch
    # is in flight, warning C7513), so the rescaled accumulators, P and the denominator of tile t are made ready at
    # the end of iteration t for iteration t + 1.
    mbarrier.wait(ready_k.index(0), 0)
    s = _qk(q_mine, k_smem, 0, s0, 2)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    m, p, alpha = _p_tile(s, 0, m, pos, qk_scale, cols_s, dtype, TILE)
    p_v, p_den, acc0, acc1, den = _mma_inputs(p, alpha, acc0, acc1, den, p_o, p_d)

    for t in range(1, last_tile + 1):
        slot = t % STAGES
        prev = (t - 1) % STAGES
        mbarrier.wait(ready_k.index(slot), (t // STAGES) % 2)
        mbarrier.wait(ready_v.index(prev), ((t - 1) // STAGES) % 2)
        s = _qk(q_mine, k_smem, slot, s0, 2)
        acc0, acc1, den = _pv(p_v, p_den, v_smem, prev, ones_smem, acc0, acc1, den)
        s = warpgroup_mma_wait(num_outstanding=3, deps=(s,))
        new_split = t % TILES_PER_SPLIT == 0
        m_old = m
        if new_split:
            m = gl.full([HALF], float("-inf"), gl.float32, layout=row_s)
        m_new, p, alpha = _p_tile(s, t, m, pos, qk_scale, cols_s, dtype, TILE)
        acc0, acc1, den = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, den))
        mbarrier.arrive(empty.index(prev))
        if new_split:  # tile t - 1 ended a split: fold it in, start the next from zero
            m_run, den_run, run0, run1 = _fold(m_run, den_run, run0, run1, m_old, den, acc0, acc1)
            acc0 = gl.zeros([HALF, HALF], gl.float32, layout=mma_o)
            acc1 = gl.zeros([HALF, HALF], gl.float32, layout=mma_o)
            den = gl.zeros([HALF, 16], gl.float32, layout=mma_d)
        m = m_new
        p_v, p_den, acc0, acc1, den = _mma_inputs(p, alpha, acc0, acc1, den, p_o, p_d)

    last = last_tile % STAGES
    mbarrier.wait(ready_v.index(last), (last_tile // STAGES) % 2)
    if (last_tile + 1) * TILE > seq_len:  # the sequence's last page: V past its end to zero (see the docstring)
        keep = (last_tile * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, blk)) < seq_len)[:, None]
        for h in gl.static_range(2):
            v = v_smem.index(last * 2 + h).load(blk)
            v_smem.index(last * 2 + h).store(gl.where(keep, v, gl.zeros_like(v)))
        fence_async_shared()
        _cta_barrier()
    acc0, acc1, den = _pv(p_v, p_den, v_smem, last, ones_smem, acc0, acc1, den)
    acc0, acc1, den = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, den))
    m_run, den_run, run0, run1 = _fold(m_run, den_run, run0, run1, m, den, acc0, acc1)

    den_safe = gl.where(den_run == 0.0, 1.0, den_run)[:, None]
    rows_o = row0 + gl.arange(0, HALF, layout=row_o)
    cols_o = gl.arange(0, HALF, layout=gl.SliceLayout(0, mma_o))
    tok_o = tok0 + rows_o // GROUP
    head_o = kv_head * GROUP + rows_o % GROUP
    o = o_ptr + tok_o.to(gl.int64)[:, None] * stride_ot + head_o[:, None] * stride_oh + cols_o[None, :]
    ok = (tok_o < q_end)[:, None] & (cols_o < HALF)[None, :]
    out0 = run0 / den_safe
    out1 = run1 / den_safe
    gl.store(o, gl.where(out0 == 0.0, 0.0, out0).to(dtype), mask=ok)
    gl.store(o + HALF, gl.where(out1 == 0.0, 0.0, out1).to(dtype), mask=ok)


@gluon.jit
def _gluon_prefill_kernel(
    q_ptr, k_desc, v_desc, o_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, search_steps, page_size, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    GROUP: gl.constexpr, BLOCK_Q: gl.constexpr, D: gl.constexpr, TILE: gl.constexpr, ROWS: gl.constexpr,
    TILES_PER_SPLIT: gl.constexpr, NUM_KV_HEADS: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # Query tiles in reverse: a causal walk's last tiles are its longest, and started first they leave the short
    # ones to fill the last wave (on the H200 2-10% faster from 1 x 4096 to 1 x 32768; docs/perf.md, session 19).
    tile = gl.num_programs(0) // NUM_KV_HEADS - 1 - gl.program_id(0) // NUM_KV_HEADS
    kv_head = gl.program_id(0) % NUM_KV_HEADS
    seq = _find_tile_seq(query_start_loc_ptr, num_seqs, search_steps, tile, BLOCK_Q)
    q_begin = gl.load(query_start_loc_ptr + seq)
    q_end = gl.load(query_start_loc_ptr + seq + 1)
    tok0 = q_begin + (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if tok0 < q_end:
        seq_len = gl.load(seq_lens_ptr + seq)
        last_tile = (seq_len - q_end + gl.minimum(tok0 + BLOCK_Q, q_end) - 1) // TILE
        block_table = block_tables_ptr + seq.to(gl.int64) * stride_bt

        half_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, HALF], dtype)
        q0_smem = gl.allocate_shared_memory(dtype, [2, HALF, HALF], half_layout)
        q1_smem = gl.allocate_shared_memory(dtype, [2, HALF, HALF], half_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES * 2, TILE, HALF], half_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES * 2, TILE, HALF], half_layout)
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        ones_smem = gl.allocate_shared_memory(dtype, [TILE, 16], gl.NVMMASharedLayout.get_default_for([TILE, 16],
                                              dtype), gl.full([TILE, 16], 1.0, dtype, layout=blk))  # fmt: skip
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        ready_k = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        ready_v = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready_k.index(i), count=1)
            mbarrier.init(ready_v.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        fence_async_shared()
        _cta_barrier()

        gl.warp_specialize(
            [
                (_consumer, (q_ptr, o_ptr, q0_smem, k_smem, v_smem, ones_smem, ready_k, ready_v, empty, 0, tok0,
                             q_end, seq_len, last_tile, kv_head, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                             GROUP, D, TILE, TILES_PER_SPLIT, STAGES)),
                (_consumer, (q_ptr, o_ptr, q1_smem, k_smem, v_smem, ones_smem, ready_k, ready_v, empty, HALF, tok0,
                             q_end, seq_len, last_tile, kv_head, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                             GROUP, D, TILE, TILES_PER_SPLIT, STAGES)),
                (_producer, (k_desc, v_desc, k_smem, v_smem, ready_k, ready_v, empty, block_table, seq_len,
                             last_tile, kv_head, page_size, TILE, ROWS, D, STAGES)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip


def unsupported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tile: int) -> str | None:
    """Why ``gluon_prefill`` cannot run these tensors, or None: head_dim 128, 16-bit caches, a GQA group dividing
    128 rows, pages of at least 8 positions that divide TILE or that TILE divides, and caches a TMA descriptor can
    address as (block, slot) rows."""
    num_q_heads, head_dim = q.shape[1:]
    _, page, num_kv_heads, dim = k_cache.shape
    if head_dim != 2 * HALF.value or k_cache.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype:
        return "gluon_prefill runs head_dim 128 over a 16-bit cache of the queries' dtype"
    if (2 * HALF.value) % (num_q_heads // num_kv_heads):
        return f"gluon_prefill needs a GQA group dividing {2 * HALF.value}"
    if page < 8 or (tile % page and page % tile):
        return f"gluon_prefill needs a page of >= 8 positions dividing {tile} or divisible by it"
    for cache in (k_cache, v_cache):
        if cache.stride(3) != 1 or cache.stride(2) != dim or cache.stride(0) != page * cache.stride(1):
            return "gluon_prefill needs caches whose (block, slot) rows are evenly strided, heads inside a row"
        if cache.data_ptr() % 16 or cache.stride(1) * cache.element_size() % 16:
            return "gluon_prefill needs 16-byte aligned cache rows"
    return None


def _cache_desc(cache: torch.Tensor, rows: int) -> TensorDescriptor:
    # The cache [blocks, page, kv heads, head_dim] as rows of (block, slot) by (kv head, dim) columns.
    num_blocks, page, heads, dim = cache.shape
    layout = gl.NVMMASharedLayout.get_default_for([rows, HALF.value], gl.bfloat16 if cache.dtype == torch.bfloat16
                                                  else gl.float16)  # fmt: skip
    return TensorDescriptor(cache, [num_blocks * page, heads * dim], [cache.stride(1), 1], [rows, HALF.value], layout)


def gluon_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, qk_scale, *, split, tile, stages=3,
                  consumer_regs=240, producer_regs=32):  # fmt: skip
    """The in-register walk of a prefill step (``launch._paged_attention_triton`` with ``split_programs=False``,
    BLOCK_M 128) on Hopper; ``qk_scale`` in log2 units; what it runs is in ``unsupported``. ``stages`` (K/V buffers
    in the ring) and the register split change speed only: on the H200 3 stages beat 2 by 13-29% and 4 by 1-5%, and
    232 / 40 or 224 / 48 registers were up to 4% slower than 240 / 32 (docs/perf.md, session 19)."""
    reason = unsupported(q, k_cache, v_cache, tile)
    if reason:
        raise ValueError(reason)
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    rows = min(page_size, tile)
    num_seqs = block_tables.shape[0]
    group = num_q_heads // num_kv_heads
    block_q = 2 * HALF.value // group
    out = torch.empty_like(q)
    num_tiles = num_tokens // block_q + num_seqs
    _gluon_prefill_kernel[(num_tiles * num_kv_heads,)](
        q, _cache_desc(k_cache, rows), _cache_desc(v_cache, rows), out, block_tables, seq_lens, query_start_loc,
        num_seqs, max(1, num_seqs.bit_length()), page_size, qk_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, D=head_dim, TILE=tile, ROWS=rows, TILES_PER_SPLIT=split // tile,
        NUM_KV_HEADS=num_kv_heads, STAGES=stages, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
        num_warps=4,
    )  # fmt: skip
    return out
