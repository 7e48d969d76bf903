"""Rotary position embedding, computed exactly as Hugging Face computes it so that logits match.

cos/sin come from one fp32 table built once on the CPU for every position, then rounded to the model dtype and
moved to the device: a token's rotation is a lookup, the same bits whatever batch it arrives in and on every
device. Applying it is elementwise multiplies and adds in the model dtype, in HF's order.
"""

import math

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """``[head_dim // 2]`` fp32 inverse frequencies for rope type default / linear / llama3 (HF's formulas)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise ValueError(f"unsupported rope type {rope_type!r}; lockstep supports {', '.join(ROPE_TYPES)}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict | None,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        # freqs: [max_position, head_dim // 2]; HF multiplies the same fp32 operands, so the products match.
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos().to(dtype).to(device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype).to(device), persistent=False)

    @property
    def max_position(self) -> int:
        return self.cos.shape[0]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions: [num_tokens]`` -> ``(cos, sin)``, each ``[num_tokens, 1, head_dim]`` in the model dtype."""
        cos = self.cos[positions]  # [num_tokens, head_dim // 2]
        sin = self.sin[positions]
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x: [num_tokens, heads, head_dim]``: queries, keys, or both side by side."""
        return x * cos + _rotate_half(x) * sin
