"""Token embedding and the LM head. A row gather is exact, so the embedding needs no invariant kernel; the head
is a matmul over the vocabulary and goes through the kernel set.

Under tensor parallelism both are vocab-parallel: rank r holds vocabulary rows ``[start, stop)`` of a
``ceil(vocab / N)``-row slice (``distributed.vocab_range``). The embedding looks up the tokens it owns, zeroes
the others and sums over ranks exactly (``TPGroup.sum_disjoint``: one rank holds each row); the head computes
its slice of the logits and all-gathers them. Neither moves a bit.
"""

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.distributed import Shard, TPGroup, vocab_range

if TYPE_CHECKING:
    from lockstep.layers.kernels import Kernels


class VocabEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        self.tp = tp or TPGroup()
        self.vocab_size = vocab_size
        self.start, self.stop, rows = vocab_range(vocab_size, self.tp.size, self.tp.rank)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.data[self.stop - self.start :].zero_()  # padding rows of a short last slice

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, hidden_size]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.stop - self.start)
        rows = F.embedding(local.masked_fill(~mine, 0), self.weight).masked_fill_(~mine[:, None], 0.0)
        return self.tp.sum_disjoint(rows)

    def shard_of(self, param_name: str, part: int | None) -> Shard | None:
        return Shard(0, self.start, self.stop, self.vocab_size) if self.tp.size > 1 else None


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
        tp: TPGroup | None = None,
    ):
        super().__init__()
        self.kernels = kernels
        self.tp = tp or TPGroup()
        self.vocab_size = vocab_size
        self.start, self.stop, rows = vocab_range(vocab_size, self.tp.size, self.tp.rank)
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype, device=device), requires_grad=False)
            self.weight.data[self.stop - self.start :].zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [n, hidden_size] -> logits: [n, vocab_size] fp32
        logits = self.kernels.linear(hidden, self.weight, None)  # [n, rows]: this rank's vocabulary slice
        if self.tp.size > 1:
            # [N, n, rows] -> [n, N * rows], the padding of the last slice cut off
            gathered = self.tp.all_gather(logits)
            logits = gathered.permute(1, 0, 2).reshape(hidden.shape[0], -1)[:, : self.vocab_size]
        return logits.float()

    def shard_of(self, param_name: str, part: int | None) -> Shard | None:
        return Shard(0, self.start, self.stop, self.vocab_size) if self.tp.size > 1 else None
