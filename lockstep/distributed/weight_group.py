"""The weight-update group: trainer rank 0 and every sampler rank, for broadcasting new weights in buckets.

An RL trainer and a sampler are separate jobs with their own process groups (the trainer's DDP/FSDP group, the
engine's tensor-parallel group), so the weights travel over a group of their own, built from a ``TCPStore`` the
trainer hosts, without touching either default group: the trainer is rank 0, sampler rank ``r`` is rank
``rank_offset + r`` (vLLM's weight-transfer layout: ``master_address``, ``master_port``, ``rank_offset``,
``world_size``). Gloo carries host tensors, NCCL device tensors; both sides pick by their device, so a CPU trainer
needs a CPU sampler and a CUDA trainer a CUDA one.

An update is a list of ``(name, dtype, shape)`` that both sides know before the first byte moves; ``buckets``
cuts it, by a byte budget, into the same consecutive groups on both sides. The trainer packs each group's tensors
into one flat byte buffer (each tensor 16-byte aligned) and broadcasts it, so a model of thousands of tensors costs
a few broadcasts of ``bucket_bytes`` rather than thousands of small ones; a tensor larger than the budget goes
alone. A broadcast moves bits: the sampler receives exactly the trainer's tensors.
"""

import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
ALIGN = 16  # bytes: every tensor in a bucket starts at a multiple (a view as any dtype is then aligned)
_STORE_PREFIX = "lockstep-weights"

_DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.int64,
               torch.int32, torch.int8, torch.uint8, torch.bool)
}  # fmt: skip


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` (vLLM's spelling, also ``"torch.bfloat16"``) as a torch dtype; ValueError for others."""
    dt = _DTYPES.get(name.removeprefix("torch."))
    if dt is None:
        raise ValueError(f"unknown dtype {name!r} (one of {', '.join(_DTYPES)})")
    return dt


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an update, as both sides announce it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors of an update sent in one broadcast: ``offsets[i]`` is tensor i's first byte."""

    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def buckets(specs: Iterable[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """``specs`` in order, cut into buckets of at most ``bucket_bytes`` (a larger tensor: a bucket of its own).
    A pure function of its arguments: the trainer and every sampler rank compute the same cut."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    out: list[Bucket] = []
    group: list[TensorSpec] = []
    offsets: list[int] = []
    end = 0
    for spec in specs:
        start = _aligned(end)
        if group and start + spec.nbytes > bucket_bytes:
            out.append(Bucket(tuple(group), tuple(offsets), end))
            group, offsets, start = [], [], 0
        group.append(spec)
        offsets.append(start)
        end = start + spec.nbytes
    if group:
        out.append(Bucket(tuple(group), tuple(offsets), end))
    return out


def unpack(bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views of ``buffer`` (uint8, at least ``bucket.nbytes``)."""
    for spec, offset in zip(bucket.specs, bucket.offsets, strict=True):
        yield spec.name, buffer[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)


def pack(bucket: Bucket, tensors: list[torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` (the bucket's, in order) into ``buffer[:bucket.nbytes]`` and return that slice."""
    for (_, view), t in zip(unpack(bucket, buffer), tensors, strict=True):
        view.copy_(t.detach())
    return buffer[: bucket.nbytes]


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class WeightGroup:
    """This process's membership of a weight-update group (``join``); ``broadcast`` from the trainer (rank 0)."""

    def __init__(self, group, rank: int, size: int, device: torch.device, store: dist.Store) -> None:
        self.group = group
        self.rank = rank
        self.size = size
        self.device = device
        self._store = store  # kept alive: the trainer's is the rendezvous server

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        device: torch.device | str,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> "WeightGroup":
        """Join as ``rank`` of ``world_size`` (rank 0 hosts the store at ``master_address:master_port``). Blocks
        until every rank has joined: the trainer and the sampler ranks call it at the same time."""
        if not 0 <= rank < world_size or world_size < 2:
            raise ValueError(f"weight group: invalid rank {rank} of world_size {world_size}")
        device = torch.device(device)
        store = dist.TCPStore(master_address, int(master_port), world_size, rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore(_STORE_PREFIX, store)
        if backend_for(device) == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        self = cls(group, rank, world_size, device, store)
        self.barrier()  # every rank is connected before the first update
        return self

    def barrier(self) -> None:
        self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device))

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place, rank 0's ``tensor`` on every rank (bits, no arithmetic)."""
        self.group.broadcast(tensor, 0).wait()
        return tensor

    def close(self) -> None:
        self.group = None
        self._store = None
