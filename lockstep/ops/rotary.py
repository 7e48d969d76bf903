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
from lockstep.ops.attention.kv_cache import FP8_KV, check_kv, to_cache, write_kv


@triton.jit
def _rotate(x_ptr, o_ptr, stride_h, num_heads, c, s, HALF: tl.constexpr, H_PAD: tl.constexpr):
    heads = tl.arange(0, H_PAD)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    first = x_ptr + heads * stride_h + dims
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    dtype = x_ptr.dtype.element_ty  # the model's: an FP8 cache receives that value, then to_cache's rounding
    cache = o_ptr.dtype.element_ty
    # Round to nearest even, as torch does (a cast that names no rounding may truncate).
    a = (x1 * c).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    b = (x2 * s).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    out = o_ptr + heads * stride_h + dims
    tl.store(out, to_cache((a - b).to(dtype, fp_downcast_rounding="rtne"), cache), mask=mask)
    a = (x2 * c).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    b = (x1 * s).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    tl.store(out + HALF, to_cache((a + b).to(dtype, fp_downcast_rounding="rtne"), cache), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, v_ptr, v_cache_ptr, slot_ptr,
    num_q_heads, num_kv_heads, stride_qt, stride_kt, stride_qot, stride_kot, stride_h, stride_ct,
    stride_vt, page_size, stride_cb, stride_cs,
    HALF: tl.constexpr, QH_PAD: tl.constexpr, KH_PAD: tl.constexpr, TO_CACHE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # TO_CACHE: k_out_ptr and v_cache_ptr are one layer's paged caches; the token's rotated k and its v go to its
    # slot (none for slot -1), by the same _rotate as the plain path: only the address of the store differs.
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF)[None, :]
    c = tl.load(cos_ptr + token * stride_ct + dims).to(tl.float32)  # the first half of cat(c, c)
    s = tl.load(sin_ptr + token * stride_ct + dims).to(tl.float32)
    _rotate(q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, stride_h, num_q_heads, c, s, HALF, QH_PAD)
    if TO_CACHE:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            dst = (slot // page_size) * stride_cb + (slot % page_size) * stride_cs
            _rotate(k_ptr + token * stride_kt, k_out_ptr + dst, stride_h, num_kv_heads, c, s, HALF, KH_PAD)
            heads = tl.arange(0, KH_PAD)[:, None]
            cols = heads * stride_h + tl.arange(0, 2 * HALF)[None, :]
            v = tl.load(v_ptr + token * stride_vt + cols, mask=heads < num_kv_heads)
            tl.store(v_cache_ptr + dst + cols, to_cache(v, v_cache_ptr.dtype.element_ty), mask=heads < num_kv_heads)
    else:
        _rotate(k_ptr + token * stride_kt, k_out_ptr + token * stride_kot, stride_h, num_kv_heads, c, s, HALF, KH_PAD)


def _heads_rows(x: torch.Tensor) -> torch.Tensor:
    # Heads must be rows of head_dim contiguous values; the token stride is free (q, k, v are views of one QKV).
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _rotary_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # cache = (v, k_cache, v_cache, slot_mapping): rotated k and v go to the cache, and k_out is None.
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q, k = _heads_rows(q), _heads_rows(k)
    cos = cos.reshape(num_tokens, head_dim).to(q.dtype)
    sin = sin.reshape(num_tokens, head_dim).to(q.dtype)
    q_out = q.new_empty(q.shape)
    if cache is None:
        k_out = k.new_empty(k.shape)
        v, v_cache, slots, page_size, stride_cb, stride_cs = k, k_out, cos, 1, 0, 0  # unused
    else:
        v, k_out, v_cache, slots = cache
        v = _heads_rows(v)
        page_size, stride_cb, stride_cs = k_out.shape[1], k_out.stride(0), k_out.stride(1)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, q_out, k_out, cos, sin, v, v_cache, slots,
            num_q_heads, num_kv_heads, q.stride(0), k.stride(0), q_out.stride(0), k_out.stride(0), head_dim,
            cos.stride(0), v.stride(0), page_size, stride_cb, stride_cs,
            HALF=head_dim // 2, QH_PAD=triton.next_power_of_2(num_q_heads),
            KH_PAD=triton.next_power_of_2(num_kv_heads), TO_CACHE=cache is not None, **pdl_launch(q),
        )  # fmt: skip
    return q_out, None if cache is not None else k_out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's formula in torch ops (differentiable): what ``rotary`` runs on the CPU and in fp32."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _use_kernel(q: torch.Tensor) -> bool:
    head_dim = q.shape[2]
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and not head_dim & (head_dim - 1)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape[::2] != q.shape[::2] or cos.shape[0] != q.shape[0]:
        raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} do not fit")


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q: [num_tokens, num_q_heads, head_dim]`` and ``k: [num_tokens, num_kv_heads, head_dim]`` by
    ``cos, sin: [num_tokens, 1, head_dim]`` (each row ``cat(c, c)``, as ``RotaryEmbedding`` builds them).
    Returns new tensors."""
    _check(q, k, cos)
    return _rotary_triton(q, k, cos, sin) if _use_kernel(q) else rotary_torch(q, k, cos, sin)


def rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """``rotary`` of ``q, k``, then ``write_kv`` of the rotated ``k`` and ``v`` into one layer's paged cache;
    returns the rotated ``q``. On CUDA one kernel does both, with the same values: the cache receives the bits
    ``rotary`` would have returned for ``k`` (the same rotation code, stored elsewhere), through ``write_kv``'s
    rounding for an FP8 cache."""
    _check(q, k, cos)
    if not _use_kernel(q) or k_cache.dtype not in (k.dtype, FP8_KV) or v_cache.dtype != k_cache.dtype:
        q, k = rotary(q, k, cos, sin)
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q
    check_kv(k, v, k_cache, v_cache, slot_mapping)
    return _rotary_triton(q, k, cos, sin, (v, k_cache, v_cache, slot_mapping))[0]
