"""Rotary position embedding, computed exactly as Hugging Face computes it so that logits match.

cos/sin come from one fp32 table built once on the CPU for every position, then rounded to the model dtype and
moved to the device: a token's rotation is a lookup, the same bits whatever batch it arrives in and on every
device. Applying it (the kernel set's ``rotary``, ``ops.rotary``) is elementwise multiplies and adds in the model
dtype, in HF's order.
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


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary embedding (M-RoPE, Qwen2.5-VL and Qwen3-VL): a position has three components (t, h, w)
    and frequency ``j`` of a head rotates by component ``components[j]`` (``MultimodalConfig.mrope_components``).

    cos/sin come from the 1-D table, gathered per frequency from the row of that frequency's component: a row whose
    three components are equal reads exactly the entries the 1-D lookup reads, so text rows, and every decode
    step, have the same bits whether their positions arrive as ``[n]`` or as ``[3, n]``.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        components: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__(head_dim, max_position, theta, None, dtype, device)
        if len(components) != head_dim // 2 or not set(components) <= {0, 1, 2}:
            raise ValueError(f"M-RoPE needs a component in (0, 1, 2) for each of {head_dim // 2} frequencies")
        self.register_buffer("components", torch.tensor(components, device=device), persistent=False)
        self.register_buffer("freq_index", torch.arange(head_dim // 2, device=device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions: [num_tokens]`` or ``[3, num_tokens]`` -> ``(cos, sin)``, each ``[num_tokens, 1, head_dim]``."""
        if positions.dim() == 1:
            return super().forward(positions)
        # rows[i, j]: the table row frequency j of token i reads, its component's position.
        rows = positions[self.components].T  # [num_tokens, head_dim // 2]
        cos = self.cos[rows, self.freq_index]
        sin = self.sin[rows, self.freq_index]
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]
