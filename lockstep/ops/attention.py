"""Batch-invariant paged attention: ``write_kv`` and ``paged_attention``.

The contract: a query token at position p gets the same bits whether it arrives in a one-shot prefill, in any
chunk of a chunked prefill, as a decode step, after a prefix-cache hit, and whatever shares its batch. So the
KV reduction of one query row is a function of p and fixed constants only:
- KV is reduced in tiles of ``TILE`` positions aligned to position 0 (tile t covers [t*TILE, (t+1)*TILE)),
  in increasing order, with an online softmax in fp32 (running max m, denominator den, numerator acc);
- the tiles are grouped into splits of ``SPLIT`` positions (a fixed split size, never a fixed split count);
  each split's (m, den, acc) starts from scratch, and the splits are merged in increasing order;
- rows that see no position of a tile or split (a causal row in a query tile whose later rows reach further)
  get -inf scores there. The merge skips an empty split exactly; an empty tile adds P = 0 columns, which can
  only flip the sign of an exact zero, so the output turns -0.0 into +0.0 at the end. The same holds for
  the masked columns of the diagonal tile, whose V differs by path (future tokens in a prefill, zeros past
  the end of the sequence in a decode step). (A V of inf/NaN at a later position of the same prefill would
  still poison 0 * V; a model that produces those has bigger problems.)

CUDA runs one Triton kernel over the varlen batch. A program owns (a tile of query tokens of one sequence,
one KV head with its group of query heads) and either walks all the splits of its rows, merging each into a
running state in registers, or (decode, and prefills with too few programs to fill the GPU) computes one
split and writes the partial, which a second kernel merges in split order. Both paths call the
same ``_attend_split`` / ``_merge`` / ``_finalize`` code, and an fp32 partial round-trips memory exactly.
The CPU runs the same tile/split structure with batched matmuls of one fixed per-entry shape.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lockstep.ops._common import FLOATS, interpreting, intra_op_threads, num_sms, pdl_launch, pdl_wait

# KV positions per reduction tile. 64 is FlashAttention's usual BLOCK_N for head_dim 64-128 on Hopper, and
# on the CPU it keeps the per-step matmuls big enough to amortise the Python loop.
TILE = 64
# KV positions per split. Decode at small batch needs splits for parallelism (batch 1, 4k context, 8 KV heads:
# 64 programs at 512, 8 at 4096); each split costs one merge step, and the split-parallel path stores one fp32
# partial per (token, split, head). 512 keeps both cheap.
SPLIT = 512
# Query tokens per CPU work entry. Entries of several sequences are batched into one bmm of fixed per-entry
# shape [ROWS * group, head_dim] x [head_dim, TILE]; small enough that a decode row wastes little.
_CPU_ROWS = 4


# ----------------------------------------------------------------------------------------------- write_kv


# An FP8 cache holds e4m3 values with a per-tensor scale of 1 (vLLM's default without calibrated scales): a value
# is rounded to nearest even and saturated at +-448 as it is stored, and read back exactly (e4m3 fits in bf16 and
# fp32). Every writer (write_kv on both devices, the fused rotary_write_kv kernel) rounds the model-dtype value.
FP8_KV = torch.float8_e4m3fn


@triton.jit
def to_cache(x, dtype: tl.constexpr):
    """``x`` as a cache of ``dtype`` stores it: e4m3 saturated at +-448 and rounded to nearest even, else a cast."""
    if dtype == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0).to(dtype, fp_downcast_rounding="rtne")
    return x.to(dtype)


def cache_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``to_cache`` in torch ops."""
    return x.float().clamp(-448.0, 448.0).to(dtype) if dtype == FP8_KV else x.to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # The CPU has no index_copy_/index_select for e4m3: move the bytes instead.
    return t.view(torch.uint8) if t.dtype == FP8_KV else t


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    page_size, num_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, H_PAD)
    dims = tl.arange(0, D_PAD)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HEAD_DIM)
    src = token.to(tl.int64) * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    dst = (slot // page_size) * stride_cb + (slot % page_size) * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + src, mask=mask)
    tl.store(k_cache_ptr + dst, to_cache(k, k_cache_ptr.dtype.element_ty), mask=mask)
    src = token.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    v = tl.load(v_ptr + src, mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(v, v_cache_ptr.dtype.element_ty), mask=mask)


def _write_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k_cache.shape[1], num_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(num_heads), D_PAD=triton.next_power_of_2(head_dim),
        **pdl_launch(k),
    )  # fmt: skip


def check_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """ValueError unless ``write_kv`` can store ``k, v`` into these caches at these slots."""
    if k.shape != v.shape or k.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes: k {tuple(k.shape)}, v {tuple(v.shape)}, caches {tuple(k_cache.shape)}")
    if k_cache.shape[2:] != k.shape[1:] or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"k {tuple(k.shape)}, cache {tuple(k_cache.shape)}, slots {tuple(slot_mapping.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys and values into the paged cache.

    ``k, v: [num_tokens, num_kv_heads, head_dim]``; ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim]`` (contiguous); ``slot_mapping: [num_tokens]``, slot = block_id * block_size + offset, -1 = skip.
    """
    check_kv(k, v, k_cache, v_cache, slot_mapping)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if k.is_cuda:
        _write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    _bytes(k_cache).view(-1, *k_cache.shape[2:]).index_copy_(0, slots, _bytes(cache_values(k, k_cache.dtype)))
    _bytes(v_cache).view(-1, *v_cache.shape[2:]).index_copy_(0, slots, _bytes(cache_values(v, v_cache.dtype)))


# ------------------------------------------------------------------------------------ attention (Triton)
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
        if UPCAST:  # the interpreter's bf16/fp16 dot is wrong; run it in fp32 there
            k_t = k_t.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale
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
    den_out = tl.where(seen, den_run * alpha + den * beta, den_run)
    acc_out = tl.where(seen[:, None], acc_run * alpha[:, None] + acc * beta[:, None], acc_run)
    return tl.where(seen, m_new, m_run), den_out, acc_out


@triton.jit
def _finalize(den, acc):
    out = acc / tl.where(den == 0.0, 1.0, den)[:, None]  # den = 0 only on padding rows
    return tl.where(out == 0.0, 0.0, out)  # -0.0 -> +0.0 (see the module docstring)


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
    if UPCAST:
        q = q.to(tl.float32)
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


@triton.jit(do_not_specialize=["inline_splits"])
def _merge_splits_kernel(
    part_ptr, part_ml_ptr, o_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, search_steps, inline_splits,
    stride_pt, stride_ps, stride_ph, stride_mt, stride_ms, stride_mh, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    SPLIT_SIZE: tl.constexpr, ONE_PER_SEQ: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    # Program per token, all its query heads: merge splits 0 .. pos // SPLIT_SIZE in order. A row with at most
    # ``inline_splits`` splits was finished by the attention kernel's in-register walk (decode steps only).
    tok = tl.program_id(0)
    if ONE_PER_SEQ:
        seq = tok
    else:
        seq = _find_seq(query_start_loc_ptr, num_seqs, search_steps, tok, 0)
    pos = tl.load(seq_lens_ptr + seq) - tl.load(query_start_loc_ptr + seq + 1) + tok
    if pos // SPLIT_SIZE < inline_splits:
        return
    heads = tl.arange(0, H_PAD)
    dims = tl.arange(0, D_PAD)
    head_ok = heads < NUM_HEADS
    mask = head_ok[:, None] & (dims[None, :] < HEAD_DIM)
    m_run = tl.full([H_PAD], float("-inf"), tl.float32)
    den_run = tl.zeros([H_PAD], tl.float32)
    acc_run = tl.zeros([H_PAD, D_PAD], tl.float32)
    for split in range(0, pos // SPLIT_SIZE + 1):
        ml = part_ml_ptr + tok.to(tl.int64) * stride_mt + split * stride_ms + heads * stride_mh
        m = tl.load(ml, mask=head_ok, other=float("-inf"))
        den = tl.load(ml + 1, mask=head_ok, other=0.0)
        part = part_ptr + tok.to(tl.int64) * stride_pt + split * stride_ps
        acc = tl.load(part + heads[:, None] * stride_ph + dims[None, :], mask=mask, other=0.0)
        m_run, den_run, acc_run = _merge(m_run, den_run, acc_run, m, den, acc)
    out = _finalize(den_run, acc_run)
    o = o_ptr + tok.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=mask)


# Memory for the split-program path's partials, fp32 (acc, m, den) per (token, split, query head); above it the
# in-register path runs (a long prefill's partials would take gigabytes). A decode graph at batch 256 under
# Qwen3's 40,960-token max_model_len needs 340 MB.
_PART_CAP_BYTES = 1 << 29


def _use_split_programs(decode: bool, max_splits: int, programs: int, part_bytes: int, num_sms: int) -> bool:
    """The default launch path (either gives the same bits). On the H200 split programs (one per split, then
    the merge kernel) were never slower than the in-register walk in decode, and 1.25x faster at batch 64,
    4k context, where the in-register grid already had 640 programs: 8 splits of 8 tiles each balance better
    than one walk of 64, and the partials add ~2% to the K/V traffic. So decode takes them whenever the
    partials fit (its short rows still walk in registers: ``_inline_splits``); prefill (partials per query token)
    only when its grid cannot fill the GPU."""
    if max_splits <= 1 or part_bytes > _PART_CAP_BYTES:
        return False
    return decode or programs < 2 * num_sms


def _split_grid(max_splits: int, programs: int, num_sms: int) -> int:
    """The split-program path's programs per (query tile, KV head): a power of two up to ``max_splits``, as many as
    keep the grid within 64 programs per SM. Program p takes splits p, p + P, ... (the bits do not depend on P).
    One program per split, as before, left a CUDA graph's decode grid (its block table as wide as max_model_len)
    almost all programs that had nothing to do: batch 128 under a 40k-token max_model_len is 102,400 programs a
    layer for a 128-token context. Decode at batch 64 and 4k context keeps its measured 8."""
    grid = 1
    while grid * 2 <= max_splits and programs * grid * 2 <= 64 * num_sms:
        grid *= 2
    return grid


def _inline_splits(programs: int, num_sms: int) -> int:
    """Decode rows with at most this many splits skip the split programs' partials: the tile's first program walks
    them in registers and stores the output, the merge kernel passes them by (the same bits either way).

    Measured on the H200 (bench/attention_check.py, a 40,960-position table, 32/8 heads): with at least ~1.5
    programs per SM, up to 4 splits in registers beat the split path by 4-6% on uniform contexts (batch 256 at 1k /
    2k: 297 / 567 us vs 311 / 596) and keep a long row's splits spread out: batch 256 of 1k contexts with one of 32k
    took 660 us against 1296 for the all-in-register walk. With fewer programs the walk starves the GPU of
    parallelism (batch 8 at 2k: 64 us vs 33), so only rows of one split, which have nothing to merge, take it."""
    return 4 if 2 * programs >= 3 * num_sms else 1


def _col_groups(decode: bool, programs: int, num_sms: int, d_pad: int) -> int:
    """How many programs share each (query tile, KV head)'s output columns (the same bits for any count).

    Measured on the H200 (bench/attention_check.py, 32/8 heads, head_dim 128, a 40,960-position block table):
    batch-1 decode runs 8 programs per split on 132 SMs; two column groups took 13.1 us at 1k context against 18.5
    and 21.0 against 23.9 at 4k (each group reads all of K, mostly from L2), batch 4 17.1 against 19.2 at 1k and
    33.5 against 32.2 at 4k; at batch 8 (64 programs a split) they lose as often as they win, four groups lose
    everywhere past batch 1. So decode grids of at most one program per 4 SMs take two, when the head has the 32
    columns two groups of 16 need (tiny test models have 16)."""
    return 2 if decode and 4 * programs <= num_sms and d_pad >= 32 else 1


def _ids_ahead(decode: bool, programs: int, num_sms: int) -> bool:
    """Whether each tile loop iteration loads the next tile's block ids (``_attend_split``; the same bits either way).

    Measured on the H200 (bench/attention_check.py, 32/8 heads, a 40,960-position block table, session 10): with at
    least ~1.5 decode programs per SM (batch >= 25 at 8 KV heads) never slower and 0.5-4% faster (batch 256: 289.0 vs
    290.9 us at 1k context, 548.6 vs 555.4 at 2k, 1112 vs 1134 at 4k); with fewer programs nothing hides the wait for
    the ids before the next K/V loads (batch 1 at 1k: 20.6 us against 13.0)."""
    return decode and 2 * programs >= 3 * num_sms


def _skip_empty(decode: bool, programs: int, num_sms: int) -> bool:
    """Whether a decode split program with no split of its row leaves after loading the row's length, before the query
    loads (most of them have none: a CUDA graph's grid is sized for max_model_len, and they run after the programs
    that work). The same bits either way.

    Measured on the H200 (bench/attention_check.py as above, session 10, two runs): from batch 8 (64 programs) up it
    was faster, batch 8 at 128 context 6.9 us against 10.1, batch 64 at 1k 80.2 against 87.6, batch 128 147.9 against
    155.7, batch 256 284.7 against 288.2; at batch 1-4 (the grids that take two column groups) slower, batch 1 at 1k
    14.5 against 12.9, batch 4 at 4k 40.1 against 33.4."""
    return decode and 4 * programs > num_sms


def _paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    split: int = SPLIT,
    block_m: int | None = None,
    split_programs: bool | None = None,
    split_grid: int | None = None,
    inline_splits: int | None = None,
    heads_inner: bool = True,
    col_groups: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    ids_ahead: bool | None = None,
    skip_empty: bool | None = None,
) -> torch.Tensor:
    # The keyword arguments pick launch shapes, never the math: every choice gives the same bits (tests and
    # bench/attention_check.py compare them). Everything is decided from shapes, with no host sync.
    if split % TILE or (split // TILE) & (split // TILE - 1):
        raise ValueError(f"split must be TILE ({TILE}) times a power of two, got {split}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    decode = num_tokens <= num_seqs  # one query per sequence (or fewer): short tiles
    if block_m is None:
        # A step whose sequences average fewer than 64 new tokens is mostly decode rows next to a few prefills
        # (a tile per row either way): BLOCK_M 64 wastes half as much of each MMA on them as 128.
        block_m = 16 if decode else 128 if num_tokens >= 64 * num_seqs else 64
    block_m = max(block_m, triton.next_power_of_2(group), 16)
    block_q = block_m // group
    # A decode step (a token per sequence; the engine never schedules a sequence without tokens) needs one tile
    # per sequence; otherwise every sequence owns cdiv(q_len, block_q) tiles, plus at most one spare.
    one_per_seq = num_tokens == num_seqs
    num_tiles = num_seqs if one_per_seq else num_tokens // block_q + num_seqs
    max_splits = triton.cdiv(block_tables.shape[1] * page_size, split)
    part_bytes = num_tokens * max_splits * num_q_heads * (head_dim + 2) * 4
    programs, sms = num_tiles * num_kv_heads, num_sms(q.device)  # (query tile, KV head) pairs; what the choices use
    if split_programs is None:
        split_programs = _use_split_programs(decode, max_splits, programs, part_bytes, sms)
    if num_stages is None:
        # Decode streams K/V: 3 stages = 2 K/V buffers in flight (72 KB of shared memory at head_dim 128). Registers
        # cap it at 2 programs per SM (201 a thread, ptxas sm_90 and ncu on the H200); 4 stages were no faster.
        # Prefill: BLOCK_M 128 with 3 stages beat 64 with 2 by 8-14% on the H200 (bench/attention_check.py, causal,
        # 1 x 4096: 539 vs 592 us, 1 x 16384: 7622 vs 8891, 8 x 1024: 324 vs 351); 64 with 3 stages took 867 us.
        num_stages = 3 if decode or block_m >= 128 else 2
    if split_programs:
        part = torch.empty((num_tokens, max_splits, num_q_heads, head_dim), device=q.device, dtype=torch.float32)
        part_ml = torch.empty((num_tokens, max_splits, num_q_heads, 2), device=q.device, dtype=torch.float32)
    else:
        part = part_ml = torch.empty((1, 1, 1, 2), device=q.device, dtype=torch.float32)
    search_steps = max(1, num_seqs.bit_length())
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if split_programs and split_grid is None:
        split_grid = _split_grid(max_splits, programs, sms)
    if not (split_programs and one_per_seq):
        inline_splits = 0  # the merge kernel can only skip a row whose tile is that one row
    elif inline_splits is None:
        inline_splits = _inline_splits(programs, sms)
    # heads_inner (the kernel says what it does) was up to 4% faster on the H200 in decode, a few per cent either
    # way in causal prefill (bench/attention_check.py: 1 x 4096 592 vs 620 us, 1 x 16384 8891 vs 8586 at BLOCK_M 64).
    if col_groups is None:
        col_groups = _col_groups(decode, programs, sms, d_pad)
    if ids_ahead is None:
        ids_ahead = _ids_ahead(decode, programs, sms)
    if skip_empty is None:
        skip_empty = _skip_empty(decode, programs, sms)
    skip_empty = skip_empty and split_programs and one_per_seq
    if d_pad % col_groups or d_pad // col_groups < 16:
        raise ValueError(f"col_groups must cut {d_pad} columns into groups of at least 16, got {col_groups}")
    units = num_kv_heads * col_groups
    pdl = pdl_launch(q)  # both kernels' launch
    grid = (num_tiles * units, 1) if heads_inner else (num_tiles, units)
    _paged_attention_kernel[(*grid, split_grid if split_programs else 1)](
        q, k_cache, v_cache, out, part, part_ml,
        block_tables, seq_lens, query_start_loc,
        num_seqs, search_steps, page_size, scale * math.log2(math.e), inline_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), part.stride(0), part.stride(1), part.stride(2),
        part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim, D_PAD=d_pad,
        TILE=TILE, TILES_PER_SPLIT=split // TILE, SPLIT_PROGRAMS=split_programs,
        UPCAST=interpreting() and q.dtype != torch.float32,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ONE_PER_SEQ=one_per_seq,
        HEADS_INNER=heads_inner, NUM_KV_HEADS=num_kv_heads, COL_GROUPS=col_groups,
        COLS=d_pad // col_groups, IDS_AHEAD=ids_ahead, SKIP_EMPTY=skip_empty, KV_FP8=k_cache.dtype == FP8_KV,
        num_warps=num_warps or (4 if block_m <= 64 else 8), num_stages=num_stages, **pdl,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
    if split_programs:
        _merge_splits_kernel[(num_tokens,)](
            part, part_ml, out, seq_lens, query_start_loc,
            num_seqs, search_steps, inline_splits,
            part.stride(0), part.stride(1), part.stride(2),
            part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
            out.stride(0), out.stride(1),
            NUM_HEADS=num_q_heads, H_PAD=triton.next_power_of_2(num_q_heads), HEAD_DIM=head_dim,
            D_PAD=d_pad, SPLIT_SIZE=split, ONE_PER_SEQ=one_per_seq, **pdl,
        )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------- attention (CPU)
# The same structure: TILE-position tiles in order, an online softmax per SPLIT, splits merged in order. Work
# is cut into entries of _CPU_ROWS consecutive query tokens of one sequence; an item is (entry, tile). Every
# item's scores come from one bmm entry of the fixed shape [ROWS * group, D] x [D, TILE] and its P@V from one of
# [ROWS * group, TILE] x [TILE, D]. The CPU BLAS picks its algorithm from the call's shape, but the per-entry
# result of aten.bmm does not depend on the number of entries or an entry's slot in the batch (tests check
# this alongside the whole path); the rest is elementwise, exact (max, cummax, where) or a per-row sum over a
# fixed TILE. So the items of many entries and tiles go through each op together, and only the rescaled sums
# (den, acc) walk the tiles one by one, every split at once; the splits are then merged in order. An entry
# shorter than its chunk's longest gets tiles past its end that see nothing: they leave den exact and can
# only flip the sign of an exact zero in acc (see the module docstring). torch.exp, not exp2: CPU exp2 rounds
# a tensor's scalar tail differently from its vector body. Unlike the GPU, P stays fp32 for P@V (the CPU
# computes in fp32 anyway), so CPU and GPU bits differ, as docs/design.md ("What is not invariant") allows.
#
# Which items exist, the cache rows they read and their causal masks are the same for every layer of a step:
# ``cpu_attention_plan`` works them out once, and each layer's call takes the plan.

# Bytes of K one chunk of entries gathers (V as much again): bounds the memory of a long prefill.
_CPU_CHUNK_BYTES = 32 << 20
# Below this many (item, kv head) bmm entries a step runs on one thread: a decode step's attention is a few dozen
# small calls, and waking the OpenMP workers for each made it 2-3x slower with OMP_WAIT_POLICY=PASSIVE on the
# 2-core machines; with spinning workers two threads only won from ~100 entries. The bits do not depend on the
# thread count (per-entry bmm results and elementwise ops; tested).
_CPU_SERIAL_ENTRIES = 96


@dataclass(frozen=True)
class _CpuChunk:
    """Entries ``[first, first + num_entries)`` of a plan, as a grid of ``num_entries x num_tiles`` items."""

    first: int
    num_entries: int
    num_tiles: int  # tiles of the chunk's longest entry
    q_rows: torch.Tensor  # [E * T * H_kv * R] rows of q viewed as [tokens * H_q, D] (padding rows read token 0)
    kv_rows: torch.Tensor  # [E * T * H_kv * TILE] rows of the cache viewed as [slots * H_kv, D]
    v_zero: torch.Tensor | None  # indices into kv_rows past a sequence's end (unused slots may hold NaN)
    masked: torch.Tensor  # [E, T, 1, R, TILE] bool: True where a score is -inf


@dataclass(frozen=True)
class CpuAttentionPlan:
    """How the CPU path cuts one batch into work, for caches with ``key = (page_size, num_kv_heads, head_dim,
    group)``. Entries of ``rows_per_entry`` query tokens of one sequence are ordered longest first; each is
    ``R = rows_per_entry * group`` matmul rows per KV head, (token, head of the group) token-major."""

    key: tuple[int, int, int, int]
    rows_per_entry: int
    chunks: tuple[_CpuChunk, ...]
    out_rows: torch.Tensor  # [tokens * H_q]: where each (token, query head) sits in the output [E * H_kv * R]

    @property
    def bmm_entries(self) -> int:
        """(item, kv head) pairs: the entries of each of the step's two bmm passes."""
        return sum(c.num_entries * c.num_tiles for c in self.chunks) * self.key[1]


def cpu_attention_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_shape: tuple[int, ...],
    num_q_heads: int,
    *,
    rows_per_entry: int = _CPU_ROWS,
) -> CpuAttentionPlan:
    """The CPU path's plan for one batch (``paged_attention``'s arguments; ``cache_shape`` is the K cache's)."""
    _, page_size, num_kv_heads, head_dim = cache_shape
    group = num_q_heads // num_kv_heads
    n_rows = rows_per_entry * group
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    toks, poss, seqs = [], [], []
    for i in range(len(lens)):
        q_len = starts[i + 1] - starts[i]
        if q_len == 0:
            continue
        padded = -(-q_len // rows_per_entry) * rows_per_entry
        j = torch.arange(padded)
        toks.append(torch.where(j < q_len, starts[i] + j, -1).view(-1, rows_per_entry))
        poss.append(torch.where(j < q_len, lens[i] - q_len + j, -1).view(-1, rows_per_entry))
        seqs.append(torch.full((padded // rows_per_entry,), i))
    tok, pos, seq = torch.cat(toks), torch.cat(poss), torch.cat(seqs)
    n_tiles = pos.amax(1) // TILE + 1
    # Longest first, so that a chunk's entries need about as many tiles each (the order is only a slot in a bmm).
    order = torch.argsort(n_tiles, descending=True, stable=True)
    tok, pos, seq, n_tiles = tok[order], pos[order], seq[order], n_tiles[order].tolist()
    num_entries = tok.shape[0]

    # Matmul row (entry e, kv head h, row r * group + g) is query token tok[e, r], head h * group + g.
    heads = torch.arange(num_kv_heads).view(1, -1, 1, 1) * group + torch.arange(group).view(1, 1, 1, -1)
    q_rows = tok.clamp(min=0).view(num_entries, 1, rows_per_entry, 1) * num_q_heads + heads  # [E, H, ROWS, group]
    live = (tok >= 0).view(num_entries, 1, rows_per_entry, 1).expand_as(q_rows).flatten()
    out_rows = torch.empty(int(live.sum()), dtype=torch.int64)
    out_rows[q_rows.flatten()[live]] = live.nonzero().squeeze(1)
    q_rows = q_rows.reshape(num_entries, 1, num_kv_heads, n_rows)
    row_pos = pos.repeat_interleave(group, dim=1)  # [E, R]

    lens_t, tables = seq_lens.long(), block_tables.long()
    kv_heads = torch.arange(num_kv_heads)[:, None]
    item_bytes = num_kv_heads * TILE * head_dim * 4
    chunks = []
    first = 0
    while first < num_entries:
        num_tiles = n_tiles[first]
        count = max(1, min(num_entries - first, _CPU_CHUNK_BYTES // (num_tiles * item_bytes)))
        entries = slice(first, first + count)
        offs = torch.arange(num_tiles * TILE)
        kv_ok = offs < lens_t[seq[entries], None]  # [E, T * TILE]
        blocks = tables[seq[entries]].gather(1, (offs // page_size).clamp(max=tables.shape[1] - 1).expand(count, -1))
        slots = torch.where(kv_ok, blocks * page_size + offs % page_size, 0).view(count, num_tiles, 1, TILE)
        v_zero = (~kv_ok).view(count, num_tiles, 1, TILE).expand(-1, -1, num_kv_heads, -1).flatten().nonzero()
        chunks.append(
            _CpuChunk(
                first, count, num_tiles,
                q_rows=q_rows[entries].expand(-1, num_tiles, -1, -1).flatten(),
                kv_rows=(slots * num_kv_heads + kv_heads).flatten(),
                v_zero=v_zero.squeeze(1) if v_zero.numel() else None,
                masked=offs.view(1, num_tiles, 1, 1, TILE) > row_pos[entries, None, None, :, None],
            )
        )  # fmt: skip
        first += count
    return CpuAttentionPlan((page_size, num_kv_heads, head_dim, group), rows_per_entry, tuple(chunks), out_rows)


def _merge_cpu(run, part):
    # run, part: (m [E, H, R], den [E, H, R], acc [E, H, R, D]) -> part folded into run.
    m_run, den_run, acc_run = run
    m, den, acc = part
    m_new = torch.maximum(m_run, m)
    base = torch.where(m_new == float("-inf"), 0.0, m_new)
    alpha = torch.where(m_run == m_new, 1.0, torch.exp(m_run - base))
    beta = torch.where(m == m_new, 1.0, torch.exp(m - base))
    seen = m > float("-inf")
    den_out = torch.where(seen, den_run * alpha + den * beta, den_run)
    acc_out = torch.where(seen[..., None], acc_run * alpha[..., None] + acc * beta[..., None], acc_run)
    return torch.where(seen, m_new, m_run), den_out, acc_out


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # aten.bmm.out, not torch.bmm: inside batch_invariant_mode torch.bmm would come back to lockstep.
    return torch.ops.aten.bmm.out(a, b, out=a.new_empty((a.shape[0], a.shape[1], b.shape[2])))


def _cache_floats(rows: torch.Tensor) -> torch.Tensor:
    # Gathered cache rows as fp32 (an e4m3 cache's arrive as bytes: ``_bytes``), exactly.
    return rows.view(FP8_KV).float() if rows.dtype == torch.uint8 else rows.float()


def _attend_chunk(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, c: _CpuChunk, n_rows: int, tiles_per_split: int
) -> torch.Tensor:
    # q, k_rows, v_rows: [rows, D] views of q and the caches -> [E, H_kv, R, D] fp32 for the chunk's entries
    head_dim = k_rows.shape[1]
    e, t = c.num_entries, c.num_tiles
    num_kv_heads = c.kv_rows.shape[0] // (e * t * TILE)
    q_items = q.index_select(0, c.q_rows).view(-1, n_rows, head_dim)
    k = _cache_floats(k_rows.index_select(0, c.kv_rows)).view(-1, TILE, head_dim)
    v = _cache_floats(v_rows.index_select(0, c.kv_rows))
    if c.v_zero is not None:
        v.index_fill_(0, c.v_zero, 0.0)
    s = _bmm(q_items, k.transpose(1, 2)).view(e, t, num_kv_heads, n_rows, TILE)
    s.masked_fill_(c.masked, float("-inf"))

    # m: the running max up to each tile, from the first tile of its split; base: m with -inf (a row that has seen
    # nothing) read as 0. alpha rescales the sums of the tiles before, whose max is m_prev (-inf at a split's first
    # tile, where nothing comes before). Where m_prev == m, alpha = exp(0) = 1; where both are -inf, alpha = 0
    # multiplies sums that are still exactly zero: either way the bits of "alpha = 1 where m did not move".
    m = s.amax(-1)  # [E, T, H, R]
    if t > 1:
        m_prev = torch.full_like(m, float("-inf"))
        for lo in range(0, t, tiles_per_split):
            hi = min(lo + tiles_per_split, t)
            m[:, lo:hi] = torch.cummax(m[:, lo:hi], dim=1).values
            m_prev[:, lo + 1 : hi] = m[:, lo : hi - 1]
    base = torch.nan_to_num(m, nan=math.nan, posinf=math.inf, neginf=0.0)
    p = s.sub_(base[..., None]).exp_()
    den = p.sum(-1)  # [E, T, H, R]
    acc = _bmm(p.view(-1, n_rows, TILE), v.view(-1, TILE, head_dim)).view(e, t, num_kv_heads, n_rows, head_dim)
    # Every real row sees its own position: den >= 1. Padding rows (den = 0) come out NaN and are never read.
    if t == 1:
        return acc[:, 0] / den[:, 0, ..., None]
    alpha = torch.exp(m_prev - base)

    # den and acc rescaled tile by tile within each split, all splits at once: [E, splits, tiles, ...]. Tiles
    # past the end pad the last split with alpha = 1 and zero sums, which leave den and acc as they are.
    num_splits = -(-t // tiles_per_split)
    width = t if num_splits == 1 else tiles_per_split
    pad = num_splits * width - t
    if pad:
        alpha = torch.cat([alpha, alpha.new_ones((e, pad, *alpha.shape[2:]))], 1)
        den = torch.cat([den, den.new_zeros((e, pad, *den.shape[2:]))], 1)
        acc = torch.cat([acc, acc.new_zeros((e, pad, *acc.shape[2:]))], 1)
    alpha = alpha.view(e, num_splits, width, num_kv_heads, n_rows)
    den = den.view(e, num_splits, width, num_kv_heads, n_rows)
    acc = acc.view(e, num_splits, width, num_kv_heads, n_rows, head_dim)
    # A split's first tile starts from den = acc = 0: 0 * alpha + x is x (up to the sign of a zero).
    den_s, acc_s = den[:, :, 0], acc[:, :, 0]
    for j in range(1, width):
        den_s = den_s * alpha[:, :, j] + den[:, :, j]
        acc_s = acc_s * alpha[:, :, j, ..., None] + acc[:, :, j]

    # Merge the splits in order; from the empty state the first merge would give split 0 itself.
    den_run, acc_run = den_s[:, 0], acc_s[:, 0]
    if num_splits > 1:
        last = torch.tensor([min(lo + tiles_per_split, t) - 1 for lo in range(0, t, tiles_per_split)])
        m_s = m.index_select(1, last)  # [E, splits, H, R]: each split's max
        run = m_s[:, 0], den_run, acc_run
        for i in range(1, num_splits):
            run = _merge_cpu(run, (m_s[:, i], den_s[:, i], acc_s[:, i]))
        _, den_run, acc_run = run
    return acc_run / den_run[..., None]


def _paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    split: int = SPLIT,
    rows_per_entry: int = _CPU_ROWS,
    plan: CpuAttentionPlan | None = None,
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if num_tokens == 0:
        return torch.empty_like(q)
    if plan is None:
        plan = cpu_attention_plan(
            block_tables, seq_lens, query_start_loc, k_cache.shape, num_q_heads, rows_per_entry=rows_per_entry
        )
    elif plan.key != (k_cache.shape[1], num_kv_heads, head_dim, group) or plan.rows_per_entry != rows_per_entry:
        raise ValueError(f"the plan was made for other caches or heads: {plan.key}")
    q_rows = (q.float() * scale).view(-1, head_dim)  # row token * H_q + head, pre-scaled
    k_rows = _bytes(k_cache).view(-1, head_dim)  # row slot * H_kv + kv head
    v_rows = _bytes(v_cache).view(-1, head_dim)
    n_rows = rows_per_entry * group
    with intra_op_threads(1 if plan.bmm_entries < _CPU_SERIAL_ENTRIES else None):
        outs = [_attend_chunk(q_rows, k_rows, v_rows, c, n_rows, split // TILE) for c in plan.chunks]
    o = outs[0] if len(outs) == 1 else torch.cat(outs)  # [E, H_kv, R, D]
    out = o.view(-1, head_dim).index_select(0, plan.out_rows).view(q.shape)
    return out.add_(0.0).to(q.dtype)  # + 0.0 turns -0.0 into +0.0 (see the module docstring)


# ------------------------------------------------------------------------------------------------ wrapper


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    plan: CpuAttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of a varlen batch of query tokens over the paged KV cache, batch-invariant.

    ``q: [num_tokens, num_q_heads, head_dim]``, the new tokens of all sequences concatenated;
    ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]`` (contiguous; this step's K/V already
    written by ``write_kv``); ``block_tables: [num_seqs, max_blocks_per_seq]`` int32; ``seq_lens: [num_seqs]``
    context lengths including the new tokens; ``query_start_loc: [num_seqs + 1]`` int32 cumulative query
    counts (every q_len at least 1). The j-th of a sequence's q_len new tokens sits at position
    seq_len - q_len + j and attends to positions 0 .. that position. num_q_heads must be a multiple of
    num_kv_heads (GQA: query head h reads KV head h // group). Returns ``[num_tokens, num_q_heads, head_dim]``
    in q's dtype.

    ``plan`` (CPU only): ``cpu_attention_plan`` of the same batch, which every layer of a step can share; made
    here when None.
    """
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,) or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"{num_seqs} block tables, seq_lens {tuple(seq_lens.shape)}, query_start_loc {tuple(query_start_loc.shape)}"
        )
    kv_ok = k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, FP8_KV)
    if q.dtype not in FLOATS or not kv_ok:
        raise TypeError(
            f"expected caches of q's dtype or float8_e4m3fn, got q {q.dtype}, caches {k_cache.dtype}, {v_cache.dtype}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()
    if q.is_cuda:
        return _paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
    return _paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, plan=plan)
