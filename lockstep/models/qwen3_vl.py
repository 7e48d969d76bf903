"""Qwen3-VL and Qwen3-VL-MoE: a Qwen3 (or Qwen3-MoE) decoder with interleaved M-RoPE, fed by a vision tower of
LayerNorm blocks with a GELU-tanh MLP, a learned position grid resampled (bilinear) to each image's grid, and
DeepStack: the features after blocks ``deepstack_visual_indexes`` go, each through its own merger, into the
hidden states of the image tokens after the first decoder layers (``vlm.VLTextModel``).

The tower's forward follows transformers' ``Qwen3VLVisionModel``: patch embedding plus the interpolated position
embedding, the blocks (attention within each image frame), the merger (LayerNorm, then 2 x 2 patches concatenated
into one token, fc1, GELU, fc2). The mixture of experts differs only in its decoder's MLPs (``layers.moe``, with
the experts' fused checkpoint tensors).
"""

import functools

import torch
from torch import nn

from lockstep.layers.kernels import Kernels
from lockstep.layers.linear import Linear
from lockstep.models.llama import ModelConfig
from lockstep.models.multimodal import ImageFeatures, VisionConfig
from lockstep.models.vision import (
    GRID_CACHE,
    Grid,
    PatchEmbed,
    VisionAttention,
    VisionRotary,
    Weights,
    check_pixels,
    frame_segments,
    grids_of,
    image_patch_positions,
    patch_positions,
    split_by_image,
)
from lockstep.models.vlm import VisionLanguageModel

_EPS = 1e-6  # every LayerNorm of the tower


class LayerNorm(nn.Module):
    def __init__(self, dim: int, kernels: Kernels, dtype: torch.dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.layer_norm(x, self.weight, self.bias, _EPS)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig, kernels: Kernels, dtype: torch.dtype, device):
        super().__init__()
        self.linear_fc1 = Linear(config.hidden_size, config.intermediate_size, True, kernels, dtype, device)
        self.linear_fc2 = Linear(config.intermediate_size, config.hidden_size, True, kernels, dtype, device)
        self.activation = config.activation
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.kernels.gelu(self.linear_fc1(x), self.activation))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, kernels: Kernels, dtype: torch.dtype, device):
        super().__init__()
        self.norm1 = LayerNorm(config.hidden_size, kernels, dtype, device)
        self.norm2 = LayerNorm(config.hidden_size, kernels, dtype, device)
        self.attn = VisionAttention(config, kernels, dtype, device)
        self.mlp = VisionMLP(config, kernels, dtype, device)

    def forward(self, x: torch.Tensor, rope, cu_seqlens: torch.Tensor) -> torch.Tensor:
        # x: [num_patches, hidden]
        x = x + self.attn(self.norm1(x), rope, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """2 x 2 patches into one token of the decoder's width. The main merger normalizes each patch, then
    concatenates; the DeepStack mergers (``postshuffle``) concatenate, then normalize the concatenation."""

    def __init__(self, config: VisionConfig, postshuffle: bool, kernels: Kernels, dtype: torch.dtype, device):
        super().__init__()
        self.dim = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = LayerNorm(self.dim if postshuffle else config.hidden_size, kernels, dtype, device)
        self.linear_fc1 = Linear(self.dim, self.dim, True, kernels, dtype, device)
        self.linear_fc2 = Linear(self.dim, config.out_hidden_size, True, kernels, dtype, device)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_patches, hidden] -> [num_patches / merge**2, out_hidden]
        x = self.norm(x.reshape(-1, self.dim)) if self.postshuffle else self.norm(x).reshape(-1, self.dim)
        return self.linear_fc2(self.kernels.gelu(self.linear_fc1(x), "none"))


@functools.lru_cache(maxsize=GRID_CACHE)
def interpolation_taps(grid: Grid, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bilinear resampling (align_corners) of a ``side x side`` learned grid to one image's ``h x w`` patches:
    per patch, in the processor's order, 4 table rows ``[h*w*t, 4]`` int64 and their fp32 weights, by
    transformers' formulas (``vision_utils.get_vision_interpolation_indices_and_weights``). Kept per grid
    (shared: do not modify)."""
    t, h, w = grid
    pos = image_patch_positions((1, h, w), merge)  # [h*w, 2]

    def axis(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = index.float() * (side - 1) / torch.tensor(max(size - 1, 1)).float()
        floor = torch.floor(src)
        offsets = torch.arange(2)
        taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
        distance = (src[:, None] - floor[:, None] - offsets).abs()
        return taps, (1 - distance).clamp(min=0)

    h_taps, h_w = axis(pos[:, 0], h)
    w_taps, w_w = axis(pos[:, 1], w)
    rows = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return rows.repeat(t, 1), weights.repeat(t, 1)


class Qwen3VisionModel(nn.Module):
    def __init__(self, config: VisionConfig, kernels: Kernels, dtype: torch.dtype, device):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config, True, kernels, dtype, device)
        self.pos_embed = Weights((config.num_position_embeddings, config.hidden_size), None, dtype, device)
        self.side = round(config.num_position_embeddings**0.5)
        self.rotary = VisionRotary(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(config, kernels, dtype, device) for _ in range(config.depth))
        self.merger = PatchMerger(config, False, kernels, dtype, device)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, True, kernels, dtype, device) for _ in config.deepstack_visual_indexes
        )

    def position_embedding(self, grids: list[Grid], device) -> torch.Tensor:
        """``[total_patches, hidden]`` in the model dtype: each patch's 4 taps weighted in fp32, summed in tap
        order, then rounded (transformers' rounding)."""
        merge = self.config.spatial_merge_size
        taps = [interpolation_taps(g, self.side, merge) for g in grids]
        rows = torch.cat([r for r, _ in taps]).to(device)
        weights = torch.cat([w for _, w in taps]).to(device)
        table = self.pos_embed.weight
        terms = table[rows].float() * weights[:, :, None]  # [total_patches, 4, hidden] fp32
        return (((terms[:, 0] + terms[:, 1]) + terms[:, 2]) + terms[:, 3]).to(table.dtype)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[ImageFeatures]:
        c = self.config
        grids = grids_of(grid_thw)
        check_pixels(pixel_values, grids, c)
        device = self.pos_embed.weight.device
        x = self.patch_embed(pixel_values.to(device))  # [total_patches, hidden]
        x = x + self.position_embedding(grids, device)
        rope = self.rotary(patch_positions(grids, c.spatial_merge_size), device)
        cu_seqlens = frame_segments(grids, device)
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, cu_seqlens)
            if i in c.deepstack_visual_indexes:
                deep.append(self.deepstack_merger_list[c.deepstack_visual_indexes.index(i)](x))
        embeds = split_by_image(self.merger(x), grids, c.spatial_merge_size)
        if not deep:
            return [ImageFeatures(e) for e in embeds]
        # [num_deepstack, total_tokens, out] -> per image [num_deepstack, tokens, out]
        stacked = split_by_image(torch.stack(deep, dim=1), grids, c.spatial_merge_size)
        return [ImageFeatures(e, d.transpose(0, 1).contiguous()) for e, d in zip(embeds, stacked, strict=True)]


class Qwen3VLForConditionalGeneration(VisionLanguageModel):
    """Qwen3-VL, and Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``: the same with the decoder's MoE layers)."""

    def _build_visual(self, config: ModelConfig, dtype: torch.dtype, device) -> nn.Module:
        return Qwen3VisionModel(config.vision, self.kernels, dtype, device)
