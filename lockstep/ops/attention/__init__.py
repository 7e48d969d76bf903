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

The package, in the order a step uses it: ``tiling`` (TILE, SPLIT: the reduction order every path follows),
``kv_cache`` (``write_kv`` and the FP8 cache's rounding), ``kernel`` (the Triton kernels), ``gluon_prefill`` (the
prefill walk in Gluon on Hopper, warp-specialized, the same bits; the default there), ``launch`` (how a CUDA batch
is cut into programs: launch shapes only, never the math), ``cpu`` (the CPU plan and path); this file holds
``paged_attention``, the one entry point that checks its arguments and picks the device's path.
"""

import torch

from lockstep.ops._common import FLOATS
from lockstep.ops.attention.cpu import CpuAttentionPlan, _paged_attention_cpu, cpu_attention_plan
from lockstep.ops.attention.kv_cache import FP8_KV, cache_values, check_kv, to_cache, write_kv
from lockstep.ops.attention.launch import _paged_attention_triton
from lockstep.ops.attention.tiling import SPLIT, TILE

__all__ = [
    "FP8_KV", "SPLIT", "TILE", "CpuAttentionPlan", "cache_values", "check_kv", "cpu_attention_plan",
    "paged_attention", "to_cache", "write_kv",
]  # fmt: skip


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
