"""Causal prefill attention on Hopper in Gluon: the invariant kernel's order, with explicit asynchronous MMAs.

``kernel._paged_attention_kernel``'s in-register walk compiles (Triton 3.6, sm_90) to a loop in which every wgmma
is waited for before anything else runs, so each warpgroup does QK, the softmax and P @ V one after the other
(docs/design.md, "Attention"). This kernel computes the same operations on the same values in the same order,
tile by tile and split by split, but issues tile t's QK and tile t - 1's P @ V together and runs tile t's softmax
while the P @ V is in flight; K and V arrive by cp.async into a ring of STAGES shared-memory buffers, AHEAD tiles
ahead. Only launch order and overlap differ, so the bits are the Triton kernel's: on the H200 every output value
matched in every case tried, one-shot, chunked and mixed prefills to 20k positions (docs/perf.md, session 18).

It is not faster yet (271 against 265 TFLOP/s at 1 x 4096, 312 against 315 at 1 x 16384), so it runs only when
asked for (``LOCKSTEP_GLUON=1`` or ``gluon=True``): it is the base for the FA3-style kernel (producer warps,
warpgroups in ping-pong) that item 2 of issue 27 needs.

Rows are (token, head of the group) pairs as in the Triton kernel; one program per (query tile, KV head).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

# Names that moved between Triton releases: 3.6 (the H200's) has ``thread_barrier`` and
# ``async_copy_global_to_shared``, 3.9 ``barrier`` and ``async_load``.
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared


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
def _issue_kv(k_smem, v_smem, slot, k_base, v_base, ids, t, seq_len, page_size, stride_kb, stride_ks, stride_vb,
              stride_vs, TILE: gl.constexpr, D: gl.constexpr, blk: gl.constexpr):  # fmt: skip
    # cp.async of tile t's K and V rows (block ids ``ids``, one per position) into ring slot ``slot``; positions
    # past the sequence arrive as zeros, as the Triton kernel's masked loads give.
    offs = t * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, blk))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    ok = (offs < seq_len)[:, None] & (dims < D)[None, :]
    block = ids.to(gl.int64)
    slot_pos = (offs % page_size).to(gl.int64)
    _async_load(
        k_smem.index(slot), k_base + (block * stride_kb + slot_pos * stride_ks)[:, None] + dims[None, :], mask=ok
    )
    _async_load(
        v_smem.index(slot), v_base + (block * stride_vb + slot_pos * stride_vs)[:, None] + dims[None, :], mask=ok
    )
    cp.commit_group()


@gluon.jit
def _tile_ids(block_table, t, seq_len, page_size, TILE: gl.constexpr, blk: gl.constexpr):
    offs = t * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, blk))
    return gl.load(block_table + offs // page_size, mask=offs < seq_len, other=0)


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
def _gluon_prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, search_steps, page_size, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_Q: gl.constexpr, D: gl.constexpr, TILE: gl.constexpr,
    TILES_PER_SPLIT: gl.constexpr, NUM_KV_HEADS: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, TILE, 16])  # fmt: skip
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, D, 16])  # fmt: skip
    mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, 16, 16])  # fmt: skip
    p_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    p_d: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_d, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    row_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    row_d: gl.constexpr = gl.SliceLayout(1, mma_d)

    tile = gl.program_id(0) // NUM_KV_HEADS
    kv_head = gl.program_id(0) % NUM_KV_HEADS
    seq = _find_tile_seq(query_start_loc_ptr, num_seqs, search_steps, tile, BLOCK_Q)
    q_begin = gl.load(query_start_loc_ptr + seq)
    q_end = gl.load(query_start_loc_ptr + seq + 1)
    tok0 = q_begin + (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if tok0 < q_end:
        seq_len = gl.load(seq_lens_ptr + seq)
        last_tile = (seq_len - q_end + gl.minimum(tok0 + BLOCK_Q, q_end) - 1) // TILE
        block_table = block_tables_ptr + seq.to(gl.int64) * stride_bt
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_vh

        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
        dims = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
        tok = tok0 + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        q_ok = (tok < q_end)[:, None] & (dims < D)[None, :]
        q = gl.load(q_ptr + tok.to(gl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=q_ok, other=0.0)  # fmt: skip
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], gl.NVMMASharedLayout.get_default_for([BLOCK_M, D],
                                           dtype), q)  # fmt: skip
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, D], dtype)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE, D], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, TILE, D], kv_layout)
        ones = gl.full([TILE, 16], 1.0, dtype, layout=blk)
        ones_smem = gl.allocate_shared_memory(dtype, [TILE, 16], gl.NVMMASharedLayout.get_default_for([TILE, 16],
                                              dtype), ones)  # fmt: skip

        rows_s = gl.arange(0, BLOCK_M, layout=row_s)
        tok_s = tok0 + rows_s // GROUP
        pos = gl.where(tok_s < q_end, seq_len - q_end + tok_s, -1)
        cols_s = gl.arange(0, TILE, layout=gl.SliceLayout(0, mma_s))

        # Tiles 0 .. AHEAD in flight, the next one's ids loaded. A slot is refilled AHEAD + 1 tiles after it was
        # read: with AHEAD <= STAGES - 3 the barrier after the last iteration's copies already orders that after
        # every warpgroup's reads of it, otherwise a barrier at the top of the loop does.
        ahead: gl.constexpr = AHEAD
        for i in gl.static_range(ahead + 1):
            ids = _tile_ids(block_table, i, seq_len, page_size, TILE, blk)
            _issue_kv(k_smem, v_smem, i, k_base, v_base, ids, i, seq_len, page_size, stride_kb, stride_ks,
                      stride_vb, stride_vs, TILE, D, blk)  # fmt: skip
        ids_next = _tile_ids(block_table, ahead + 1, seq_len, page_size, TILE, blk)

        m_run = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_o)
        den_run = gl.zeros([BLOCK_M], gl.float32, layout=row_o)
        acc_run = gl.zeros([BLOCK_M, D], gl.float32, layout=mma_o)
        m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        den = gl.zeros([BLOCK_M, 16], gl.float32, layout=mma_d)
        acc = gl.zeros([BLOCK_M, D], gl.float32, layout=mma_o)
        s0 = gl.zeros([BLOCK_M, TILE], gl.float32, layout=mma_s)

        # Tile 0: its scores and P; its P @ V and denominator go with tile 1's QK. Every wait for copies is followed by
        # a fence (the wgmma reads through the async proxy) and a barrier (each thread waits only for its own
        # copies). Every MMA's inputs are computed before the batch it goes with is issued (ptxas serializes MMAs
        # whose inputs are defined while an MMA of the same batch is in flight, warning C7513), so the rescaled
        # accumulators, P and the denominator of tile t are made ready at the end of iteration t.
        cp.wait_group(ahead)
        fence_async_shared()
        _cta_barrier()
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        m, p, alpha = _p_tile(s, 0, m, pos, qk_scale, cols_s, dtype, TILE)
        p_v = gl.convert_layout(p, p_o)
        p_den = gl.convert_layout(p, p_d)
        den = den * gl.convert_layout(alpha, row_d)[:, None]
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]

        for t in range(1, last_tile + 1):
            if AHEAD > STAGES - 3:
                _cta_barrier()
            _issue_kv(k_smem, v_smem, (t + ahead) % STAGES, k_base, v_base, ids_next, t + ahead, seq_len, page_size,
                      stride_kb, stride_ks, stride_vb, stride_vs, TILE, D, blk)  # fmt: skip
            ids_next = _tile_ids(block_table, t + ahead + 1, seq_len, page_size, TILE, blk)
            cp.wait_group(ahead)
            fence_async_shared()
            _cta_barrier()
            s = warpgroup_mma(q_smem, k_smem.index(t % STAGES).permute((1, 0)), s0, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_v, v_smem.index((t - 1) % STAGES), acc, is_async=True)
            den = warpgroup_mma(p_den, ones_smem, den, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=2, deps=(s,))
            new_split = t % TILES_PER_SPLIT == 0
            m_old = m
            if new_split:
                m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
            m_new, p, alpha = _p_tile(s, t, m, pos, qk_scale, cols_s, dtype, TILE)
            acc, den = warpgroup_mma_wait(num_outstanding=0, deps=(acc, den))
            if new_split:  # tile t - 1 ended a split: fold it in, start the next from zero
                m_run, den_run, acc_run = _merge(m_run, den_run, acc_run, gl.convert_layout(m_old, row_o),
                                                 gl.convert_layout(gl.max(den, 1), row_o), acc)  # fmt: skip
                acc = gl.zeros([BLOCK_M, D], gl.float32, layout=mma_o)
                den = gl.zeros([BLOCK_M, 16], gl.float32, layout=mma_d)
            m = m_new
            p_v = gl.convert_layout(p, p_o)
            p_den = gl.convert_layout(p, p_d)
            den = den * gl.convert_layout(alpha, row_d)[:, None]
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]

        acc = warpgroup_mma(p_v, v_smem.index(last_tile % STAGES), acc, is_async=True)
        den = warpgroup_mma(p_den, ones_smem, den, is_async=True)
        acc, den = warpgroup_mma_wait(num_outstanding=0, deps=(acc, den))
        cp.wait_group(0)
        m_run, den_run, acc_run = _merge(m_run, den_run, acc_run, gl.convert_layout(m, row_o),
                                         gl.convert_layout(gl.max(den, 1), row_o), acc)  # fmt: skip
        out = acc_run / gl.where(den_run == 0.0, 1.0, den_run)[:, None]
        out = gl.where(out == 0.0, 0.0, out)
        rows_o = gl.arange(0, BLOCK_M, layout=row_o)
        cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, mma_o))
        tok_o = tok0 + rows_o // GROUP
        head_o = kv_head * GROUP + rows_o % GROUP
        o = o_ptr + tok_o.to(gl.int64)[:, None] * stride_ot + head_o[:, None] * stride_oh + cols_o[None, :]
        gl.store(o, out.to(dtype), mask=(tok_o < q_end)[:, None] & (cols_o < D)[None, :])


def gluon_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, qk_scale, *, split, tile,
                  block_m=128, num_warps=8, stages=3, ahead=1):  # fmt: skip
    """The in-register walk of a prefill step (``launch._paged_attention_triton`` with ``split_programs=False``) on
    Hopper; ``qk_scale`` in log2 units. Head dim 128, 16-bit caches. ``stages`` and ``ahead`` change launch order
    only: every setting timed on the H200 gave the same bits and was within 3% of the others (3 / 1 the fastest,
    with each denominator's MMA waited for a tile later, as now; waiting for it at once was 2% slower)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_q_heads // num_kv_heads
    block_q = block_m // group
    out = torch.empty_like(q)
    num_tiles = num_tokens // block_q + num_seqs
    _gluon_prefill_kernel[(num_tiles * num_kv_heads,)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        num_seqs, max(1, num_seqs.bit_length()), page_size, qk_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, D=head_dim, TILE=tile, TILES_PER_SPLIT=split // tile,
        NUM_KV_HEADS=num_kv_heads, STAGES=stages, AHEAD=ahead, num_warps=num_warps,
    )  # fmt: skip
    return out
