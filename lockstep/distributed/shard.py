"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron's layout).

Column-parallel weights (q/k/v, gate/up, the LM head, the embedding) are cut along their output rows,
row-parallel ones (o_proj, down_proj) along their input columns. The loader reads only a rank's slice from the
safetensors file (``safe_open(...).get_slice``).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """Indices ``[start, stop)`` along ``dim`` of a checkpoint tensor whose length along ``dim`` is ``full``."""

    dim: int
    start: int
    stop: int
    full: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop <= self.full:
            raise ValueError(f"invalid shard [{self.start}, {self.stop}) of {self.full}")

    def index(self) -> tuple[slice, ...]:
        """The index that cuts this shard out of the full tensor."""
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)


def split_evenly(total: int, size: int, rank: int, what: str) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s equal part of ``total`` items; ValueError naming ``what`` when ``size``
    does not divide ``total``."""
    if total % size:
        raise ValueError(f"{what}={total} cannot be split evenly over a tensor-parallel size of {size}")
    part = total // size
    return rank * part, (rank + 1) * part


def kv_head_range(num_heads: int, num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the KV heads rank ``rank`` holds: an equal part when ``size`` divides them, else the
    one KV head its query heads read (replicated on ``size / num_kv_heads`` ranks)."""
    split_evenly(num_heads, size, rank, "num_attention_heads")
    if num_kv_heads % size == 0:
        return split_evenly(num_kv_heads, size, rank, "num_key_value_heads")
    if size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} must divide or be a multiple of the tensor-parallel size {size}"
        )
    head = rank // (size // num_kv_heads)
    return head, head + 1


def vocab_range(vocab_size: int, size: int, rank: int) -> tuple[int, int, int]:
    """``(start, stop, rows)``: rank ``rank`` holds vocabulary rows ``[start, stop)`` in a slice of
    ``rows = ceil(vocab_size / size)`` rows, zero-padded past ``stop`` (the last rank's slice may be short)."""
    rows = -(-vocab_size // size)
    start = min(rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows
