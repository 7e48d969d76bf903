"""Rotary position embedding of q and k in one kernel: Hugging Face's formula, elementwise.

``x * cos + rotate_half(x) * sin`` is, per element of the two halves ``x1, x2`` of a head,
``x1 * c - x2 * s`` and ``x2 * c + x1 * s``, one token per program: elementwise, so a token's bits cannot depend
on its batch. It replaces ten small kernels a layer (multiplies, negations, concatenations, adds) with one.

The kernel asks for torch's roundings (each product rounded to the model dtype, then the sum), but on the H200 the
compiler turns product, rounding and sum into one ``fma.rn.bf16`` (seen in the PTX), so some bf16 elements differ
from torch's eager ops (2026-11-30, bench/ops.py --rotary). The bits are still a function of the element alone;
what matters is that nothing mixes the two paths: the engine's kernel sets and the RL trainer (which wraps this op
in autograd) all call ``rotary``. The CPU and fp32 run ``rotary_torch``.
"""

import torch
import triton
import triton.language as tl

from lockstep.ops._common import pdl_launch, pdl_wait


@triton.jit
def _rotate(x_ptr, o_ptr, stride_h, num_heads, c, s, HALF: tl.constexpr, H_PAD: tl.constexpr):
    heads = tl.arange(0, H_PAD)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    first = x_ptr + heads * stride_h + dims
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    dtype = o_ptr.dtype.element_ty
    # Round to nearest even, as torch does (a cast that names no rounding may truncate).
    a = (x1 * c).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    b = (x2 * s).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    out = o_ptr + heads * stride_h + dims
    tl.store(out, (a - b).to(dtype, fp_downcast_rounding="rtne"), mask=mask)
    a = (x2 * c).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    b = (x1 * s).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    tl.store(out + HALF, (a + b).to(dtype, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    num_q_heads, num_kv_heads, stride_qt, stride_kt, stride_qot, stride_kot, stride_h, stride_ct,
    HALF: tl.constexpr, QH_PAD: tl.constexpr, KH_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF)[None, :]
    c = tl.load(cos_ptr + token * stride_ct + dims).to(tl.float32)  # the first half of cat(c, c)
    s = tl.load(sin_ptr + token * stride_ct + dims).to(tl.float32)
    _rotate(q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, stride_h, num_q_heads, c, s, HALF, QH_PAD)
    _rotate(k_ptr + token * stride_kt, k_out_ptr + token * stride_kot, stride_h, num_kv_heads, c, s, HALF, KH_PAD)


def _rotary_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    # Heads must be rows of head_dim contiguous values; the token stride is free (q, k are views of one QKV).
    q = q if q.stride(2) == 1 and q.stride(1) == head_dim else q.contiguous()
    k = k if k.stride(2) == 1 and k.stride(1) == head_dim else k.contiguous()
    cos = cos.reshape(num_tokens, head_dim).to(q.dtype)
    sin = sin.reshape(num_tokens, head_dim).to(q.dtype)
    q_out = q.new_empty(q.shape)
    k_out = k.new_empty(k.shape)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, cos, sin,
            num_q_heads, num_kv_heads, q.stride(0), k.stride(0), q_out.stride(0), k_out.stride(0), head_dim,
            cos.stride(0), HALF=head_dim // 2, QH_PAD=triton.next_power_of_2(num_q_heads),
            KH_PAD=triton.next_power_of_2(num_kv_heads), **pdl_launch(q),
        )  # fmt: skip
    return q_out, k_out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's formula in torch ops (differentiable): what ``rotary`` runs on the CPU and in fp32."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q: [num_tokens, num_q_heads, head_dim]`` and ``k: [num_tokens, num_kv_heads, head_dim]`` by
    ``cos, sin: [num_tokens, 1, head_dim]`` (each row ``cat(c, c)``, as ``RotaryEmbedding`` builds them).
    Returns new tensors."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[::2] != q.shape[::2] or cos.shape[0] != q.shape[0]:
        raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} do not fit")
    head_dim = q.shape[2]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and not head_dim & (head_dim - 1):
        return _rotary_triton(q, k, cos, sin)
    return rotary_torch(q, k, cos, sin)
