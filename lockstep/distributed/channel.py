"""The control plane of tensor parallelism: rank 0 tells the other ranks what to do next, one broadcast a step.

A message is a 1-D int64 tensor of any length (the engine's step: token ids, positions, KV slots, block tables).
A receiver must know how many elements a broadcast carries, so every broadcast moves a buffer of ``capacity``
elements whose first element is the message's length. A message that does not fit is followed by a second
broadcast with the rest, and every rank then doubles its capacity until the message fits, so a step costs one
broadcast once the buffer has grown to the largest step seen.

The channel runs over a gloo group of its own, on host tensors, even when the model's collectives use NCCL: a
worker reads the step into Python lists without synchronising its GPU, and a worker waiting for the next step
(an idle server) waits as long as it takes, while the model's collectives keep a finite timeout.
"""

import datetime
import pickle

import torch
import torch.distributed as dist

# Idle workers wait in the channel's broadcast for the next message; gloo takes the timeout in milliseconds.
IDLE_TIMEOUT = datetime.timedelta(days=3650)
INITIAL_CAPACITY = 1 << 12


class ControlChannel:
    """Broadcasts from rank 0 to the other ranks of a gloo ``group`` (None: no other ranks, nothing to send)."""

    def __init__(self, rank: int, size: int, group: dist.ProcessGroup | None, capacity: int = INITIAL_CAPACITY):
        if size > 1 and group is None:
            raise ValueError("a control channel between several ranks needs a process group")
        self.rank = rank
        self.size = size
        self.group = group
        self.capacity = capacity
        self._buffer = torch.zeros(capacity, dtype=torch.int64)

    @classmethod
    def create(cls, rank: int, size: int) -> "ControlChannel":
        """A channel over a new gloo group of the whole default group (a collective: every rank calls it)."""
        return cls(rank, size, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if size > 1 else None)

    def _grow(self, length: int) -> None:
        while self.capacity < length + 1:
            self.capacity *= 2
        # Never an inference tensor: rank 0 sends steps inside the runner's inference mode, and a buffer made there
        # could not be written outside it (the STOP message of close() failed so after steps had grown it, and the
        # workers, never told to stop, were killed: 20-s closes on the H200s).
        with torch.inference_mode(False):
            self._buffer = torch.zeros(self.capacity, dtype=torch.int64)

    def send(self, message: torch.Tensor) -> None:
        """Rank 0: broadcast ``message`` (1-D int64) to every other rank."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends on the control channel")
        if self.size == 1:
            return
        length = message.numel()
        head = min(length, self.capacity - 1)
        self._buffer[0] = length
        self._buffer[1 : head + 1] = message[:head]
        dist.broadcast(self._buffer, 0, group=self.group)
        if length > head:
            dist.broadcast(message[head:].contiguous(), 0, group=self.group)
            self._grow(length)

    def recv(self) -> torch.Tensor:
        """Ranks > 0: the next message rank 0 sends (waits for it, however long)."""
        if self.rank == 0:
            raise RuntimeError("rank 0 sends on the control channel; it receives nothing")
        dist.broadcast(self._buffer, 0, group=self.group)
        length = int(self._buffer[0])
        head = min(length, self.capacity - 1)
        message = self._buffer[1 : head + 1].clone()
        if length > head:
            rest = torch.empty(length - head, dtype=torch.int64)
            dist.broadcast(rest, 0, group=self.group)
            message = torch.cat([message, rest])
            self._grow(length)
        return message

    def send_object(self, obj: object) -> None:
        """Rank 0: broadcast a small picklable object (rare control data, never a step)."""
        data = pickle.dumps(obj)
        self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64))

    def recv_object(self) -> object:
        return pickle.loads(self.recv().to(torch.uint8).numpy().tobytes())

    def min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (exact: a minimum does no arithmetic)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t)
