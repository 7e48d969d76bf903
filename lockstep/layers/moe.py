"""The sparse mixture-of-experts block that replaces the gated MLP in Qwen3-MoE and Mixtral layers.

A router (a linear layer, ``gate``) scores the experts for every token; each token runs through its top k experts'
gated MLPs and their outputs are added, weighted by the router's probabilities. The arithmetic is the kernel
set's (``Kernels.moe_route``, ``Kernels.moe_experts``): on ``invariant``, ``ops.moe``, whose bits for a token do not
depend on the other tokens of the batch or on how many of them chose the same experts.

The experts' weights are held stacked, ``w13: [E, 2I, H]`` (each expert's gate then up projection) and
``w2: [E, H, I]``; ``checkpoint_entries`` maps the checkpoint's per-expert matrices onto slices of them.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from lockstep.layers.linear import Linear

if TYPE_CHECKING:
    from lockstep.layers.kernels import Kernels


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names the block's tensors: ``{block}.gate.weight``, ``{block}.experts.{e}.{gate}.weight``."""

    block: str
    gate: str
    up: str
    down: str


QWEN3_MOE_NAMES = ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
MIXTRAL_NAMES = ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        names: ExpertNames,
        kernels: "Kernels",
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__()
        if kernels.moe_route is None or kernels.moe_experts is None:
            raise ValueError(f"kernel set {kernels.name!r} has no mixture-of-experts ops (moe_route, moe_experts)")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.names = names
        self.kernels = kernels
        self.gate = Linear(hidden_size, num_experts, False, kernels, dtype, device)
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden] -> router logits [num_tokens, E] (model dtype, as HF) -> [num_tokens, hidden]
        logits = self.gate(x)
        weights, ids = self.kernels.moe_route(logits, self.top_k, self.renormalize)  # [num_tokens, k] each
        return self.kernels.moe_experts(x, self.w13, self.w2, weights, ids)

    def checkpoint_entries(self, layer_prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        """``(checkpoint name, destination)`` for every tensor of this block in layer ``layer_prefix``."""
        n = self.names
        prefix = f"{layer_prefix}.{n.block}"
        i = self.intermediate_size
        yield f"{prefix}.gate.weight", self.gate.weight.detach()
        w13, w2 = self.w13.detach(), self.w2.detach()
        for e in range(self.num_experts):
            yield f"{prefix}.experts.{e}.{n.gate}.weight", w13[e, :i]
            yield f"{prefix}.experts.{e}.{n.up}.weight", w13[e, i:]
            yield f"{prefix}.experts.{e}.{n.down}.weight", w2[e]
