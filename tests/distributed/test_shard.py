"""Which heads, rows and columns a tensor-parallel rank holds."""

import pytest
import torch

from lockstep.distributed import Shard, kv_head_range, split_evenly, vocab_range


def test_split_evenly():
    assert [split_evenly(12, 4, r, "x") for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    with pytest.raises(ValueError, match="x=10 cannot be split evenly over a tensor-parallel size of 4"):
        split_evenly(10, 4, 0, "x")


def test_kv_heads_split_or_replicated():
    # 32 query heads: 8 KV heads split over 4 ranks, replicated over 16; each rank's query heads read its KV heads.
    assert [kv_head_range(32, 8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [kv_head_range(32, 8, 16, r) for r in range(16)] == [(r // 2, r // 2 + 1) for r in range(16)]
    for rank in range(16):
        q0 = rank * 32 // 16
        assert kv_head_range(32, 8, 16, rank)[0] == q0 // (32 // 8)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        kv_head_range(6, 3, 2, 0)


def test_vocab_slices_cover_the_vocabulary_once():
    for vocab, size in [(97, 1), (97, 2), (97, 4), (97, 8), (151936, 8)]:
        parts = [vocab_range(vocab, size, r) for r in range(size)]
        assert all(rows == -(-vocab // size) for _, _, rows in parts)
        assert [i for start, stop, _ in parts for i in range(start, stop)] == list(range(vocab))


def test_shard_index():
    t = torch.arange(24).view(4, 6)
    assert torch.equal(t[Shard(1, 2, 5, 6).index()], t[:, 2:5])
    assert torch.equal(t[Shard(0, 1, 3, 4).index()], t[1:3])
    with pytest.raises(ValueError, match="invalid shard"):
        Shard(0, 3, 2, 4)
