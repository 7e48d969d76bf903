"""FlashAttention-4 (the ``flash-attn-4`` package, CuTe DSL) as the fast kernel set's prefill attention on Hopper
and Blackwell, where it is installed: the attention other engines run, so that "invariant vs fast" compares against
it (issue 27, item 3). Never part of the invariant set.

Measured on the H200 (docs/perf.md, session 13; ``bench/fa4_probe.py``): its sm_90 forward reaches 558-657 TFLOP/s
on causal prefill (SDPA 484-593, lockstep's invariant kernel 253-295) straight over lockstep's paged cache (pages of
16 to 256 positions), but it has no split-KV on sm_90 (``num_splits > 1`` is refused), so a decode row is one
program per KV head: 0.3-0.4 TB/s at batch 1, against lockstep's 0.9-1.0. The fast set therefore takes it for steps
with a prefill chunk and keeps lockstep's kernel for decode steps. Its rows did not depend on the batch, the chunking
or the page layout either; it is still not the invariant set's kernel, whose reduction order (splits of ``SPLIT``)
the CPU path and the RL trainer share.
"""

import functools

import torch


@functools.cache
def _varlen_func():
    """``flash_attn.cute.interface.flash_attn_varlen_func``, or None where the package does not import."""
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except Exception:  # noqa: BLE001 - absent, or present without its CUDA libraries: either way not usable
        return None
    return flash_attn_varlen_func


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether FA4 can run this call: installed, a Hopper/Blackwell GPU, a bf16/fp16 cache (its sm_90 forward has
    no FP8), and a head size it compiles (a multiple of 8 up to 256)."""
    if not q.is_cuda or k_cache.dtype not in (torch.bfloat16, torch.float16) or q.dtype != k_cache.dtype:
        return False
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return False
    return _has_fa4(q.device.index if q.device.index is not None else torch.cuda.current_device())


@functools.cache
def _has_fa4(device_index: int) -> bool:
    """A Hopper or Blackwell GPU, and the package imports (asked once per device: every layer of a step asks)."""
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10) and _varlen_func() is not None


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a varlen batch over the paged cache, as ``ops.attention.paged_attention`` (the same
    arguments and meaning: sequence i's queries are its last ``query_start_loc[i+1] - query_start_loc[i]``
    positions of ``seq_lens[i]``), through FA4. FA4 aligns a causal mask to the bottom right, which is exactly that
    placement. ``max_query_len``: the longest sequence's query count, on the host (it sizes FA4's grid).
    ``q: [T, Hq, D]``, caches ``[blocks, page, Hkv, D]`` (FA4's own paged layout) -> ``[T, Hq, D]``."""
    out = _varlen_func()(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=query_start_loc,
        max_seqlen_q=max_query_len,
        seqused_k=seq_lens,
        page_table=block_tables,
        softmax_scale=scale,
        causal=True,
    )
    return out[0] if isinstance(out, tuple) else out
