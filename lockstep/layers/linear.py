"""Linear layers, optionally several checkpoint matrices stacked into one (q/k/v, gate/up): one matmul instead
of three reads the activations once and launches once."""

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from lockstep.layers.kernels import Kernels


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight: [sum(out_parts), in_features]``.

    ``out_parts`` lists the output widths of the checkpoint matrices stacked into this one, in order;
    ``load(tensor, part)`` copies one of them in.
    """

    def __init__(
        self,
        in_features: int,
        out_parts: int | tuple[int, ...],
        bias: bool,
        kernels: "Kernels",
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__()
        self.out_parts = (out_parts,) if isinstance(out_parts, int) else tuple(out_parts)
        self.kernels = kernels
        out_features = sum(self.out_parts)
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        return self.kernels.linear(x, self.weight, self.bias)

    def part_slice(self, part: int) -> slice:
        start = sum(self.out_parts[:part])
        return slice(start, start + self.out_parts[part])
