"""SiLU-and-mul on CUDA in one Triton pass: ``silu(gate) * up`` from ``gate_up: [num_tokens, 2 * I]``.

Torch runs it as two elementwise kernels (``F.silu`` on the gate half, then the product), each reading and writing
the activations once. This kernel does the same arithmetic per element in one pass, in torch's order: silu in fp32
as ``x / (1 + exp(-x))`` with the correctly rounded division and CUDA's ``expf`` (libdevice), rounded to the
tensor's dtype, then one multiply in fp32 rounded again. An element's bits depend on its two inputs alone, so the
op is batch-invariant; bench/activation.py checks on the GPU that they are torch's bits too.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from lockstep.ops._common import interpreting, pdl_launch, pdl_wait

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    if LIBDEVICE:
        silu = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    else:  # the interpreter has no libdevice: the same formula, its bits are not CUDA's
        silu = g / (1.0 + tl.exp(-g))
    silu = silu.to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up: [num_tokens, 2 * I]`` (unit stride in its last dimension) -> ``silu(gate) * up: [num_tokens, I]``."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"expected gate_up of shape [num_tokens, 2 * I], got {tuple(gate_up.shape)}")
    gate_up = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    num_tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        grid = (num_tokens, triton.cdiv(width, BLOCK))
        _silu_and_mul_kernel[grid](
            gate_up, out, width, gate_up.stride(0), out.stride(0),
            BLOCK=BLOCK, LIBDEVICE=not interpreting(), **pdl_launch(gate_up),
        )  # fmt: skip
    return out
