"""The tensor-parallel process group: a rank, a size, and the collectives the sharded layers and the engine use.

Gloo on the CPU, NCCL on CUDA (``init_tp_group``). A ``TPGroup`` of size 1 needs no process group at all, so a
single-process model runs the same layer code with every collective a no-op.

Only exact collectives reach a batch-invariant forward: ``all_gather`` and ``broadcast`` move bits without
arithmetic, and ``sum_disjoint`` adds integer bit patterns of which at most one per element is nonzero.
``all_reduce`` (a float sum in the library's order, which follows the message size and the rank count) is for the
non-invariant fast mode and the negative control.
"""

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# gloo's all-gather into one tensor is all_gather_single in new torch releases, all_gather_into_tensor in old.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group; ``TPGroup()`` is the single process (size 1)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: the default group (size > 1) or no communication (size 1)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of size {self.size}")

    def all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``x`` stacked in rank order: ``[size, *x.shape]``, written into ``out`` when given (a
        preallocated buffer, as CUDA graphs need). Exact: no arithmetic."""
        if out is None:
            out = x.new_empty((self.size, *x.shape))
        elif out.shape != (self.size, *x.shape) or out.dtype != x.dtype or not out.is_contiguous():
            raise ValueError(f"all_gather buffer must be a contiguous [{self.size}, *{tuple(x.shape)}] {x.dtype}")
        if self.size == 1:
            out[0].copy_(x)
            return out
        # The collective sees one flat [size * numel] tensor: gloo and NCCL both take that layout.
        _all_gather_single(out.view(-1), x.contiguous().view(-1), group=self.group)
        return out

    def sum_disjoint(self, x: torch.Tensor) -> torch.Tensor:
        """In place, the sum over ranks of ``x`` where, element by element, at most one rank holds a value other
        than +0.0 (the vocab-parallel embedding's masked rows). The bit patterns are added as integers, so the
        result is that rank's value exactly, -0.0 and NaN payloads included, whatever the order of the sum."""
        if self.size == 1:
            return x
        if not x.is_contiguous() or x.numel() * x.element_size() % 4:
            raise ValueError("sum_disjoint needs a contiguous tensor whose size in bytes is a multiple of 4")
        # gloo and NCCL add int32 but not int16: two bf16 values share an int32, both from the same rank.
        dist.all_reduce(x.view(-1).view(torch.int32), group=self.group)
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place, rank ``src``'s ``x`` on every rank (the engine's weight updates). Exact: no arithmetic."""
        if self.size > 1:
            # gloo has no float8 type: e4m3 weights travel as their bytes.
            dist.broadcast(x.view(torch.uint8) if x.dtype.itemsize == 1 and x.is_floating_point() else x, src,
                           group=self.group)  # fmt: skip
        return x

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """In place, the plain float sum over ranks, in whatever order the library picks. Not invariant."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x


def init_tp_group(
    rank: int,
    size: int,
    init_method: str = "env://",
    device: torch.device | str = "cpu",
    timeout: datetime.timedelta = datetime.timedelta(minutes=5),
) -> TPGroup:
    """Join the default process group as ``rank`` of ``size`` (gloo for a CPU ``device``, NCCL for CUDA) and
    return its ``TPGroup``. ``init_method`` is any torch.distributed one: ``env://`` (torchrun's ``MASTER_ADDR``
    and ``MASTER_PORT``), ``tcp://host:port`` or ``file:///path``. A collective that waits longer than
    ``timeout`` fails instead of hanging. On CUDA, select the rank's device (``torch.cuda.set_device``) first."""
    if size == 1:
        return TPGroup()
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    return TPGroup(rank, size)


def destroy_tp_group(abort: bool = False) -> None:
    """Leave the default process group, if this process joined one. ``abort``: drop every group at once without
    waiting on the peers (NCCL's orderly destroy can wait forever on a peer that is gone, or on work a CUDA graph
    still holds); for teardown when no collective is pending."""
    if not dist.is_initialized():
        return
    if abort:
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()
