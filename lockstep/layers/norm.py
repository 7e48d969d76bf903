"""RMSNorm with an optional fused residual add, rounded like Hugging Face's ``LlamaRMSNorm``."""

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from lockstep.layers.kernels import Kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: "Kernels", dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [..., dim]. Returns rms_norm(x), or (rms_norm(x + residual), x + residual).
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)
