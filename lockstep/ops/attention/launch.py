"""How ``paged_attention`` launches its kernels on CUDA: the grid, the split-program path or the in-register walk,
and the launch shapes (block sizes, warps, stages, column groups) chosen from the batch's shapes. Every choice
here changes the speed, never the bits (tests and bench/attention_check.py compare them)."""

import functools
import math
import os

import torch
import triton

from lockstep.ops._common import interpreting, num_sms, pdl_launch
from lockstep.ops.attention.kernel import _merge_splits_kernel, _paged_attention_kernel
from lockstep.ops.attention.kv_cache import FP8_KV
from lockstep.ops.attention.tiling import SPLIT, TILE

# Memory for the split-program path's partials, fp32 (acc, m, den) per (token, split, query head); above it the
# in-register path runs (a long prefill's partials would take gigabytes). A decode graph at batch 256 under
# Qwen3's 40,960-token max_model_len needs 340 MB.
_PART_CAP_BYTES = 1 << 29
GLUON_ENV = "LOCKSTEP_GLUON"
GLUON_TRITON = ("3.6.",)  # bench/attention_check.py on the H200


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


def _merge_heads(num_tokens: int, h_pad: int, num_sms: int) -> int:
    """Query heads per merge program (a power of two; the same bits for any count). A program per token with all its
    heads left a batch-1 decode step one program walking every split of the row in turn."""
    heads = h_pad
    while heads > 1 and num_tokens * (h_pad // heads) < 2 * num_sms:
        heads //= 2
    return heads


@functools.cache
def _gluon_device(device_index: int) -> bool:
    """A Hopper GPU, and a Triton release on which the Gluon kernel was checked against the Triton kernel's bits
    (``GLUON_TRITON``: each release compiles both anew), whose Gluon has the Hopper ops. Asked once per device."""
    if torch.cuda.get_device_capability(device_index)[0] != 9 or not triton.__version__.startswith(GLUON_TRITON):
        return False
    try:
        from lockstep.ops.attention import gluon_prefill  # noqa: F401
    except ImportError:
        return False
    return True


def _use_gluon(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decode: bool, split_programs: bool,
               block_m: int) -> bool:  # fmt: skip
    """Whether a prefill step's in-register walk runs as ``gluon_prefill`` (the same bits, 1.36-1.59x faster on the
    H200): on Hopper, at BLOCK_M 128, for the tensors ``gluon_prefill.unsupported`` accepts; LOCKSTEP_GLUON=0 turns
    it off."""
    if decode or split_programs or block_m != 128 or not q.is_cuda or interpreting():
        return False
    if os.environ.get(GLUON_ENV, "1") == "0":
        return False
    if not _gluon_device(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        return False
    from lockstep.ops.attention.gluon_prefill import unsupported

    return unsupported(q, k_cache, v_cache, TILE) is None


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
    merge_heads: int | None = None,
    merge_chunk: int = 4,
    gluon: bool | None = None,
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
    if gluon is None:
        gluon = _use_gluon(q, k_cache, v_cache, decode, split_programs, block_m)
    if gluon:
        from lockstep.ops.attention.gluon_prefill import gluon_prefill

        if split_programs or block_m != 128:
            raise ValueError("gluon runs the in-register walk at BLOCK_M 128 only")
        return gluon_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                             scale * math.log2(math.e), split=split, tile=TILE)  # fmt: skip
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
        h_pad = triton.next_power_of_2(num_q_heads)
        merge_heads = merge_heads or _merge_heads(num_tokens, h_pad, sms)
        if merge_chunk not in (1, 4, 8) or h_pad % merge_heads:
            raise ValueError(f"merge_chunk must be 1, 4 or 8 and merge_heads divide {h_pad}")
        _merge_splits_kernel[(num_tokens, h_pad // merge_heads)](
            part, part_ml, out, seq_lens, query_start_loc,
            num_seqs, search_steps, inline_splits,
            part.stride(0), part.stride(1), part.stride(2),
            part_ml.stride(0), part_ml.stride(1), part_ml.stride(2),
            out.stride(0), out.stride(1),
            NUM_HEADS=num_q_heads, HEADS=merge_heads, HEAD_DIM=head_dim, D_PAD=d_pad, SPLIT_SIZE=split,
            ONE_PER_SEQ=one_per_seq, CHUNK=merge_chunk, **pdl,
        )  # fmt: skip
    return out
