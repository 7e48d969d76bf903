"""Batch-invariant ops: each output row's bits depend only on that row's inputs, never on the batch around it."""

from lockstep.ops.attention import paged_attention, write_kv
from lockstep.ops.matmul import addmm, bmm, linear, mm
from lockstep.ops.moe import experts as moe_experts
from lockstep.ops.moe import route as moe_route
from lockstep.ops.reduce import mean, sum
from lockstep.ops.rms_norm import rms_norm, rms_norm_with_rstd
from lockstep.ops.rotary import rotary, rotary_torch
from lockstep.ops.softmax import log_softmax, softmax

__all__ = [
    "addmm",
    "bmm",
    "linear",
    "log_softmax",
    "mean",
    "mm",
    "moe_experts",
    "moe_route",
    "paged_attention",
    "rms_norm",
    "rms_norm_with_rstd",
    "rotary",
    "rotary_torch",
    "softmax",
    "sum",
    "write_kv",
]
