"""Batch-invariant ops: each output row's bits depend only on that row's inputs, never on the batch around it."""

from lockstep.ops.matmul import addmm, bmm, linear, mm

__all__ = ["addmm", "bmm", "linear", "mm"]
