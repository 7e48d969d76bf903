"""The device block tables: every step's gathered table equals the one built from the lists, through appends,
free and reallocation, rows running out, and sequences coming and going in any order."""

import random

import pytest
import torch

from lockstep.engine.block_tables import DeviceBlockTables
from lockstep.engine.sequence import Sequence


def check(tables: DeviceBlockTables, seqs: list[Sequence], width: int) -> None:
    picks = tables.apply(tables.plan(seqs))
    got = tables.gather(picks, width)
    for i, s in enumerate(seqs):
        n = min(width, len(s.block_table))
        assert got[i, :n].tolist() == s.block_table[:n], f"row of {s.request_id}"


def test_rows_follow_appends_and_replaced_tables():
    tables = DeviceBlockTables(num_rows=4, max_blocks=8, device=torch.device("cpu"))
    a, b = Sequence("a", [1]), Sequence("b", [2])
    a.block_table, b.block_table = [5, 6], [7]
    check(tables, [a, b], 8)
    a.block_table.append(9)  # decode growth: only the new entry is sent
    check(tables, [b, a], 8)
    a.block_table = [3]  # freed and allocated again: a new list, rewritten whole
    check(tables, [a], 8)
    assert tables.gather(tables.apply(tables.plan([a])), 2)[0].tolist()[0] == 3


def test_random_traffic_with_few_rows_matches_the_lists():
    rng = random.Random(0)
    tables = DeviceBlockTables(num_rows=6, max_blocks=12, device=torch.device("cpu"))

    def arrive(name: str) -> Sequence:
        seq = Sequence(name, [0])
        seq.block_table = [rng.randrange(100) for _ in range(rng.randint(1, 4))]
        return seq

    live = [arrive(f"s{i}") for i in range(10)]
    for step in range(300):
        if rng.random() < 0.1:  # a sequence finishes, a new one arrives
            live[rng.randrange(len(live))] = arrive(f"n{step}")
        batch = rng.sample(live, rng.randint(1, 6))  # never more sequences than rows
        for seq in batch:
            r = rng.random()
            if r < 0.3 and len(seq.block_table) < 12:
                seq.block_table.append(rng.randrange(100))  # decode growth
            elif r < 0.35:  # preempted and allocated again
                seq.block_table = [rng.randrange(100) for _ in range(rng.randint(1, 12))]
        check(tables, batch, 12)


def test_finished_sequences_are_let_go_at_the_next_step():
    import gc
    import weakref

    from lockstep.engine.sequence import SequenceStatus

    tables = DeviceBlockTables(num_rows=8, max_blocks=4, device=torch.device("cpu"))
    seqs = [Sequence(str(i), [1]) for i in range(4)]
    for s in seqs:
        s.block_table = [0]
    check(tables, seqs, 4)
    finished, preempted = seqs[0], seqs[1]
    finished.status = SequenceStatus.FINISHED
    gone = weakref.ref(finished)
    del seqs[0], finished
    check(tables, seqs[1:], 4)  # the preempted one (not in this step) keeps its row ...
    gc.collect()
    assert gone() is None  # ... the finished one is no longer held
    assert preempted in [row.seq for row in tables._rows if row is not None]
    check(tables, seqs, 4)


def test_harness_sees_a_stale_row():
    # Negative control: an in-place change that is not an append is exactly what the tables cannot see.
    tables = DeviceBlockTables(num_rows=2, max_blocks=4, device=torch.device("cpu"))
    a = Sequence("a", [1])
    a.block_table = [1, 2]
    check(tables, [a], 4)
    a.block_table[0] = 3
    with pytest.raises(AssertionError):
        check(tables, [a], 4)


def test_too_many_sequences_or_blocks_raise():
    tables = DeviceBlockTables(num_rows=2, max_blocks=2, device=torch.device("cpu"))
    seqs = [Sequence(str(i), [1]) for i in range(3)]
    for s in seqs:
        s.block_table = [0]
    with pytest.raises(ValueError, match="3 sequences"):
        tables.plan(seqs)
    seqs[0].block_table = [0, 1, 2]
    with pytest.raises(ValueError, match="holds 3 blocks"):
        tables.plan(seqs[:1])
