"""The Triton kernels of ``paged_attention`` on CUDA: the attention kernel (a program per query tile and KV head,
walking its splits in registers or computing one split's partial) and the kernel that merges the partials in
split order. Both call the same ``_attend_split`` / ``_merge`` / ``_finalize``; ``launch`` picks their shapes."""

import triton
import triton.language as tl

from lockstep.ops._common import pdl_wait

# What the H200 must re-check (bench/attention_check.py): the bits of one query row do not depend on
# BLOCK_M (how many query rows share a tl.dot), on num_warps or num_stages, or on which of the two launch
# paths ran. By construction every per-row reduction here is a tl.dot (QK over head_dim; P@V and the
# denominator P@1 over the KV tile) or exact (max, where, elementwise): the row sum is a dot with a ones
# matrix rather than tl.sum, because tl.sum's order follows the register layout, which follows BLOCK_M (the
# one tl.sum, picking a tile's block ids, adds integers of which all but one are 0). docs/design.md ("Matmul")
# records that tl.dot's bits did not follow the tile shape on the H200 (Triton 3.6); that must hold here too.


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, search_steps, target, BLOCK_Q: tl.constexpr):
    # The last sequence s with start(s) <= target, where start(s) = query_start_loc[s] counts tokens
    # (BLOCK_Q == 0) or query tiles (start(s) = query_start_loc[s] // BLOCK_Q + s: every sequence owns
    # cdiv(q_len, BLOCK_Q) tiles, plus at most one spare). Binary search; search_steps >= log2(num_seqs) + 1.
    lo = tl.program_id(0) * 0
    hi = lo + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid)
        if BLOCK_Q > 0:
            start = start // BLOCK_Q + mid
        right = start <= target
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _opaque16(x):
    # An identity on 16-bit values the compiler cannot see through. Triton lays a dot operand that comes from an
    # 8-bit load out for converting in registers (kWidth from the narrowest type it finds behind the operand): on
    # sm_90 a 16-row tile's mma.sync then takes the head's (or the tile's positions') k steps in another grouping and
    # sums them otherwise, so an e4m3 cache gave other bits than the bf16 cache of its values (bench/attention_check.py
    # --kv-cache-dtype fp8 on the H200: 3503 of a 5000-position prefill's values at BLOCK_M 16, and decode against
    # prefill), where wgmma tiles (operands from shared memory) did not. Behind this the operand is a 16-bit tensor.
    return tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [x], dtype=x.dtype, is_pure=False, pack=1)


@triton.jit
def _attend_split(
    q, pos, split, last_tile, qk_scale, col0,
    k_base, v_base, block_table, seq_len, page_size, stride_kb, stride_ks, stride_vb, stride_vs,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, COLS: tl.constexpr, TILE: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, IDS_AHEAD: tl.constexpr,
    KV_FP8: tl.constexpr,
):  # fmt: skip
    # One split's online softmax for BLOCK_M query rows: q [BLOCK_M, D_PAD], pos [BLOCK_M] (-1: padding), over
    # V's columns col0 .. col0 + COLS (all of them when COLS = D_PAD: the scores always use all of K).
    # Returns m [BLOCK_M] (log2 units), den [BLOCK_M], acc [BLOCK_M, COLS], all fp32 and from scratch.
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    cols = col0 + tl.arange(0, COLS)
    col_ok = cols < HEAD_DIM
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M, 16], tl.float32)  # 16 equal columns: the denominator accumulates via tl.dot
    acc = tl.zeros([BLOCK_M, COLS], tl.float32)
    first = split * TILES_PER_SPLIT
    # Where tile t's block ids come from. With the K/V addresses depending on a block-table load of the same
    # iteration, Triton's pipeliner kept one K/V buffer whatever num_stages said, and each tile waited for its table
    # load and then its K/V load, nothing overlapping. So either the split's ids are loaded once, [TILES_PER_SPLIT,
    # TILE] (row i = tile first + i), and each tile takes its row by an exact integer select-sum (two layout
    # conversions through shared memory a tile in the compiled loop), or (IDS_AHEAD) each iteration loads the next
    # tile's ids for the next iteration (no conversion, ~15 more registers). Addresses only: the bits are the same.
    if IDS_AHEAD:
        ahead = first * TILE + tl.arange(0, TILE)
        ids_next = tl.load(block_table + ahead // page_size, mask=ahead < seq_len, other=0)
    else:
        rel = tl.arange(0, TILES_PER_SPLIT)[:, None]
        split_offs = (first + rel) * TILE + tl.arange(0, TILE)[None, :]
        blocks = tl.load(block_table + split_offs // page_size, mask=split_offs < seq_len, other=0)
    for t in range(first, tl.minimum(first + TILES_PER_SPLIT, last_tile + 1)):
        offs = t * TILE + tl.arange(0, TILE)
        kv_ok = offs < seq_len  # never read past the sequence: unused cache slots may hold NaN
        # int64 before any product: block * stride_kb passes 2^31 once a cache holds more than 2^31 elements
        if IDS_AHEAD:
            block = ids_next.to(tl.int64)
            ahead = offs + TILE
            ids_next = tl.load(block_table + ahead // page_size, mask=ahead < seq_len, other=0)
        else:
            block = tl.sum(tl.where(rel == t - first, blocks, 0), axis=0).to(tl.int64)
        slot = (offs % page_size).to(tl.int64)
        k_t = tl.load(
            k_base + (block * stride_kb + slot * stride_ks)[None, :] + dims[:, None],
            mask=kv_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )  # [D_PAD, TILE]
        v = tl.load(
            v_base + (block * stride_vb + slot * stride_vs)[:, None] + cols[None, :],
            mask=kv_ok[:, None] & col_ok[None, :],
            other=0.0,
        )  # [TILE, COLS]
        if KV_FP8:  # e4m3 -> q's dtype, exact; then everything as for a cache of that dtype
            k_t = k_t.to(q.dtype)
            v = v.to(q.dtype)
            if not UPCAST and q.dtype != tl.float32:
                k_t = _opaque16(k_t)
                v = _opaque16(v)
        q_dot = q
        if UPCAST:  # the interpreter's bf16/fp16 dot is wrong; run it in fp32 there (q stays in its dtype for V's)
            q_dot = q.to(tl.float32)
            k_t = k_t.to(tl.float32)
        s = tl.dot(q_dot, k_t, input_precision=PRECISION) * qk_scale
        s = tl.where(offs[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m == m_new, 1.0, tl.exp2(m - base))
        p = tl.exp2(s - base[:, None]).to(v.dtype)  # rounded to V's dtype for the dots, like FlashAttention
        ones = tl.full([TILE, 16], 1.0, v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
            ones = ones.to(tl.float32)
        den = tl.dot(p, ones, den * alpha[:, None], input_precision=PRECISION)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m = m_new
    return m, tl.max(den, 1), acc


@triton.jit
def _merge(m_run, den_run, acc_run, m, den, acc):
    # Fold one split's partial into the running state. From the empty state (m_run = -inf, den_run = 0,
    # acc_run = 0) the result is the partial itself; a partial that saw nothing (m = -inf) changes nothing.
    m_new = tl.maximum(m_run, m)
    base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(m_run == m_new, 1.0, tl.exp2(m_run - base))
    beta = tl.where(m == m_new, 1.0, tl.exp2(m - base))
    seen = m > float("-inf")
    # The rounding points spelled out (one product rounded, then a fused multiply-add), not left to the compiler: it
    # contracted ``a * b + c * d`` one way or the other by the compile (the H200 saw a merge program of 4 query heads
    # give other bits than one of 1, 8 or 32, and than the in-register walk, with the same source).
    den_out = tl.where(seen, tl.fma(den_run, alpha, den * beta), den_run)
    acc_out = tl.where(seen[:, None], tl.fma(acc_run, alpha[:, None], acc * beta[:, None]), acc_run)
    return tl.where(seen, m_new, m_run), den_out, acc_out


@triton.jit
def _finalize(den, acc):
    out = acc / tl.where(den == 0.0, 1.0, den)[:, None]  # den = 0 only on padding rows
    return tl.where(out == 0.0, 0.0, out)  # -0.0 -> +0.0 (see the package docstring)


@triton.jit(do_not_specialize=["inline_splits"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, part_ptr, part_ml_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, search_steps, page_size, qk_scale, inline_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_pt, stride_ps, stride_ph, stride_mt, stride_ms, stride_mh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    SPLIT_PROGRAMS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, ONE_PER_SEQ: tl.constexpr,
    HEADS_INNER: tl.constexpr, NUM_KV_HEADS: tl.constexpr, COL_GROUPS: tl.constexpr, COLS: tl.constexpr,
    IDS_AHEAD: tl.constexpr, SKIP_EMPTY: tl.constexpr, KV_FP8: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    # Program (query tile, kv head[, split]). Rows are (token, head of the group) pairs, token-major:
    # row r is token r // GROUP of the tile and query head kv_head * GROUP + r % GROUP. ONE_PER_SEQ (a decode
    # step: one token per sequence): tile s is sequence s, found without the search. HEADS_INNER: the grid's first
    # dimension numbers (tile, kv head) with the head fastest, so a tile's KV heads run side by side and read the
    # cache's [page, kv_heads, head_dim] rows together; else it numbers tiles and the second one heads.
    # COL_GROUPS > 1: each KV head's output columns are cut into that many groups, a program each (all of them
    # compute the same scores; a column's sum over positions is the same whoever computes it).
    if HEADS_INNER:
        tile = tl.program_id(0) // (NUM_KV_HEADS * COL_GROUPS)
        unit = tl.program_id(0) % (NUM_KV_HEADS * COL_GROUPS)
    else:
        tile = tl.program_id(0)
        unit = tl.program_id(1)
    if SKIP_EMPTY:  # (decode, split programs) a program with no split of its row leaves after one load
        if tl.program_id(2) > 0:
            splits = (tl.load(seq_lens_ptr + tile) - 1) // (TILE * TILES_PER_SPLIT) + 1  # the row's (tile = seq)
            if (splits <= inline_splits) | (splits <= tl.program_id(2)):
                return
    kv_head = unit // COL_GROUPS
    col0 = (unit % COL_GROUPS) * COLS  # COLS = D_PAD // COL_GROUPS
    if ONE_PER_SEQ:
        seq = tile
    else:
        seq = _find_seq(query_start_loc_ptr, num_seqs, search_steps, tile, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    tok0 = q_begin if ONE_PER_SEQ else q_begin + (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if tok0 >= q_end:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_end)
    pos = tl.where(row_ok, seq_len - q_end + tok, -1)  # the j-th new token sits at seq_len - q_len + j
    last_tile = (seq_len - q_end + tl.minimum(tok0 + BLOCK_Q, q_end) - 1) // TILE
    dims = tl.arange(0, D_PAD)
    q = tl.load(
        q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    cols = col0 + tl.arange(0, COLS)  # this program's output columns
    io_mask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    num_splits = last_tile // TILES_PER_SPLIT + 1
    if SPLIT_PROGRAMS and num_splits > inline_splits:
        # Splits p, p + P, p + 2P, ... of these rows, P the grid's third dimension: each split's partial is
        # computed from scratch, so which program computes it cannot change it.
        for split in range(tl.program_id(2), num_splits, tl.num_programs(2)):
            m, den, acc = _attend_split(
                q, pos, split, last_tile, qk_scale, col0,
                k_base, v_base, block_table, seq_len, page_size, stride_kb, stride_ks, stride_vb, stride_vs,
                BLOCK_M, HEAD_DIM, D_PAD, COLS, TILE, TILES_PER_SPLIT, UPCAST, PRECISION, IDS_AHEAD, KV_FP8,
            )  # fmt: skip
            ml = tok.to(tl.int64) * stride_mt + split * stride_ms + head * stride_mh
            # Every column group has the same (m, den); the first stores them (a full block: the interpreter takes
            # no scalar in a store's mask).
            ml_ok = row_ok & ((rows * 0 + col0) == 0)
            tl.store(part_ml_ptr + ml, m, mask=ml_ok)
            tl.store(part_ml_ptr + ml + 1, den, mask=ml_ok)
            part = tok.to(tl.int64)[:, None] * stride_pt + split * stride_ps + head[:, None] * stride_ph
            tl.store(part_ptr + part + cols[None, :], acc, mask=io_mask)
    elif tl.program_id(2) == 0:
        # The in-register walk: every split in order, merged as it comes, the output stored here. Split programs
        # take it too for rows with at most ``inline_splits`` splits (the merge kernel then skips them).
        m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
        den_run = tl.zeros([BLOCK_M], tl.float32)
        acc_run = tl.zeros([BLOCK_M, COLS], tl.float32)
        for split in range(0, num_splits):
            m, den, acc = _attend_split(
                q, pos, split, last_tile, qk_scale, col0,
                k_base, v_base, block_table, seq_len, page_size, stride_kb, stride_ks, stride_vb, stride_vs,
                BLOCK_M, HEAD_DIM, D_PAD, COLS, TILE, TILES_PER_SPLIT, UPCAST, PRECISION, IDS_AHEAD, KV_FP8,
            )  # fmt: skip
            m_run, den_run, acc_run = _merge(m_run, den_run, acc_run, m, den, acc)
        out = _finalize(den_run, acc_run)
        o = o_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + cols[None, :]
        tl.store(o, out.to(o_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _load_partial(acc_ptrs, ml_ptrs, split, n, heads, num_heads, mask, stride_ps, stride_ms):
    # One split's partial (m, den, acc) for the program's heads; past the row's last split the empty partial
    # (m = -inf), which ``_merge`` folds in as a no-op, bit for bit.
    ok = (heads < num_heads) & (heads * 0 + split < n)
    m = tl.load(ml_ptrs + split * stride_ms, mask=ok, other=float("-inf"))
    den = tl.load(ml_ptrs + split * stride_ms + 1, mask=ok, other=0.0)
    acc = tl.load(acc_ptrs + split * stride_ps, mask=mask & ok[:, None], other=0.0)
    return m, den, acc


@triton.jit
def _load4(acc_ptrs, ml_ptrs, s0, n, heads, num_heads, mask, stride_ps, stride_ms):
    # Splits s0 .. s0 + 3, all four loads issued before any is used.
    m0, d0, a0 = _load_partial(acc_ptrs, ml_ptrs, s0, n, heads, num_heads, mask, stride_ps, stride_ms)
    m1, d1, a1 = _load_partial(acc_ptrs, ml_ptrs, s0 + 1, n, heads, num_heads, mask, stride_ps, stride_ms)
    m2, d2, a2 = _load_partial(acc_ptrs, ml_ptrs, s0 + 2, n, heads, num_heads, mask, stride_ps, stride_ms)
    m3, d3, a3 = _load_partial(acc_ptrs, ml_ptrs, s0 + 3, n, heads, num_heads, mask, stride_ps, stride_ms)
    return m0, d0, a0, m1, d1, a1, m2, d2, a2, m3, d3, a3


@triton.jit
def _merge4(m_run, den_run, acc_run, m0, d0, a0, m1, d1, a1, m2, d2, a2, m3, d3, a3):
    m_run, den_run, acc_run = _merge(m_run, den_run, acc_run, m0, d0, a0)
    m_run, den_run, acc_run = _merge(m_run, den_run, acc_run, m1, d1, a1)
    m_run, den_run, acc_run = _merge(m_run, den_run, acc_run, m2, d2, a2)
    return _merge(m_run, den_run, acc_run, m3, d3, a3)


@triton.jit(do_not_specialize=["inline_splits"])
def _merge_splits_kernel(
    part_ptr, part_ml_ptr, o_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, search_steps, inline_splits,
    stride_pt, stride_ps, stride_ph, stride_mt, stride_ms, stride_mh, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    SPLIT_SIZE: tl.constexpr, ONE_PER_SEQ: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    # Program per (token, HEADS of its query heads): merge splits 0 .. pos // SPLIT_SIZE in order. A row with at
    # most ``inline_splits`` splits was finished by the attention kernel's in-register walk (decode steps only).
    # Each head's merge is its own sequence of ``_merge`` calls, so neither HEADS nor CHUNK (splits loaded before
    # they are merged, to overlap the loads' latency: a batch-1 row at 32k context has 64 splits) changes a bit.
    tok = tl.program_id(0)
    if ONE_PER_SEQ:
        seq = tok
    else:
        seq = _find_seq(query_start_loc_ptr, num_seqs, search_steps, tok, 0)
    pos = tl.load(seq_lens_ptr + seq) - tl.load(query_start_loc_ptr + seq + 1) + tok
    n = pos // SPLIT_SIZE + 1
    if n <= inline_splits:
        return
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    dims = tl.arange(0, D_PAD)
    head_ok = heads < NUM_HEADS
    mask = head_ok[:, None] & (dims[None, :] < HEAD_DIM)
    acc_ptrs = part_ptr + tok.to(tl.int64) * stride_pt + heads[:, None] * stride_ph + dims[None, :]
    ml = part_ml_ptr + tok.to(tl.int64) * stride_mt + heads * stride_mh
    m_run = tl.full([HEADS], float("-inf"), tl.float32)
    den_run = tl.zeros([HEADS], tl.float32)
    acc_run = tl.zeros([HEADS, D_PAD], tl.float32)
    args = (n, heads, NUM_HEADS, mask, stride_ps, stride_ms)
    for s0 in range(0, n, CHUNK):
        if CHUNK == 1:
            m0, d0, a0 = _load_partial(acc_ptrs, ml, s0, *args)
            m_run, den_run, acc_run = _merge(m_run, den_run, acc_run, m0, d0, a0)
        else:
            m0, d0, a0, m1, d1, a1, m2, d2, a2, m3, d3, a3 = _load4(acc_ptrs, ml, s0, *args)
            if CHUNK == 8:
                m4, d4, a4, m5, d5, a5, m6, d6, a6, m7, d7, a7 = _load4(acc_ptrs, ml, s0 + 4, *args)
            m_run, den_run, acc_run = _merge4(m_run, den_run, acc_run, m0, d0, a0, m1, d1, a1, m2, d2, a2, m3, d3, a3)
            if CHUNK == 8:
                m_run, den_run, acc_run = _merge4(
                    m_run, den_run, acc_run, m4, d4, a4, m5, d5, a5, m6, d6, a6, m7, d7, a7
                )
    out = _finalize(den_run, acc_run)
    o = o_ptr + tok.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=mask)
