import pytest

from lockstep.engine.block_manager import BlockManager, hash_block
from lockstep.engine.sequence import Sequence

BS = 4


def make_seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, block_size=BS)


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """Allocate and compute every pending token, as one full prefill would."""
    bm.allocate(seq)
    bm.mark_computed(seq, seq.num_pending_tokens)


def test_allocate_free_ref_counts():
    bm = BlockManager(8, BS)
    a = make_seq("a", list(range(10)))
    bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    assert a.num_blocks == 3 and a.last_block_num_tokens == 2
    assert [bm.blocks[i].ref_count for i in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert bm.num_free_blocks == 5
    bm.check_integrity([a])
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert bm.num_free_blocks == 8
    assert all(b.ref_count == 0 for b in bm.blocks)
    bm.check_integrity([])


def test_deterministic_ids():
    def run() -> list[list[int]]:
        bm = BlockManager(16, BS)
        seqs = [make_seq(str(i), [100 * i + j for j in range(3 + 5 * i)]) for i in range(4)]
        tables = []
        for s in seqs:
            prefill(bm, s)
            tables.append(list(s.block_table))
        bm.free(seqs[1])
        bm.free(seqs[0])
        late = make_seq("late", list(range(500, 520)))
        prefill(bm, late)
        tables.append(list(late.block_table))
        return tables

    first = run()
    assert first == run()
    assert first[0] == [0] and first[1] == [1, 2]


def test_prefix_reuse_full_blocks_only():
    bm = BlockManager(16, BS)
    prompt = list(range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    a = make_seq("a", prompt)
    prefill(bm, a)
    assert bm.blocks[a.block_table[0]].hash is not None
    assert bm.blocks[a.block_table[1]].hash is not None
    assert bm.blocks[a.block_table[2]].hash is None  # partial: never shared

    b = make_seq("b", prompt + [10, 11])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.check_integrity([a, b])

    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16
    bm.check_integrity([])


def test_no_hit_on_kv_not_yet_computed():
    bm = BlockManager(16, BS)
    a = make_seq("a", list(range(12)))
    bm.allocate(a)
    bm.mark_computed(a, 5)  # block 0 computed, block 1 half
    b = make_seq("b", list(range(12)))
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    bm.check_integrity([a, b])


def test_hash_chains_previous_blocks():
    bm = BlockManager(16, BS)
    a = make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(bm, a)
    b = make_seq("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])  # same second block, different first
    assert not bm._prefix_hits(b)
    assert hash_block(b"", [1, 2, 3, 4]) != hash_block(b"", [1, 2, 3, 5])
    assert hash_block(b"x", [5, 6, 7, 8]) != hash_block(b"y", [5, 6, 7, 8])
    assert hash_block(b"", [1, 2, 3, 4]) == hash_block(b"", [1, 2, 3, 4])


@pytest.mark.parametrize("n, cached", [(8, 4), (9, 8), (4, 0), (5, 4), (1, 0)])
def test_hit_never_covers_whole_prompt(n, cached):
    bm = BlockManager(16, BS)
    a = make_seq("a", list(range(20)))
    prefill(bm, a)
    b = make_seq("b", list(range(n)))
    bm.allocate(b)
    assert b.num_cached_tokens == cached
    assert b.num_pending_tokens >= 1
    bm.check_integrity([a, b])


def test_hashed_free_blocks_hit_until_reused():
    bm = BlockManager(4, BS)
    prompt = list(range(9))
    a = make_seq("a", prompt)
    prefill(bm, a)
    assert a.block_table == [0, 1, 2]
    bm.free(a)
    assert list(bm.free_block_ids) == [3, 2, 1, 0]  # last block first: head blocks stay cached longest

    b = make_seq("b", prompt)
    bm.allocate(b)  # hits blocks 0 and 1 while they sit on the free list
    assert b.block_table == [0, 1, 3] and b.num_cached_tokens == 8
    bm.check_integrity([b])
    bm.free(b)
    assert list(bm.free_block_ids) == [2, 3, 1, 0]

    d = make_seq("d", [50 + i for i in range(8)])
    prefill(bm, d)
    assert d.block_table == [2, 3]
    c = make_seq("c", prompt)
    assert bm._prefix_hits(c) == [0, 1]  # still findable

    e = make_seq("e", [90, 91, 92, 93])
    bm.allocate(e)
    assert e.block_table == [1]  # block 1's old contents are overwritten: its hash is gone
    assert bm._prefix_hits(c) == [0]
    bm.check_integrity([d, e])


def test_prefix_caching_off():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq("a", list(range(9)))
    prefill(bm, a)
    b = make_seq("b", list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert not bm.hash_to_block_id and all(blk.hash is None for blk in bm.blocks)
    bm.check_integrity([a, b])


def test_can_allocate_counts_free_hits():
    bm = BlockManager(3, BS)
    prompt = list(range(9))
    a = make_seq("a", prompt)
    prefill(bm, a)
    bm.free(a)
    other = make_seq("x", list(range(100, 112)))  # 3 blocks: fits only if nothing is in use
    assert bm.can_allocate(other)
    b = make_seq("b", prompt)
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert not bm.can_allocate(other)
    with pytest.raises(RuntimeError, match="needs 3 blocks"):
        bm.allocate(other)
    bm.check_integrity([b])


def test_decode_growth_and_hash_when_block_fills():
    bm = BlockManager(3, BS)
    s = make_seq("s", [1, 2, 3])
    prefill(bm, s)
    assert s.block_table == [0] and bm.blocks[0].hash is None
    s.append_token(4)
    assert bm.can_append(s)
    bm.append_slot(s)
    assert s.block_table == [0]  # slot 3 is still in block 0
    bm.mark_computed(s, 1)
    assert bm.blocks[0].hash == hash_block(b"", [1, 2, 3, 4])  # the block filled: now findable
    assert bm.hash_to_block_id[bm.blocks[0].hash] == 0
    s.append_token(5)
    bm.append_slot(s)
    assert s.block_table == [0, 1]
    bm.mark_computed(s, 1)
    bm.check_integrity([s])

    hog = make_seq("hog", [7, 7, 7])
    bm.allocate(hog)
    for t in (6, 7, 8):
        s.append_token(t)
        bm.append_slot(s)
        bm.mark_computed(s, 1)
    s.append_token(9)  # needs a 4th block; none left
    assert not bm.can_append(s)
    with pytest.raises(RuntimeError, match="no free block"):
        bm.append_slot(s)
    bm.free(hog)
    assert bm.can_append(s)
    bm.append_slot(s)
    bm.check_integrity([s])


def test_mark_computed_rejects_overrun():
    bm = BlockManager(4, BS)
    s = make_seq("s", [1, 2, 3])
    bm.allocate(s)
    with pytest.raises(RuntimeError, match="cannot advance"):
        bm.mark_computed(s, 4)


def test_reset_prefix_cache():
    bm = BlockManager(8, BS)
    a = make_seq("a", list(range(9)))
    prefill(bm, a)
    with pytest.raises(RuntimeError, match="in use"):
        bm.reset_prefix_cache()
    bm.free(a)
    bm.reset_prefix_cache()
    assert not bm._prefix_hits(make_seq("b", list(range(9))))
    bm.check_integrity([])


def test_duplicate_blocks_from_same_step():
    bm = BlockManager(8, BS)
    a, b = make_seq("a", list(range(9))), make_seq("b", list(range(9)))
    bm.allocate(a)
    bm.allocate(b)  # a's KV is not computed yet: no hits, b computes its own copy
    bm.mark_computed(a, 9)
    bm.mark_computed(b, 9)
    h0 = bm.blocks[a.block_table[0]].hash
    assert h0 == bm.blocks[b.block_table[0]].hash
    assert bm.hash_to_block_id[h0] == a.block_table[0]
    bm.check_integrity([a, b])
    bm.free(b)
    bm.free(a)
    bm.check_integrity([])


def _corrupt_cases():
    def ref_count(bm, seqs):
        bm.blocks[seqs[0].block_table[0]].ref_count += 1

    def used_on_free_list(bm, seqs):
        bm.free_block_ids.append(seqs[0].block_table[1])

    def leaked(bm, seqs):
        bm.free_block_ids.pop()

    def twice_free(bm, seqs):
        bm.free_block_ids.append(bm.free_block_ids[0])

    def map_points_elsewhere(bm, seqs):
        h = bm.blocks[seqs[0].block_table[0]].hash
        bm.hash_to_block_id[h] = seqs[0].block_table[1]

    def wrong_hash(bm, seqs):
        # Consistent with the map, but not with the tokens.
        block = bm.blocks[seqs[0].block_table[1]]
        del bm.hash_to_block_id[block.hash]
        block.hash = hash_block(b"", [9, 9, 9, 9])
        bm.hash_to_block_id[block.hash] = block.block_id

    def hashed_early(bm, seqs):
        bm.blocks[seqs[0].block_table[2]].hash = b"early"

    def table_twice(bm, seqs):
        seqs[0].block_table[2] = seqs[0].block_table[1]

    return [
        (ref_count, "ref_count 2 but 1 block table"),
        (used_on_free_list, "on the free list with ref_count 1"),
        (leaked, "not on the free list"),
        (twice_free, "on the free list twice"),
        (map_points_elsewhere, "maps to block"),
        (wrong_hash, "does not match its tokens"),
        (hashed_early, "hashed before its KV is computed"),
        (table_twice, "holds a block twice"),
    ]


@pytest.mark.parametrize("corrupt, message", _corrupt_cases(), ids=lambda c: getattr(c, "__name__", ""))
def test_integrity_catches_corruption(corrupt, message):
    bm = BlockManager(8, BS)
    a = make_seq("a", list(range(10)))
    prefill(bm, a)
    bm.check_integrity([a])  # control: the uncorrupted state passes
    corrupt(bm, [a])
    with pytest.raises(AssertionError, match=message):
        bm.check_integrity([a])
