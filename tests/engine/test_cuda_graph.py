"""What CUDA-graph decode relies on, run on the CPU: the buckets, the padded static buffers through the whole model,
and the attention kernel (Triton's interpreter) over a graph-wide block table with padding rows."""

import pytest
import torch

from lockstep.engine.cuda_graph import MAX_VERIFY_ROWS, DecodeGraphs, graph_batch_sizes, graph_rows
from lockstep.layers.batch import flatten_batch
from lockstep.models.loader import load_model
from lockstep.ops.attention.launch import _paged_attention_triton


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 17, 64, 100, 256])
def test_every_batch_has_the_smallest_fitting_bucket(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs
    assert sizes[:-1] == [s for s in (1, 2, 4, 8, *range(16, 65, 8), *range(80, 257, 16)) if s < max_num_seqs]
    for n in range(1, max_num_seqs + 1):
        bucket = next(s for s in sizes if s >= n)
        # Padding stays small: at most 2x at the small end, at most 16 rows beyond 64.
        assert bucket - n < max(n, 16)


def test_speculation_sizes_the_buckets_for_its_verify_rows():
    assert graph_rows(64, 0, 8192) == 64  # no drafter: one row a sequence
    assert graph_rows(16, 7, 8192) == 128  # 16 sequences with 7 drafts each
    assert graph_rows(64, 3, 8192) == 256
    assert graph_rows(256, 3, 8192) == MAX_VERIFY_ROWS == 512  # capped
    assert graph_rows(64, 7, 300) == 300  # never past the step's token budget
    assert graph_rows(600, 3, 8192) == 600  # never below max_num_seqs


def test_padded_buckets_give_every_real_row_its_eager_bits(tiny_model_dir):
    model = load_model(tiny_model_dir)  # fp32, the invariant kernel set
    block_size, num_blocks = 4, 64
    kv_caches = model.allocate_kv_cache(num_blocks, block_size)
    prompts = [[(7 * i + j) % 90 + 3 for j in range(n)] for i, n in enumerate([5, 13, 2, 9, 21])]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]  # room for 32 positions each
    model(*flatten_batch(zip(prompts, [0] * 5, tables, strict=True), block_size).to("cpu", kv_caches))
    graphs = DecodeGraphs(model, kv_caches, max_num_seqs=8, max_blocks=16)  # buckets 1, 2, 4, 8; never captured
    # Decode steps of 5, then 3 (rows 3-4 of the buffers hold the previous step's values), then 1 sequences.
    for step, seqs in enumerate([[0, 1, 2, 3, 4], [4, 0, 2], [1]]):
        chunks = [([(p + step) % 90 + 3], len(prompts[i]) + step, tables[i]) for i, p in enumerate(seqs)]
        flat = flatten_batch(chunks, block_size)
        eager = model(*flat.to("cpu", kv_caches))
        size = graphs.fill(flat, torch.tensor(flat.block_tables, dtype=torch.int32))
        assert size == {5: 8, 3: 4, 1: 1}[len(seqs)]
        padded = graphs._forward(size)
        assert torch.equal(padded[: len(seqs)], eager)
        assert (graphs.slot_mapping[len(seqs) : size] == -1).all()  # padding rows write no K/V


def test_attention_over_a_graph_wide_table_keeps_the_bits():
    # The graph's block table is as wide as max_model_len allows and padding rows (one position each) follow the
    # real ones: more split programs run, most exit at once; a real row's reduction order is unchanged.
    gen = torch.Generator().manual_seed(0)
    page, hkv, hq, d, split = 16, 2, 4, 32, 128
    lens = [300, 17, 129]
    num_blocks = 64
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[20 * i : 20 * i + -(-n // page)] for i, n in enumerate(lens)]
    q = torch.randn(len(lens), hq, d, generator=gen)
    narrow = torch.zeros(len(lens), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        narrow[i, : len(t)] = torch.tensor(t)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    eager = _paged_attention_triton(q, k_cache, v_cache, narrow, seq_lens, starts, 0.17, split=split)

    bucket, width = 8, 48  # 768 positions: 6 splits of 128
    wide = torch.full((bucket, width), 5, dtype=torch.int32)  # stale but valid block ids everywhere
    wide[: len(lens), : narrow.shape[1]] = narrow
    q_pad = torch.cat([q, torch.randn(bucket - len(lens), hq, d, generator=gen)])
    lens_pad = torch.cat([seq_lens, torch.ones(bucket - len(lens), dtype=torch.int32)])
    starts_pad = torch.arange(bucket + 1, dtype=torch.int32)
    for split_programs in (False, True):
        graph = _paged_attention_triton(
            q_pad, k_cache, v_cache, wide, lens_pad, starts_pad, 0.17, split=split, split_programs=split_programs
        )
        assert torch.equal(graph[: len(lens)], eager)
