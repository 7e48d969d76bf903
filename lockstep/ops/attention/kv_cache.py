"""``write_kv``: this step's keys and values into the paged cache, and an FP8 cache's rounding (``to_cache`` in
Triton, ``cache_values`` in torch), which every writer of the cache shares."""

import torch
import triton
import triton.language as tl

from lockstep.ops._common import pdl_launch, pdl_wait

# An FP8 cache holds e4m3 values with a per-tensor scale of 1 (vLLM's default without calibrated scales): a value
# is rounded to nearest even and saturated at +-448 as it is stored, and read back exactly (e4m3 fits in bf16 and
# fp32). Every writer (write_kv on both devices, the fused rotary_write_kv kernel) rounds the model-dtype value.
FP8_KV = torch.float8_e4m3fn


@triton.jit
def to_cache(x, dtype: tl.constexpr):
    """``x`` as a cache of ``dtype`` stores it: e4m3 saturated at +-448 and rounded to nearest even, else a cast."""
    if dtype == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0).to(dtype, fp_downcast_rounding="rtne")
    return x.to(dtype)


def cache_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``to_cache`` in torch ops."""
    return x.float().clamp(-448.0, 448.0).to(dtype) if dtype == FP8_KV else x.to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # The CPU has no index_copy_/index_select for e4m3: move the bytes instead.
    return t.view(torch.uint8) if t.dtype == FP8_KV else t


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    page_size, num_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, H_PAD)
    dims = tl.arange(0, D_PAD)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HEAD_DIM)
    src = token.to(tl.int64) * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    dst = (slot // page_size) * stride_cb + (slot % page_size) * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + src, mask=mask)
    tl.store(k_cache_ptr + dst, to_cache(k, k_cache_ptr.dtype.element_ty), mask=mask)
    src = token.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    v = tl.load(v_ptr + src, mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(v, v_cache_ptr.dtype.element_ty), mask=mask)


def _write_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k_cache.shape[1], num_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(num_heads), D_PAD=triton.next_power_of_2(head_dim),
        **pdl_launch(k),
    )  # fmt: skip


def check_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """ValueError unless ``write_kv`` can store ``k, v`` into these caches at these slots."""
    if k.shape != v.shape or k.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes: k {tuple(k.shape)}, v {tuple(v.shape)}, caches {tuple(k_cache.shape)}")
    if k_cache.shape[2:] != k.shape[1:] or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"k {tuple(k.shape)}, cache {tuple(k_cache.shape)}, slots {tuple(slot_mapping.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys and values into the paged cache.

    ``k, v: [num_tokens, num_kv_heads, head_dim]``; ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim]`` (contiguous); ``slot_mapping: [num_tokens]``, slot = block_id * block_size + offset, -1 = skip.
    """
    check_kv(k, v, k_cache, v_cache, slot_mapping)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if k.is_cuda:
        _write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    _bytes(k_cache).view(-1, *k_cache.shape[2:]).index_copy_(0, slots, _bytes(cache_values(k, k_cache.dtype)))
    _bytes(v_cache).view(-1, *v_cache.shape[2:]).index_copy_(0, slots, _bytes(cache_values(v, v_cache.dtype)))
