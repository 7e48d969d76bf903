"""Short chunks in decode graphs (``cuda_graph.expand_rows``): a step whose sequences bring at most
``MAX_GRAPH_CHUNK`` tokens each (verify chunks, a draft model's new tokens, short prompts) runs as one-token rows,
and every row gets the bits the chunk gives it. Run on the CPU: the graph's buffers through the whole model
(``DecodeGraphs._forward``, what a capture records), and the Triton attention kernel under the interpreter."""

import torch

from lockstep.engine.cuda_graph import MAX_GRAPH_CHUNK, DecodeGraphs, expand_rows
from lockstep.layers.batch import flatten_batch
from lockstep.models.loader import load_model
from lockstep.ops.attention import _paged_attention_triton

BLOCK = 4


def test_expand_rows_gives_each_token_its_own_length_and_table() -> None:
    flat = flatten_batch([([5], 9, [0, 1, 2]), ([1, 2, 3], 4, [3, 4]), ([7, 8], 0, [5])], BLOCK)
    assert expand_rows(flat) == ([10, 5, 6, 7, 1, 2], [0, 1, 1, 1, 2, 2])


def test_can_run_takes_short_chunks_that_fit_a_bucket(tiny_model_dir) -> None:
    model = load_model(tiny_model_dir)
    graphs = DecodeGraphs(model, model.allocate_kv_cache(8, BLOCK), max_num_seqs=8, max_blocks=16)  # not captured
    chunk = lambda n, start=4: ([1] * n, start, [0, 1, 2, 3])
    assert graphs.can_run(flatten_batch([chunk(1)] * 8, BLOCK))  # a decode step
    assert graphs.can_run(flatten_batch([chunk(MAX_GRAPH_CHUNK)], BLOCK))
    assert graphs.can_run(flatten_batch([chunk(1), chunk(3), chunk(4, 0)], BLOCK))
    assert not graphs.can_run(flatten_batch([chunk(MAX_GRAPH_CHUNK + 1)], BLOCK))  # longer than a chunk may be
    assert not graphs.can_run(flatten_batch([chunk(5), chunk(4)], BLOCK))  # 9 rows, the largest bucket is 8


def test_short_chunks_in_the_graph_buffers_give_the_chunks_bits(tiny_model_dir) -> None:
    model = load_model(tiny_model_dir)  # fp32, the invariant kernel set
    kv_caches = model.allocate_kv_cache(64, BLOCK)
    prompts = [[(7 * i + j) % 90 + 3 for j in range(n)] for i, n in enumerate([5, 13, 2, 9])]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts) + 1)]  # room for 32 positions each
    model(*flatten_batch(zip(prompts, [0] * 4, tables[:4], strict=True), BLOCK).to("cpu", kv_caches))
    graphs = DecodeGraphs(model, kv_caches, max_num_seqs=32, max_blocks=16)
    # A decode row, verify-sized chunks of 4 and 8 (across block boundaries), 2 tokens, and a new 5-token prompt.
    new = [[11], [20, 21, 22, 23], [30, 31, 32, 33, 34, 35, 36, 37], [40, 41]]
    chunks = [(t, len(p), tables[i]) for i, (p, t) in enumerate(zip(prompts, new, strict=True))]
    chunks.append(([50, 51, 52, 53, 54], 0, tables[4]))
    flat = flatten_batch(chunks, BLOCK)
    saved = [(k.clone(), v.clone()) for k, v in kv_caches]

    def restore() -> None:
        for (k, v), (k0, v0) in zip(kv_caches, saved, strict=True):
            k.copy_(k0)
            v.copy_(v0)

    eager = model(*flat.to("cpu", kv_caches))  # [20 tokens, hidden]
    after_eager = [(k.clone(), v.clone()) for k, v in kv_caches]
    restore()
    size = graphs.fill(flat, torch.tensor(flat.block_tables, dtype=torch.int32))
    assert size == 24
    rows = graphs._forward(size)
    assert torch.equal(rows[: flat.num_tokens], eager)
    for (k, v), (k1, v1) in zip(kv_caches, after_eager, strict=True):  # the same K/V written
        assert torch.equal(k, k1) and torch.equal(v, v1)
    # Negative control: every row of a chunk attending over the whole chunk (its sequence's full length).
    restore()
    graphs.fill(flat, torch.tensor(flat.block_tables, dtype=torch.int32))
    full = [flat.seq_lens[o] for o in expand_rows(flat)[1]]
    graphs.seq_lens[: flat.num_tokens].copy_(torch.tensor(full, dtype=torch.int32))
    assert not torch.equal(graphs._forward(size)[: flat.num_tokens], eager)


def test_attention_kernel_gives_chunk_rows_their_bits_as_one_token_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    page, hkv, hq, d, split = 16, 2, 4, 32, 128
    lens, q_lens = [150, 17, 40, 8], [8, 1, 4, 8]  # the last is a prompt of 8
    num_blocks = 64
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), 12, dtype=torch.int32)
    for i, n in enumerate(lens):
        tables[i, : -(-n // page)] = torch.tensor(order[12 * i : 12 * i + -(-n // page)])
    n = sum(q_lens)
    q = torch.randn(n, hq, d, generator=gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    chunked = _paged_attention_triton(q, k_cache, v_cache, tables, seq_lens, starts, 0.17, split=split)
    row_lens, owners = [], []
    for i, (length, ql) in enumerate(zip(lens, q_lens, strict=True)):
        row_lens += range(length - ql + 1, length + 1)
        owners += [i] * ql
    bucket = 32  # padded like a graph's bucket: one position each, stale tables
    wide = torch.full((bucket, 48), 5, dtype=torch.int32)
    wide[:n, :12] = tables[owners]
    q_pad = torch.cat([q, torch.randn(bucket - n, hq, d, generator=gen)])
    lens_pad = torch.tensor(row_lens + [1] * (bucket - n), dtype=torch.int32)
    rows = _paged_attention_triton(
        q_pad, k_cache, v_cache, wide, lens_pad, torch.arange(bucket + 1, dtype=torch.int32), 0.17, split=split
    )
    assert torch.equal(rows[:n], chunked)
    # Negative control: each row attending over its whole sequence, the chunk's later positions included.
    full = torch.tensor([lens[o] for o in owners] + [1] * (bucket - n), dtype=torch.int32)
    rows = _paged_attention_triton(
        q_pad, k_cache, v_cache, wide, full, torch.arange(bucket + 1, dtype=torch.int32), 0.17, split=split
    )
    assert not torch.equal(rows[:n], chunked)
