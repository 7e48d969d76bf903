"""The attention layer: rotates q and k, writes the new tokens' K/V into the layer's paged cache, then attends
over the whole cache with one code path. A query token at position p therefore reads the same cache blocks, in the
same order, whether it arrives in a prefill, a chunk, a decode step or after a prefix-cache hit (docs/design.md,
"The engine"). The batch it attends over is described by ``layers.batch.AttentionMetadata``.
"""

from typing import TYPE_CHECKING

import torch
from torch import nn

from lockstep.layers.batch import AttentionMetadata
from lockstep.ops.attention import FP8_KV

if TYPE_CHECKING:
    from lockstep.layers.kernels import Kernels


class Attention(nn.Module):
    """Rotates q and k, writes one layer's new K/V into its cache, then attends over the cache. No weights of its
    own."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, kernels: "Kernels"):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.kernels = kernels
        # Calibrated FP8 KV scales [num_kv_heads] fp32 (models/kv_scales.py), or None: an FP8 cache at scale 1.
        self.register_buffer("k_scale", None, persistent=False)
        self.register_buffer("v_scale", None, persistent=False)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim], rope: (cos, sin)
        k_cache, v_cache = attn.kv_caches[self.layer_idx]
        scaled = self.k_scale is not None and k_cache.dtype == FP8_KV
        if scaled:  # the cache holds e4m3(k / k_scale), e4m3(v / v_scale)
            k, v = _per_head(k, self.k_scale, divide=True), _per_head(v, self.v_scale, divide=True)
        q = self.kernels.rotary_and_write_kv(q, k, v, *rope, k_cache, v_cache, attn.slot_mapping)
        if not scaled:
            return self.kernels.attention(q, k_cache, v_cache, attn, self.scale)
        group = self.num_heads // self.num_kv_heads  # query head h reads KV head h // group
        q = _per_head(q, self.k_scale.repeat_interleave(group), divide=False)  # q . (k8 k_scale) = (q k_scale) . k8
        out = self.kernels.attention(q, k_cache, v_cache, attn, self.scale)
        return _per_head(out, self.v_scale.repeat_interleave(group), divide=False)


def _per_head(x: torch.Tensor, scale: torch.Tensor, divide: bool) -> torch.Tensor:
    # x: [num_tokens, heads, head_dim], scale: [heads] fp32 -> x / scale or x * scale per head, in fp32, rounded once
    # to x's dtype: elementwise, so a row's bits are its own.
    s = scale[None, :, None]
    return (x.float() / s if divide else x.float() * s).to(x.dtype)
