"""Token embedding and the LM head. A row gather is exact, so the embedding needs no invariant kernel; the head
is a matmul over the vocabulary and goes through the kernel set."""

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from lockstep.layers.kernels import Kernels


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, hidden_size]
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Hidden states to fp32 logits. With tied embeddings it shares the embedding's weight tensor."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        kernels: "Kernels",
        dtype: torch.dtype,
        device: torch.device | str,
        tied_to: VocabEmbedding | None = None,
    ):
        super().__init__()
        self.kernels = kernels
        self.weight = (
            tied_to.weight
            if tied_to is not None
            else nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [n, hidden_size] -> logits: [n, vocab_size] fp32
        return self.kernels.linear(hidden, self.weight, None).float()
