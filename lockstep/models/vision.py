"""Pieces the Qwen vision towers share: the patch embedding, the 2-D rotary embedding, the attention block's
attention, and the per-image bookkeeping (patch positions, attention segments, splitting features by image).

A batch of images is one flattened sequence of patches, each image's patches contiguous and in the order the image
processor emits them (``t``, then 2 x 2 merge blocks in row-major order, then the four patches of a block). Every op
is per row except attention, which runs within segments (``cu_seqlens``: one per image frame, or per window in
Qwen2.5-VL) through the kernel set's ``vision_attention``. Everything computed from a grid (positions, windows,
interpolation weights) is computed per image on the host. So an image's features have the same bits whichever other
images share the call.

Those per-grid host tensors are kept (``functools.lru_cache`` by grid, ``GRID_CACHE`` grids): images of one size
are common, and building them took a dozen to a hundred small torch calls per image at every tower call. They are
pure functions of the grid and shared between calls, so callers must not write to them.
"""

import functools
import math

import torch
from torch import nn

from lockstep.layers.kernels import Kernels
from lockstep.layers.linear import Linear
from lockstep.models.multimodal import VisionConfig

Grid = tuple[int, int, int]
GRID_CACHE = 256  # grids whose host tensors are kept, per function


class Weights(nn.Module):
    """A module holding just a ``weight`` (and optionally a ``bias``) under the checkpoint's names."""

    def __init__(self, shape: tuple[int, ...], bias: int | None, dtype: torch.dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(bias, dtype=dtype, device=device), requires_grad=False) if bias else None


class PatchEmbed(nn.Module):
    """The patch embedding: a Conv3d whose kernel equals its stride, i.e. one linear map of each flattened
    ``C x T x P x P`` patch (the layout the image processor flattens it in), through the kernel set's ``linear``.
    The weight keeps the checkpoint's ``[D, C, T, P, P]`` shape."""

    def __init__(self, config: VisionConfig, bias: bool, kernels: Kernels, dtype: torch.dtype, device):
        super().__init__()
        c = config
        shape = (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = Weights(shape, c.hidden_size if bias else None, dtype, device)
        self.kernels = kernels

    def flat_weight(self) -> torch.Tensor:
        """``[D, C*T*P*P]``, a view of the weight kept between calls (the linear's packed CPU copy and its CUDA
        descriptor are kept on the tensor it is given, which a fresh view each call would throw away). A weight
        that requires grad (a trainer's) gets a fresh view each call: a kept one would carry one graph's node into
        the next."""
        w = self.proj.weight
        if w.requires_grad:
            return w.view(w.shape[0], -1)
        flat = getattr(self, "_flat", None)
        if flat is None or flat._base is not w or flat.data_ptr() != w.data_ptr():
            flat = self._flat = w.view(w.shape[0], -1)
        return flat

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # pixels: [num_patches, C*T*P*P] -> [num_patches, hidden]
        w = self.flat_weight()
        return self.kernels.linear(pixels.to(w.dtype), w, self.proj.bias)


class VisionRotary(nn.Module):
    """The 2-D rotary embedding: the first half of a head's frequencies rotate by the patch's row, the second half
    by its column (transformers' axial rope, ``head_dim // 4`` frequencies of ``head_dim // 2``, each for h and w).

    cos/sin come from an fp32 table on the host, grown in blocks of ``_BLOCK`` positions that are always computed
    with the same shape, so an entry's bits never depend on how large the table has grown.
    """

    _BLOCK = 256

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        spatial = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.int64).float() / spatial))
        self.cos = torch.empty(0, spatial // 2)
        self.sin = torch.empty(0, spatial // 2)
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # copies of the tables

    def _tables(self, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        while self.cos.shape[0] < size:
            start = self.cos.shape[0]
            freqs = torch.arange(start, start + self._BLOCK, dtype=torch.int64).float()[:, None] * self.inv_freq
            self.cos = torch.cat([self.cos, freqs.cos()])
            self.sin = torch.cat([self.sin, freqs.sin()])
            self._on_device.clear()
        if device not in self._on_device:
            self._on_device[device] = (self.cos.to(device), self.sin.to(device))
        return self._on_device[device]

    def forward(self, pos_hw: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``pos_hw: [n, 2]`` int64 (row, column) on the host -> fp32 ``(cos, sin)`` on ``device``, each
        ``[n, 1, head_dim]``."""
        device = torch.device(device)
        cos, sin = self._tables(int(pos_hw.max()) + 1 if pos_hw.numel() else 0, device)
        pos = pos_hw.to(device)

        def gather(table: torch.Tensor) -> torch.Tensor:
            half = torch.cat([table[pos[:, 0]], table[pos[:, 1]]], dim=-1)  # [n, head_dim // 2]
            return torch.cat([half, half], dim=-1)[:, None, :]

        return gather(cos), gather(sin)


class VisionAttention(nn.Module):
    """Multi-head attention of a vision block: fused qkv (``qkv``, bias), the 2-D rotary in fp32 as transformers
    applies it, bidirectional attention within each segment, the output projection (``proj``)."""

    def __init__(self, config: VisionConfig, kernels: Kernels, dtype: torch.dtype, device):
        super().__init__()
        d = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = Linear(d, 3 * d, True, kernels, dtype, device)
        self.proj = Linear(d, d, True, kernels, dtype, device)
        self.kernels = kernels

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor):
        # x: [n, hidden] -> qkv: [n, 3, heads, head_dim]
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        rq, rk = self.kernels.rotary(q.float(), k.float(), *rope)
        out = self.kernels.vision_attention(
            rq.to(x.dtype), rk.to(x.dtype), v, cu_seqlens, self.head_dim**-0.5
        )  # [n, heads, head_dim]
        return self.proj(out.reshape(n, -1))


def check_vision_kernels(kernels: Kernels) -> None:
    missing = [name for name in ("layer_norm", "gelu", "vision_attention") if getattr(kernels, name) is None]
    if missing:
        raise ValueError(f"kernel set {kernels.name!r} has no vision ops ({', '.join(missing)})")


def grids_of(grid_thw: torch.Tensor) -> list[Grid]:
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw must be [num_images, 3], got {tuple(grid_thw.shape)}")
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def check_pixels(pixel_values: torch.Tensor, grids: list[Grid], config: VisionConfig) -> None:
    merge = config.spatial_merge_size
    total = sum(t * h * w for t, h, w in grids)
    if pixel_values.dim() != 2 or pixel_values.shape != (total, config.patch_dim):
        raise ValueError(
            f"pixel_values must be [{total}, {config.patch_dim}] for grids {grids}, got {tuple(pixel_values.shape)}"
        )
    for g in grids:
        if min(g) <= 0 or g[1] % merge or g[2] % merge:
            raise ValueError(f"image grid {g} must be positive with h and w multiples of the merge size {merge}")


def patch_positions(grids: list[Grid], merge: int) -> torch.Tensor:
    """``[total_patches, 2]`` int64 (row, column) of every patch, in the processor's merge-block order."""
    return torch.cat([image_patch_positions(g, merge) for g in grids])


@functools.lru_cache(maxsize=GRID_CACHE)
def image_patch_positions(grid: Grid, merge: int) -> torch.Tensor:
    """One image's ``[t*h*w, 2]`` (shared: do not modify)."""
    t, h, w = grid
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    # [h, w] -> [h / m, m, w / m, m] -> blocks row-major, then the block's patches row-major
    block = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(block).transpose(1, 2).flatten()
    cols = cols.reshape(block).transpose(1, 2).flatten()
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def frame_segments(grids: list[Grid], device) -> torch.Tensor:
    """``cu_seqlens`` int32 with one segment per frame of each image (``h * w`` patches)."""
    lengths = [h * w for t, h, w in grids for _ in range(t)]
    return cumulative(lengths, device)


def cumulative(lengths: list[int], device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def split_by_image(x: torch.Tensor, grids: list[Grid], merge: int) -> list[torch.Tensor]:
    """Rows of merged tokens ``[total_tokens, ...]`` split into one tensor per image."""
    return list(torch.split(x, [math.prod(g) // merge**2 for g in grids]))
