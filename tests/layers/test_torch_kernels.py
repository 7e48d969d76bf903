"""The default kernel set's paged attention (``torch_paged_attention``): values against an fp64 reference on
mixed batches of decodes, whole prefills and mid-sequence chunks, and the batching that makes it a fair
baseline (one SDPA call for all decodes, one per group of same-shape chunks)."""

import functools

import pytest
import torch

from lockstep.layers import torch_kernels
from lockstep.layers.batch import HOST_MAX_QUERY_LEN, HOST_SEQ_LENS, AttentionMetadata, FlatBatch
from lockstep.layers.torch_kernels import batch_split_attention, sdpa_groups, split_for_batch, torch_paged_attention
from lockstep.ops.attention import SPLIT, fa4
from lockstep.ops.attention.launch import _paged_attention_triton

SCALE = 0.17


def make_batch(items, hq, hkv, d, page, dtype, seed=0):
    """items: (cache_len, q_len) per sequence; its queries are positions [cache_len - q_len, cache_len).

    Blocks are handed out shuffled, table padding is -1 and unwritten slots hold NaN, so reading a slot that
    is not the sequence's shows up. Returns (q, k_cache, v_cache, attn, per-sequence (q, k, v)).
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // page) for n, _ in items) + 3
    k_cache = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // page) for n, _ in items) + 1
    tables = torch.full((len(items), width), -1, dtype=torch.int32)
    seqs, qs = [], []
    for i, (n, q_len) in enumerate(items):
        q = torch.randn(q_len, hq, d, generator=gen).to(dtype)
        k = torch.randn(n, hkv, d, generator=gen).to(dtype)
        v = torch.randn(n, hkv, d, generator=gen).to(dtype)
        blocks = [free.pop() for _ in range(-(-n // page))]
        tables[i, : len(blocks)] = torch.tensor(blocks)
        for p in range(n):
            k_cache[blocks[p // page], p % page] = k[p]
            v_cache[blocks[p // page], p % page] = v[p]
        seqs.append((q, k, v))
        qs.append(q)
    starts = torch.tensor([0] + [q_len for _, q_len in items]).cumsum(0).to(torch.int32)
    attn = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor([n for n, _ in items], dtype=torch.int32),
        query_start_loc=starts,
        kv_caches=[(k_cache, v_cache)],
        scratch={HOST_SEQ_LENS: [n for n, _ in items]},  # as an eager step's metadata has them (FlatBatch.to)
    )
    return torch.cat(qs), k_cache, v_cache, attn, seqs


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp64 causal GQA attention of the last ``len(q)`` positions over K/V ``[0, len(k))``."""
    n, q_len = k.shape[0], q.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    s = s.masked_fill(torch.arange(n) > torch.arange(n - q_len, n)[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


# (cache_len, q_len): decodes of several lengths (one sequence of one token), a whole prefill, two chunks of one
# shape that share a call, a chunk starting mid-sequence, a sequence with no new tokens, and decodes placed
# after the chunks so the decode rows are not contiguous.
MIXED = [(37, 1), (1, 1), (130, 1), (23, 23), (40, 9), (40, 9), (64, 17), (12, 0), (5, 1), (17, 1)]


@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 32), (3, 3, 64), (6, 1, 16)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixed_batch_matches_fp64_reference(page, hq, hkv, d, dtype):
    q, k_cache, v_cache, attn, seqs = make_batch(MIXED, hq, hkv, d, page, dtype)
    out = torch_paged_attention(q, k_cache, v_cache, attn, SCALE)
    assert out.shape == q.shape and out.dtype == dtype
    atol = 2e-6 if dtype == torch.float32 else 2e-2
    for got, (qi, ki, vi) in zip(out.split([n for _, n in MIXED]), seqs, strict=True):
        torch.testing.assert_close(got.double(), reference(qi, ki, vi), atol=atol, rtol=0)


@pytest.mark.parametrize("items", [[(37, 1), (130, 1), (5, 1)], [(40, 9)], [(23, 23), (23, 23)]])
def test_one_group_batches(items):
    # One group holding every token returns SDPA's output without a copy into a fresh tensor.
    q, k_cache, v_cache, attn, seqs = make_batch(items, 4, 2, 32, 4, torch.float32)
    out = torch_paged_attention(q, k_cache, v_cache, attn, SCALE)
    for got, (qi, ki, vi) in zip(out.split([n for _, n in items]), seqs, strict=True):
        torch.testing.assert_close(got.double(), reference(qi, ki, vi), atol=2e-6, rtol=0)


def test_decodes_share_one_call_and_chunks_group_by_shape():
    _, k_cache, _, attn, _ = make_batch(MIXED, 4, 2, 32, 4, torch.float32)
    groups = sdpa_groups(attn, k_cache)
    assert [(g.num_seqs, g.q_len, g.kv_len) for g in groups] == [(5, 1, 130), (1, 23, 23), (2, 9, 40), (1, 17, 64)]
    assert groups[0].key_mask is not None and groups[1].key_mask is None
    assert sdpa_groups(attn, k_cache) is groups  # built once per step, shared by every layer


def test_groups_split_at_the_gather_cap(monkeypatch):
    # 150 key positions of 2 KV heads x 32 fp32 values, for K and V.
    monkeypatch.setitem(torch_kernels.MAX_GATHER_BYTES, "cpu", 150 * 2 * 2 * 32 * 4)
    q, k_cache, v_cache, attn, seqs = make_batch(MIXED, 4, 2, 32, 4, torch.float32)
    groups = sdpa_groups(attn, k_cache)
    # Decodes of 37, 1, 130, 5, 17 keys: 2 x 37, then 130 alone (over the cap by itself), then 2 x 17.
    assert [(g.num_seqs, g.q_len, g.kv_len) for g in groups] == [
        (2, 1, 37), (1, 1, 130), (2, 1, 17), (1, 23, 23), (2, 9, 40), (1, 17, 64)
    ]  # fmt: skip
    out = torch_paged_attention(q, k_cache, v_cache, attn, SCALE)
    for got, (qi, ki, vi) in zip(out.split([n for _, n in MIXED]), seqs, strict=True):
        torch.testing.assert_close(got.double(), reference(qi, ki, vi), atol=2e-6, rtol=0)


def test_empty_batch():
    q, k_cache, v_cache, attn, _ = make_batch([(9, 0)], 4, 2, 32, 4, torch.float32)
    assert torch_paged_attention(q, k_cache, v_cache, attn, SCALE).shape == (0, 4, 32)


def test_gradients_match_fp64_reference():
    # The RL trainer differentiates the default kernels as they are (lockstep.rl.policy), through q and the cache.
    items = [(19, 1), (11, 11), (30, 6), (7, 1)]
    q, k_cache, v_cache, attn, seqs = make_batch(items, 4, 2, 16, 4, torch.float32)
    k_cache, v_cache = k_cache.nan_to_num(0.0).requires_grad_(), v_cache.nan_to_num(0.0).requires_grad_()
    q.requires_grad_()
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    (torch_paged_attention(q, k_cache, v_cache, attn, SCALE) * weight).sum().backward()

    q64 = q.detach().double().requires_grad_()
    k64 = k_cache.detach().double().requires_grad_()
    v64 = v_cache.detach().double().requires_grad_()
    total = 0.0
    for i, (n, q_len) in enumerate(items):
        q0 = int(attn.query_start_loc[i])
        blocks = attn.block_tables[i, : -(-n // 4)].long()
        ki, vi = k64[blocks].flatten(0, 1)[:n], v64[blocks].flatten(0, 1)[:n]
        total = total + (reference(q64[q0 : q0 + q_len], ki, vi) * weight[q0 : q0 + q_len]).sum()
    total.backward()
    for ours, ref in [(q.grad, q64.grad), (k_cache.grad, k64.grad), (v_cache.grad, v64.grad)]:
        torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=0)


# --- the default set's CUDA attention (lockstep's paged kernel, split size from the batch), via the interpreter


@pytest.mark.parametrize("num_sms", [1, 132])
def test_batch_split_attention_matches_fp64_reference(num_sms):
    q, k_cache, v_cache, attn, seqs = make_batch(MIXED, 4, 2, 32, 4, torch.float32)
    out = batch_split_attention(q, k_cache, v_cache, attn, SCALE, num_sms)
    for got, (qi, ki, vi) in zip(out.split([n for _, n in MIXED]), seqs, strict=True):
        torch.testing.assert_close(got.double(), reference(qi, ki, vi), atol=2e-6, rtol=0)


def test_batch_split_attention_leaves_prefill_steps_the_default_split():
    # Only decode steps take a split from the batch: a step with a prefill launches the kernel as the invariant
    # set does (no kernel variant per sequence count to compile while serving).
    q, k_cache, v_cache, attn, _ = make_batch(MIXED, 4, 2, 32, 4, torch.float32)
    default = _paged_attention_triton(
        q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, SCALE
    )
    assert torch.equal(batch_split_attention(q, k_cache, v_cache, attn, SCALE, num_sms=132), default)


def test_split_size_follows_the_work_from_the_invariant_split_up():
    slots = torch_kernels.FILL_WAVES * torch_kernels.RESIDENT_PER_SM * 132
    for lens in ([1], [8192] * 16, [1024] * 256, [4096] * 256, [32768] + [1024] * 255, [32768] * 64, [40960] * 256):
        split = split_for_batch(lens, 8, 132)
        assert split >= SPLIT and split % SPLIT == 0 and (split // SPLIT) & (split // SPLIT - 1) == 0
        assert split <= torch_kernels.MAX_FAST_SPLIT
        if split > SPLIT:  # a larger split only where every resident program still walks FILL_WAVES splits
            assert 8 * sum(lens) >= slots * split
        if split < torch_kernels.MAX_FAST_SPLIT:  # ... and the largest such
            assert 8 * sum(lens) < slots * 2 * split
    sizes = [split_for_batch([4096] * n, 8, 132) for n in (1, 2, 16, 64, 128, 256)]
    assert sizes == sorted(sizes) and sizes[0] == SPLIT < sizes[-1]  # more work, larger splits
    # Issue 27's case: 16 rows of 8k on an H200 (132 SMs). The old rule took splits of 16,384 from a CUDA graph's
    # 40,960-position table (128 programs); a graph now takes SPLIT, an eager step the same from its lengths.
    assert split_for_batch(None, 8, 132) == split_for_batch([8192] * 16, 8, 132) == SPLIT
    # One long row among short ones: the bound counts the whole batch's positions, not the longest row times the
    # batch (that would give the long row four splits of 8,192, each walked by one program after the rest).
    assert split_for_batch([32768] + [1024] * 255, 8, 132) == 2 * SPLIT


# Decode batches of odd lengths (contexts 1 .. 4,500, each batch with a row of several splits) on which the rule, at
# FILL_WAVES 1 and the given SM count, picks each of its split sizes: 512 (the invariant split), 1024, 2048, 4096.
# The kernel runs through the interpreter.
RULE_CASES = [
    (64, [1, 17, 127, 1000, 1100], SPLIT),
    (2, [1, 17, 127, 1000, 1100], 2 * SPLIT),
    (1, [1, 17, 127, 1000, 2100], 4 * SPLIT),
    (1, [4500, 1, 17, 127], 8 * SPLIT),
]


@pytest.mark.parametrize("num_sms, lens, split", RULE_CASES)
def test_batch_split_attention_matches_fp64_reference_at_the_rules_splits(monkeypatch, num_sms, lens, split):
    monkeypatch.setattr(torch_kernels, "FILL_WAVES", 1)
    monkeypatch.setattr(torch_kernels, "WHOLE_ROWS_PER_SM", 10**9)  # the split rule, not the whole-rows one
    assert split_for_batch(lens, 2, num_sms) == split
    q, k_cache, v_cache, attn, seqs = make_batch([(n, 1) for n in lens], 4, 2, 32, 16, torch.float32)
    out = batch_split_attention(q, k_cache, v_cache, attn, SCALE, num_sms)
    for got, (qi, ki, vi) in zip(out.split(1), seqs, strict=True):
        torch.testing.assert_close(got.double(), reference(qi, ki, vi), atol=2e-6, rtol=0)
    # The launch the rule chose, and a CUDA graph's (no host lengths: the invariant split).
    chosen = _paged_attention_triton(
        q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, SCALE, split=split
    )
    assert torch.equal(out, chosen)
    attn.scratch.clear()
    graph = batch_split_attention(q, k_cache, v_cache, attn, SCALE, num_sms)
    invariant = _paged_attention_triton(
        q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, SCALE
    )
    assert torch.equal(graph, invariant)
    if max(lens) > split:  # a row with several splits merges them differently at another split size
        assert not torch.equal(out, invariant) or split == SPLIT


def test_batch_split_attention_takes_whole_rows_once_the_batch_fills_the_gpu():
    # 5 rows x 2 KV heads = 10 programs on a 3-SM "GPU" (WHOLE_ROWS_PER_SM 3): no split in a graph's step (the
    # table's width, rounded up to a power of two of tiles), MAX_FAST_SPLIT in an eager one; values against fp64.
    lens = [1, 17, 127, 1000, 2100]
    q, k_cache, v_cache, attn, seqs = make_batch([(n, 1) for n in lens], 4, 2, 32, 16, torch.float32)
    eager = batch_split_attention(q, k_cache, v_cache, attn, SCALE, num_sms=3)
    args = (q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, SCALE)
    assert torch.equal(eager, _paged_attention_triton(*args, split=torch_kernels.MAX_FAST_SPLIT))
    attn.scratch.clear()
    graph = batch_split_attention(q, k_cache, v_cache, attn, SCALE, num_sms=3)
    assert torch.equal(graph, _paged_attention_triton(*args, split=4096))  # 133 blocks of 16: 34 tiles, up to 64
    for out in (eager, graph):
        for got, (qi, ki, vi) in zip(out.split(1), seqs, strict=True):
            torch.testing.assert_close(got.double(), reference(qi, ki, vi), atol=2e-6, rtol=0)
    assert not torch.equal(graph, batch_split_attention(q, k_cache, v_cache, attn, SCALE, num_sms=4))  # 10 < 12


def test_batch_split_attention_bits_follow_the_batch(monkeypatch):
    # Negative control for this set: a long decode alone (splits of 512) and the same decode among 7 others (more
    # work: splits of 1,024) merge its softmax partials differently.
    monkeypatch.setattr(torch_kernels, "FILL_WAVES", 1)
    items = [(1100, 1)] + [(1000, 1)] * 7
    q, k_cache, v_cache, attn, _ = make_batch(items, 4, 2, 32, 16, torch.float32)
    assert split_for_batch([1100], 2, 4) == SPLIT and split_for_batch([n for n, _ in items], 2, 4) == 2 * SPLIT
    batched = batch_split_attention(q, k_cache, v_cache, attn, SCALE, num_sms=4)[0]
    alone_attn = AttentionMetadata(
        slot_mapping=attn.slot_mapping, block_tables=attn.block_tables[:1], seq_lens=attn.seq_lens[:1],
        query_start_loc=attn.query_start_loc[:2], kv_caches=attn.kv_caches, scratch={HOST_SEQ_LENS: [1100]},
    )  # fmt: skip
    alone = batch_split_attention(q[:1], k_cache, v_cache, alone_attn, SCALE, num_sms=4)[0]
    torch.testing.assert_close(alone, batched, atol=1e-5, rtol=0)
    assert not torch.equal(alone, batched)


def test_host_lengths_reach_eager_steps_only():
    # The rule reads the lengths an eager step's metadata carries; a CUDA graph's (one graph for every context up
    # to max_model_len) has none, so its decode takes the invariant split whatever it was captured with.
    from lockstep.engine.cuda_graph import DecodeGraphs
    from lockstep.layers.batch import flatten_batch

    flat = flatten_batch([([5], 40, list(range(11))), ([7], 3, [11])], block_size=4)
    _, _, attn = flat.to("cpu", [])
    assert attn.scratch[HOST_SEQ_LENS] == flat.seq_lens == [41, 4]

    class Model:  # what DecodeGraphs needs of a model: a device, and a forward that shows its metadata
        device = torch.device("cpu")

        def __call__(self, input_ids, positions, attn):
            return attn

    graph_attn = DecodeGraphs(Model(), [], max_num_seqs=4, max_blocks=16)._forward(4)
    assert HOST_SEQ_LENS not in graph_attn.scratch
    assert split_for_batch(graph_attn.scratch.get(HOST_SEQ_LENS), 8, 132) == SPLIT


# The fast set's FlashAttention-4 route (``ops.attention.fa4``, ``torch_kernels.takes_fa4``) without FA4: the CPU
# machines cannot import it, so a stand-in with FA4's documented varlen semantics (``cu_seqlens_q`` per sequence,
# ``seqused_k`` keys read through ``page_table``, the causal mask aligned to the bottom right) checks that lockstep's
# arguments mean what lockstep's own attention means, and which steps take the route. The real kernel's values and
# bits are checked on the H200 (``bench/fa4_probe.py``).


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
