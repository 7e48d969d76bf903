"""Qwen2.5-VL: a Qwen2 decoder (q/k/v bias) with sectioned M-RoPE, fed by a vision tower of RMSNorm blocks with a
SiLU-gated MLP and window attention.

The tower's forward follows transformers' ``Qwen2_5_VisionTransformerPretrainedModel``: the patches are reordered
so that each window of ``window_size`` pixels (``window_size / patch / merge`` merged tokens a side, the image's
last row and column of windows cut short) is contiguous; blocks attend within windows, except those in
``fullatt_block_indexes``, which attend within the whole image frame; the merger (RMSNorm, 2 x 2 patches into one
token, fc1, GELU, fc2) runs in window order and its output is put back in the processor's order. Windows are
computed per image, so an image's windows, and its bits, never depend on the other images of the call.
"""

import functools

import torch
from torch import nn

from lockstep.layers.kernels import Kernels
from lockstep.layers.linear import Linear
from lockstep.layers.norm import RMSNorm
from lockstep.models.llama import ModelConfig
from lockstep.models.multimodal import ImageFeatures, VisionConfig
from lockstep.models.vision import (
    GRID_CACHE,
    Grid,
    PatchEmbed,
    VisionAttention,
    VisionRotary,
    check_pixels,
    cumulative,
    frame_segments,
    grids_of,
    patch_positions,
    split_by_image,
)
from lockstep.models.vlm import VisionLanguageModel

_EPS = 1e-6  # every RMSNorm of the tower


class VisionMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with biases; gate and up stacked into one matmul (``gate_up_proj``)."""

    def __init__(self, config: VisionConfig, kernels: Kernels, dtype: torch.dtype, device):
        super().__init__()
        d, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(d, (i, i), True, kernels, dtype, device)
        self.down_proj = Linear(i, d, True, kernels, dtype, device)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, kernels: Kernels, dtype: torch.dtype, device):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, _EPS, kernels, dtype, device)
        self.norm2 = RMSNorm(config.hidden_size, _EPS, kernels, dtype, device)
        self.attn = VisionAttention(config, kernels, dtype, device)
        self.mlp = VisionMLP(config, kernels, dtype, device)

    def forward(self, x: torch.Tensor, rope, cu_seqlens: torch.Tensor) -> torch.Tensor:
        # x: [num_patches, hidden]
        x = x + self.attn(self.norm1(x), rope, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm of each patch, 2 x 2 patches concatenated, fc1 (``mlp.0``), exact GELU, fc2 (``mlp.2``)."""

    def __init__(self, config: VisionConfig, kernels: Kernels, dtype: torch.dtype, device):
        super().__init__()
        self.dim = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = RMSNorm(config.hidden_size, _EPS, kernels, dtype, device)
        self.mlp = nn.ModuleDict(
            {
                "0": Linear(self.dim, self.dim, True, kernels, dtype, device),
                "2": Linear(self.dim, config.out_hidden_size, True, kernels, dtype, device),
            }
        )
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_patches, hidden] -> [num_patches / merge**2, out_hidden]
        x = self.ln_q(x).reshape(-1, self.dim)
        return self.mlp["2"](self.kernels.gelu(self.mlp["0"](x), "none"))


@functools.lru_cache(maxsize=GRID_CACHE)
def window_order(grid: Grid, merge: int, window: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """One image's merged tokens in window order: ``(order [t*h'*w'] int64`` (the token, in the processor's order,
    at each place), ``window lengths in merged tokens)``. Windows of ``window x window`` merged tokens, row-major,
    frame by frame; each window's tokens row-major. Kept per grid (shared: do not modify)."""
    t, h, w = grid
    th, tw = h // merge, w // merge
    order, lengths = [], []
    for frame in range(t):
        for r0 in range(0, th, window):
            for c0 in range(0, tw, window):
                rows = torch.arange(r0, min(r0 + window, th))
                cols = torch.arange(c0, min(c0 + window, tw))
                order.append((frame * th * tw + rows[:, None] * tw + cols[None, :]).flatten())
                lengths.append(order[-1].numel())
    return torch.cat(order), tuple(lengths)


class Qwen25VisionModel(nn.Module):
    def __init__(self, config: VisionConfig, kernels: Kernels, dtype: torch.dtype, device):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config, False, kernels, dtype, device)
        self.rotary = VisionRotary(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(config, kernels, dtype, device) for _ in range(config.depth))
        self.merger = PatchMerger(config, kernels, dtype, device)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[ImageFeatures]:
        c = self.config
        merge, unit = c.spatial_merge_size, c.spatial_merge_size**2
        grids = grids_of(grid_thw)
        check_pixels(pixel_values, grids, c)
        device = self.patch_embed.proj.weight.device
        # Window order of every image's merged tokens, offset by the tokens of the images before it.
        window = c.window_size // merge // c.patch_size
        orders, lengths, offset = [], [], 0
        for g in grids:
            order, sizes = window_order(g, merge, window)
            orders.append(order + offset)
            lengths += [n * unit for n in sizes]
            offset += order.numel()
        order = torch.cat(orders)  # [total_tokens]
        n = pixel_values.shape[0]
        x = self.patch_embed(pixel_values.to(device))  # [total_patches, hidden]
        # Reorder whole 2 x 2 blocks: [tokens, merge**2, ...] rows picked by order.
        x = x.reshape(n // unit, unit, -1)[order.to(device)].reshape(n, -1)
        pos = patch_positions(grids, merge).reshape(n // unit, unit, 2)[order].reshape(n, 2)
        rope = self.rotary(pos, device)
        windows, frames = cumulative(lengths, device), frame_segments(grids, device)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, frames if i in c.fullatt_block_indexes else windows)
        merged = self.merger(x)[torch.argsort(order).to(device)]  # back to the processor's order
        return [ImageFeatures(e) for e in split_by_image(merged, grids, merge)]


class Qwen2_5_VLForConditionalGeneration(VisionLanguageModel):
    """Qwen2.5-VL."""

    def _build_visual(self, config: ModelConfig, dtype: torch.dtype, device) -> nn.Module:
        return Qwen25VisionModel(config.vision, self.kernels, dtype, device)
