"""The attention layer: rotates q and k, writes the new tokens' K/V into the layer's paged cache, then attends
over the whole cache with one code path. A query token at position p therefore reads the same cache blocks, in the
same order, whether it arrives in a prefill, a chunk, a decode step or after a prefix-cache hit (docs/design.md,
"The engine"). The batch it attends over is described by ``layers.batch.AttentionMetadata``.
"""

from typing import TYPE_CHECKING

import torch
from torch import nn

from lockstep.layers.batch import AttentionMetadata

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
        q = self.kernels.rotary_and_write_kv(q, k, v, *rope, k_cache, v_cache, attn.slot_mapping)
        return self.kernels.attention(q, k_cache, v_cache, attn, self.scale)
