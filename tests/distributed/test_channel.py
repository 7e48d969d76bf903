"""The control channel between gloo processes: messages of any length arrive whole and in order (the buffer grows
past its capacity), objects and minimums too; and the engine's step message survives the trip bit for bit."""

import dataclasses

import torch
import torch.distributed as dist
from tp_spawn import run_ranks

from lockstep.distributed import ControlChannel, TPGroup
from lockstep.engine.block_tables import TableUpdate
from lockstep.engine.model_runner import STOP, ForwardStep
from lockstep.layers.batch import flatten_batch

# Lengths around a capacity of 8 (7 values after the length): empty, fits, exactly full, one over, far over, and
# small again after growing.
LENGTHS = [0, 3, 7, 8, 100, 5, 1000, 2]


def _messages() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(-(2**62), 2**62, (n,), generator=gen) for n in LENGTHS]


def _step() -> ForwardStep:
    chunks = [([5, 6, 7], 0, [3, 9]), ([8], 13, [1, 4, 2, 7]), ([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, [0, 5, 6, 10])]
    tables = TableUpdate(picks=[4, 0, 7], rows=[4, 4, 7], cols=[0, 1, 3], values=[3, 9, 10])
    return ForwardStep(flatten_batch(chunks, 4, tables=False), tables, [[2, 3], [0, 1, 2, 12]], use_graphs=True)


def _exchange(group: TPGroup) -> dict:
    channel = ControlChannel(group.rank, group.size, dist.new_group(backend="gloo"), capacity=8)
    out = {"min": channel.min(10 - 3 * group.rank)}
    if group.rank == 0:
        for m in _messages():
            channel.send(m)
        channel.send_object({"names": ["a", "b"], "shape": [3, 4]})
        channel.send(_step().encode())
        channel.send(torch.tensor([STOP]))
        return out | {"capacity": channel.capacity}
    out["messages"] = [channel.recv() for _ in LENGTHS]
    out["object"] = channel.recv_object()
    out["step"] = dataclasses.asdict(ForwardStep.decode(channel.recv()))  # plain data: the harness loads it safely
    out["stop"] = channel.recv().tolist()
    return out | {"capacity": channel.capacity}


def test_messages_arrive_whole_and_in_order():
    results = run_ranks(_exchange, 3)
    assert [r["min"] for r in results] == [4, 4, 4]
    assert len({r["capacity"] for r in results}) == 1 and results[0]["capacity"] >= 1001  # every rank grew alike
    for r in results[1:]:
        assert [m.tolist() for m in r["messages"]] == [m.tolist() for m in _messages()]
        assert r["object"] == {"names": ["a", "b"], "shape": [3, 4]}
        assert r["step"] == dataclasses.asdict(_step())
        assert r["stop"] == [STOP]


def test_a_step_encodes_and_decodes_to_itself():
    step = _step()
    decoded = ForwardStep.decode(step.encode())
    assert decoded == step
    empty = ForwardStep(flatten_batch([], 4, tables=False), TableUpdate([], [], [], []), [], use_graphs=False)
    assert ForwardStep.decode(empty.encode()) == empty
