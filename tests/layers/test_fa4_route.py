"""The fast set's FlashAttention-4 route (``ops.attention.fa4``, ``torch_kernels.takes_fa4``) without FA4: the CPU
machines cannot import it, so a stand-in with FA4's documented varlen semantics (``cu_seqlens_q`` per sequence,
``seqused_k`` keys read through ``page_table``, the causal mask aligned to the bottom right) checks that lockstep's
arguments mean what lockstep's own attention means, and which steps take the route. The real kernel's values and
bits are checked on the H200 (``bench/fa4_probe.py``)."""

import functools

import torch

from lockstep.layers import torch_kernels
from lockstep.layers.batch import HOST_MAX_QUERY_LEN, FlatBatch
from lockstep.ops.attention import fa4
from tests.layers.test_torch_kernels import MIXED, SCALE, make_batch, reference


def stand_in(q, k, v, *, cu_seqlens_q, max_seqlen_q, seqused_k, page_table, softmax_scale, causal, top_left=False):
    """FA4's ``flash_attn_varlen_func`` as its docstring describes it, in fp64; returns ``(out, lse)`` like FA4.
    ``top_left``: the causal mask aligned to the first key instead (the negative control)."""
    assert causal and page_table.dtype == torch.int32 and seqused_k.dtype == torch.int32
    out = torch.zeros(q.shape, dtype=torch.float64)
    page = k.shape[1]
    for i in range(len(seqused_k)):
        a, b, n = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seqused_k[i])
        assert b - a <= max_seqlen_q
        if a == b:
            continue
        pos = torch.arange(n)
        slots = page_table[i, pos // page].long()
        kk, vv = k[slots, pos % page].double(), v[slots, pos % page].double()
        group = q.shape[1] // k.shape[2]
        kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), kk) * softmax_scale
        last = pos[: b - a] if top_left else pos[n - (b - a) :]  # bottom right: row j sees keys <= n - (b - a) + j
        s = s.masked_fill(pos > last[:, None], float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    return out.to(q.dtype), None


def test_the_route_passes_lockstep_arguments_with_fa4_meaning(monkeypatch):
    monkeypatch.setattr(fa4, "_varlen_func", lambda: stand_in)
    q, k_cache, v_cache, attn, seqs = make_batch(MIXED, 8, 2, 32, 16, torch.float32)
    attn.block_tables.clamp_(min=0)  # the engine pads its tables with 0 (FlatBatch), a page FA4 may index
    starts = attn.query_start_loc.tolist()
    max_q = max(b - a for a, b in zip(starts, starts[1:], strict=False))
    out = fa4.paged_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, max_q,
                              SCALE)  # fmt: skip
    for (sq, k, v), a, b in zip(seqs, starts, starts[1:], strict=False):
        if a < b:
            torch.testing.assert_close(out[a:b].double(), reference(sq, k, v), atol=1e-5, rtol=1e-5)
    # negative control: a kernel aligning the mask to the top left gives other values on the mid-sequence chunks
    monkeypatch.setattr(fa4, "_varlen_func", lambda: functools.partial(stand_in, top_left=True))
    shifted = fa4.paged_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc,
                                  max_q, SCALE)  # fmt: skip
    assert not torch.allclose(shifted, out, atol=1e-3)


def test_only_eager_steps_with_a_prefill_chunk_take_the_route(monkeypatch):
    q, k_cache, v_cache, attn, _ = make_batch(MIXED, 8, 2, 32, 16, torch.bfloat16)
    assert not fa4.usable(q, k_cache)  # CPU tensors (and no FA4 here)
    monkeypatch.setattr(fa4, "usable", lambda q, k: True)
    flat = FlatBatch(input_ids=[1, 2, 3, 4], positions=[0, 1, 2, 7], slot_mapping=[0, 1, 2, 3], block_tables=[[0], [1]],
                     seq_lens=[3, 8], query_start_loc=[0, 3, 4])  # fmt: skip
    _, _, eager = flat.to("cpu", [(k_cache, v_cache)])
    assert eager.scratch[HOST_MAX_QUERY_LEN] == 3 and torch_kernels.takes_fa4(q, k_cache, eager)
    decode = FlatBatch(input_ids=[1, 2], positions=[2, 7], slot_mapping=[2, 3], block_tables=[[0], [1]],
                       seq_lens=[3, 8], query_start_loc=[0, 1, 2])  # fmt: skip
    assert not torch_kernels.takes_fa4(q, k_cache, decode.to("cpu", [(k_cache, v_cache)])[2])
    attn.scratch.pop(HOST_MAX_QUERY_LEN, None)  # a CUDA graph's metadata: no host lengths
    assert not torch_kernels.takes_fa4(q, k_cache, attn)


def test_usable_needs_the_package(monkeypatch):
    monkeypatch.setattr(fa4, "_varlen_func", lambda: None)
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    assert not fa4.usable(q, torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16))
