"""Batch-invariant ops: each output row's bits depend only on that row's inputs, never on the batch around it."""

import os

# Whether Triton contracts a product and a sum into one fused multiply-add decides some kernels' bits (the rotary's
# fma.rn.bf16, docs/design.md). Triton fuses by default, and every figure and the sampler = trainer equality were
# measured so; Triton 3.9 announces that 3.10 will stop fusing by default. Pinned here (before any kernel
# compiles), so a Triton upgrade does not move the bits; a value set in the environment is kept.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from lockstep.ops.attention import paged_attention, write_kv
from lockstep.ops.gelu import gelu
from lockstep.ops.layer_norm import layer_norm
from lockstep.ops.matmul import addmm, bmm, linear, mm
from lockstep.ops.moe import experts as moe_experts
from lockstep.ops.moe import route as moe_route
from lockstep.ops.reduce import mean, sum
from lockstep.ops.rms_norm import rms_norm, rms_norm_qk, rms_norm_with_rstd
from lockstep.ops.rotary import rotary, rotary_torch, rotary_write_kv
from lockstep.ops.softmax import log_softmax, log_softmax_at, softmax
from lockstep.ops.vision_attention import vision_attention

__all__ = [
    "addmm",
    "bmm",
    "gelu",
    "layer_norm",
    "linear",
    "log_softmax",
    "log_softmax_at",
    "mean",
    "mm",
    "moe_experts",
    "moe_route",
    "paged_attention",
    "rms_norm",
    "rms_norm_qk",
    "rms_norm_with_rstd",
    "rotary",
    "rotary_torch",
    "rotary_write_kv",
    "softmax",
    "sum",
    "vision_attention",
    "write_kv",
]
