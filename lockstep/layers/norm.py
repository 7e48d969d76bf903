"""RMSNorm with an optional fused residual add, rounded like Hugging Face's ``LlamaRMSNorm``."""

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from lockstep.layers.kernels import Kernels


def torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch's fused ``F.rms_norm`` with HF's rounding: normalize in fp32, round to the input dtype, then scale.

    With ``residual`` it returns ``(rms_norm(x + residual), x + residual)``, the sum taken in the input dtype.
    """
    if residual is not None:
        x = x + residual
    out = weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return out if residual is None else (out, x)


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
