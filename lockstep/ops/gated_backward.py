"""The gradient of SiLU-and-mul, ``out = silu(gate) * up`` from ``gate_up: [num_tokens, 2 * I]``, on CUDA in one
Triton pass: ``silu_and_mul_backward``.

The trainer's backward (``rl/policy.py``) needs no invariant bits, only deterministic accurate ones: per element,
in fp32, ``sig = 1 / (1 + exp(-gate))``, ``grad_gate = g * up * sig * (1 + gate * (1 - sig))`` and
``grad_up = g * gate * sig``, both halves rounded to the activations' dtype. torch's formula for the same
arithmetic makes a pass over [num_tokens, I] in fp32 for every operation (some ten of them, session 11's profile:
33 ms of a 4-layer, 16k-token step); this reads gate, up and g once and writes the two halves once. An element's
bits depend on its three inputs alone (the CPU keeps torch's formula, whose bits differ by rounding).
"""

import torch
import triton
import triton.language as tl

from lockstep.ops._common import pdl_launch, pdl_wait

BLOCK = 1024


@triton.jit
def _silu_and_mul_backward_kernel(
    x_ptr, g_ptr, out_ptr, width, stride_x, stride_g, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):  # fmt: skip
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    grad_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
    grad_up = g * gate * sig
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_o + cols, grad_gate.to(dtype), mask=ok)
    tl.store(out_ptr + row * stride_o + width + cols, grad_up.to(dtype), mask=ok)


def silu_and_mul_backward(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``gate_up: [num_tokens, 2 * I]``, ``grad: [num_tokens, I]`` (the output's gradient) -> the gradient of
    ``gate_up``, in its dtype (the Triton kernel, on any device Triton runs on: CUDA, or the interpreter)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or tuple(grad.shape) != (gate_up.shape[0], gate_up.shape[1] // 2):
        raise ValueError(f"expected gate_up [n, 2 * I] and grad [n, I], got {tuple(gate_up.shape)}, "
                         f"{tuple(grad.shape)}")  # fmt: skip
    gate_up = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    grad = grad if grad.stride(1) == 1 else grad.contiguous()
    num_tokens, width = grad.shape
    out = torch.empty_like(gate_up)
    if num_tokens:
        _silu_and_mul_backward_kernel[(num_tokens, triton.cdiv(width, BLOCK))](
            gate_up, grad, out, width, gate_up.stride(0), grad.stride(0), out.stride(0),
            BLOCK=BLOCK, **pdl_launch(gate_up),
        )  # fmt: skip
    return out
