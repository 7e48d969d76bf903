"""Tensor parallelism's plumbing: the process group (``TPGroup``), which slice of a checkpoint tensor a rank
holds (``Shard``), and the channel on which rank 0 tells the others what to run (``ControlChannel``). The
numerics that make a row-parallel reduction independent of the rank count are in ``lockstep.ops.tp_linear``; the
sharded layers in ``lockstep.layers``; the engine's worker processes in ``lockstep.engine.tp_workers``."""

from lockstep.distributed.channel import ControlChannel
from lockstep.distributed.group import TPGroup, destroy_tp_group, init_tp_group
from lockstep.distributed.shard import Shard, kv_head_range, split_evenly, vocab_range

__all__ = [
    "ControlChannel",
    "Shard",
    "TPGroup",
    "destroy_tp_group",
    "init_tp_group",
    "kv_head_range",
    "split_evenly",
    "vocab_range",
]
