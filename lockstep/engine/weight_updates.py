"""Weight updates from a trainer over ``torch.distributed``: the sampler side of ``distributed.weight_group``.

vLLM's weight-transfer shape: ``init_weight_transfer_engine(init_info)`` joins the group once (``init_info``:
``master_address``, ``master_port``, ``rank_offset``, ``world_size``), then each ``update_weights(update_info)``
receives one update (``update_info``: ``names``, ``dtype_names``, ``shapes`` in the order the trainer sends them,
and ``bucket_bytes``, the trainer's bucket budget, default ``DEFAULT_BUCKET_BYTES``). Every sampler rank joins
(under tensor parallelism rank ``r`` is group rank ``rank_offset + r``) and receives every bucket straight from the
trainer, keeping its slice of each tensor, so a TP worker costs the trainer no extra hop through rank 0.
"""

from dataclasses import dataclass

from lockstep.distributed.weight_group import DEFAULT_BUCKET_BYTES, TensorSpec, dtype_from_name

_INIT_KEYS = {"master_address", "master_port", "rank_offset", "world_size"}


@dataclass(frozen=True)
class GroupInfo:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


def parse_init_info(init_info: dict, num_ranks: int) -> GroupInfo:
    """``init_info`` checked against a sampler of ``num_ranks`` ranks; ValueError naming what is wrong. Keys of
    other backends' init info (vLLM's ``packed``, buffer sizes) are accepted and ignored."""
    if not isinstance(init_info, dict):
        raise ValueError(f"init_info must be an object, got {type(init_info).__name__}")
    missing = sorted(_INIT_KEYS - set(init_info))
    if missing:
        raise ValueError(f"init_info lacks {', '.join(missing)}")
    info = GroupInfo(
        str(init_info["master_address"]),
        int(init_info["master_port"]),
        int(init_info["rank_offset"]),
        int(init_info["world_size"]),
    )
    if info.rank_offset < 1 or info.rank_offset + num_ranks > info.world_size:
        raise ValueError(
            f"init_info: rank_offset {info.rank_offset} and world_size {info.world_size} leave no room for the "
            f"sampler's {num_ranks} rank(s) after the trainer's rank 0"
        )
    return info


def parse_update_info(update_info: dict) -> tuple[list[TensorSpec], int]:
    """``(specs, bucket_bytes)`` of ``update_info``; ValueError naming what is wrong."""
    if not isinstance(update_info, dict):
        raise ValueError(f"update_info must be an object, got {type(update_info).__name__}")
    try:
        names, dtypes, shapes = update_info["names"], update_info["dtype_names"], update_info["shapes"]
    except KeyError as e:
        raise ValueError(f"update_info lacks {e.args[0]!r} (it takes names, dtype_names, shapes)") from None
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"update_info: {len(names)} names, {len(dtypes)} dtype_names, {len(shapes)} shapes")
    if update_info.get("packed") is False:
        raise ValueError("update_info: packed=false (one broadcast per tensor) is not supported; use buckets")
    bucket_bytes = int(update_info.get("bucket_bytes", DEFAULT_BUCKET_BYTES))
    specs = [
        TensorSpec(str(n), dtype_from_name(str(d)), tuple(int(x) for x in s))
        for n, d, s in zip(names, dtypes, shapes, strict=True)
    ]
    return specs, bucket_bytes
