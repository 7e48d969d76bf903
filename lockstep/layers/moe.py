"""The sparse mixture-of-experts block that replaces the gated MLP in Qwen3-MoE and Mixtral layers.

A router (a linear layer, ``gate``) scores the experts for every token; each token runs through its top k experts'
gated MLPs and their outputs are added, weighted by the router's probabilities. The arithmetic is the kernel
set's (``Kernels.moe_route``, ``Kernels.moe_experts``): on ``invariant``, ``ops.moe``, whose bits for a token do not
depend on the other tokens of the batch or on how many of them chose the same experts.

The experts' weights are held stacked, ``w13: [E, 2I, H]`` (each expert's gate then up projection) and
``w2: [E, H, I]``; ``checkpoint_entries`` maps the checkpoint's per-expert matrices onto slices of them.

Under tensor parallelism (``tp`` of N ranks) every expert is split along I, as the dense MLP is: a rank holds its
I / N rows of each expert's gate and up projections and its I / N columns of each down projection; the router is
replicated. With ``tree`` (``tp_invariant``) each routed pair's down projection, a reduction over I, goes through
the chunk tree (``ops.moe.down_roots``): the ranks all-gather their fp32 subtree roots and each finishes the tree,
rounds every pair's output to the model dtype and combines a token's k outputs in rank order, so the result has
the same bits at TP 1, 2, 4 and 8. Without ``tree`` at N > 1 (the fast mode) the ranks' combined partial outputs
are summed by an all-reduce, whose order follows the rank count and the message size.

FP8 experts (``models.quantization``) hold e4m3 ``w13``/``w2`` with row scales ``w13_scale``/``w2_scale``, sharded
with them, and run ``ops.moe_fp8`` (with ``tree``: ``ops.moe_fp8_tree``, the same tree over FP8 partials). A rank
whose I slice cuts 128-column scale blocks (Qwen3-30B-A3B's 768 at TP 4 and 8) holds the scales of the blocks it
shares and gathers the activations' group maxima with the other ranks. A
trainer's FP8 experts hold full-precision masters and ``fp8_train``, which quantizes them as the sampler holds them
(``ops.autograd.moe_experts_fp8``: the sampler's forward bits, a straight-through backward).
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from lockstep.distributed import Shard, TPGroup, split_evenly
from lockstep.layers.linear import Linear
from lockstep.ops import autograd, tp_linear
from lockstep.ops import moe as moe_ops
from lockstep.ops.fp8 import FP8, GROUP_K
from lockstep.ops.moe_fp8 import experts_fp8
from lockstep.ops.moe_fp8_tree import down_roots_fp8, experts_fp8_tree

if TYPE_CHECKING:
    from lockstep.layers.kernels import Kernels


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names the block's tensors: ``{block}.gate.weight``, ``{block}.experts.{e}.{gate}.weight``."""

    block: str
    gate: str
    up: str
    down: str
    # The checkpoint holds every expert in two tensors, ``{block}.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows
    # first) and ``{block}.experts.down_proj`` ``[E, H, I]``, as transformers 5 keeps them (Qwen3-VL-MoE).
    fused: bool = False


QWEN3_MOE_NAMES = ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
MIXTRAL_NAMES = ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")
QWEN3_VL_MOE_NAMES = ExpertNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj", fused=True)


def per_expert_tensors(name: str, tensor: torch.Tensor, names: ExpertNames) -> list[tuple[str, torch.Tensor]] | None:
    """transformers 5 keeps a model's experts fused in memory, so its ``state_dict()`` (what an RL trainer syncs
    into the engine) names them ``{layer}.mlp.experts.gate_up_proj`` (``[E, 2I, H]``, gate rows first) and
    ``{layer}.mlp.experts.down_proj`` (``[E, H, I]``), and Mixtral's router ``{layer}.mlp.gate.weight``; its
    ``save_pretrained`` writes the released per-expert names. The released names of one such tensor's parts (views),
    or None for a name that is not a fused one."""
    layer, _, leaf = name.rpartition(".mlp.")
    if not layer or names.fused:  # a fused checkpoint's names are the fused ones
        return None
    block = f"{layer}.{names.block}"
    if leaf == "gate.weight":
        return None if names.block == "mlp" else [(f"{block}.gate.weight", tensor)]
    if leaf not in ("experts.gate_up_proj", "experts.down_proj") or tensor.dim() != 3:
        return None
    if leaf == "experts.down_proj":
        return [(f"{block}.experts.{e}.{names.down}.weight", tensor[e]) for e in range(tensor.shape[0])]
    i = tensor.shape[1] // 2
    return [
        (f"{block}.experts.{e}.{proj}.weight", part)
        for e in range(tensor.shape[0])
        for proj, part in ((names.gate, tensor[e, :i]), (names.up, tensor[e, i:]))
    ]


class SparseMoeBlock(nn.Module):
    fp8_train = None  # a trainer's FP8 experts: models.quantization.Fp8ExpertsTrain (set by quantization.train_fp8)

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
        tp: TPGroup | None = None,
        tree: bool = False,
    ):
        super().__init__()
        if kernels.moe_route is None or kernels.moe_experts is None:
            raise ValueError(f"kernel set {kernels.name!r} has no mixture-of-experts ops (moe_route, moe_experts)")
        tp = tp or TPGroup()
        start, stop = split_evenly(intermediate_size, tp.size, tp.rank, "the experts' intermediate size")
        if tree and tp_linear.CHUNKS % tp.size:
            raise ValueError(f"the chunk tree needs a tensor-parallel size dividing {tp_linear.CHUNKS}, not {tp.size}")
        if tree and tp.size > 1 and intermediate_size % tp_linear.CHUNKS:
            raise ValueError(
                f"the experts' intermediate size {intermediate_size} is not a multiple of {tp_linear.CHUNKS}"
            )
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.names = names
        self.kernels = kernels
        self.tp, self.tree = tp, tree
        # This rank's I slice of every expert; None in one process (the whole of each tensor).
        self.shard = (start, stop) if tp.size > 1 else None
        local = stop - start
        self.gate = Linear(hidden_size, num_experts, False, kernels, dtype, device)
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * local, hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, local, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden] -> router logits [num_tokens, E] (model dtype, as HF) -> [num_tokens, hidden]
        logits = self.gate(x)
        weights, ids = self.kernels.moe_route(logits, self.top_k, self.renormalize)  # [num_tokens, k] each
        if self.w13.dtype == FP8:  # FP8 experts (models/quantization.py): w13_scale, w2_scale, act_group
            return self._fp8_forward(x, self.w13, self.w13_scale, self.w2, self.w2_scale, weights, ids)
        if self.fp8_train is not None:  # a trainer's FP8 experts (one process): the masters, quantized
            q = self.fp8_train.quantize(self.w13.detach(), self.w2.detach())
            return autograd.moe_experts_fp8(x, self.w13, self.w2, weights, ids, q, self.act_group, self.tree)
        if self.tree and self.tp.size == 1:
            return self.kernels.moe_experts_tree(x, self.w13, self.w2, weights, ids)  # with autograd: RL
        if self.tree:
            # roots: [P, H] fp32, one per routed pair (sorted rows), this rank's subtree then the whole tree.
            roots, rows = moe_ops.down_roots(x, self.w13, self.w2, ids, tp_linear.CHUNKS // self.tp.size)
            roots = tp_linear.tree_reduce(self.tp.all_gather(roots))
            return moe_ops.combine(roots.to(x.dtype), weights.float(), rows)
        return self.tp.all_reduce(self.kernels.moe_experts(x, self.w13, self.w2, weights, ids))  # no-op at N = 1

    def _fp8_forward(self, x, w13, s13, w2, s2, weights, ids) -> torch.Tensor:
        # This rank's columns of I; at TP 4 and 8 of Qwen3-30B-A3B's I = 768 (192 and 96 a rank) they cut
        # 128-column blocks, which the rank shares with its neighbour (both hold the block's scale).
        start = self.shard[0] if self.shard is not None else 0
        columns = (start, self.intermediate_size)
        cut = self.tp.size > 1 and (start % GROUP_K != 0 or w2.shape[2] % GROUP_K != 0)
        # Activation scales between the two matmuls that span the ranks' columns (per token: all of I; per group:
        # a group the ranks share) come from every rank's maxima.
        gather = None
        if self.tp.size > 1 and (self.act_group is None or cut):
            gather = lambda amax: self.tp.all_gather(amax).amax(0)  # noqa: E731
        if self.tree and self.tp.size == 1:
            return experts_fp8_tree(x, w13, s13, w2, s2, weights, ids, self.act_group)
        if self.tree:
            chunks = tp_linear.CHUNKS // self.tp.size
            roots, rows = down_roots_fp8(x, w13, s13, w2, s2, ids, self.act_group, chunks, gather, None, columns)
            roots = tp_linear.tree_reduce(self.tp.all_gather(roots))
            return moe_ops.combine(roots.to(x.dtype), weights.float(), rows)
        if cut and (s2.shape[2] > 1 or self.act_group is not None):
            # The fast mode where this rank's columns cut scale blocks: its down projection in pieces of one block.
            roots, rows = down_roots_fp8(x, w13, s13, w2, s2, ids, self.act_group, 1, gather, None, columns)
            return self.tp.all_reduce(moe_ops.combine(roots.to(x.dtype), weights.float(), rows))
        out = experts_fp8(x, w13, s13, w2, s2, weights, ids, self.act_group, gather)
        return self.tp.all_reduce(out)  # no-op at N = 1

    def checkpoint_entries(self, layer_prefix: str) -> Iterator[tuple[str, torch.Tensor, Shard | None]]:
        """``(checkpoint name, destination, shard)`` for every tensor of this block in layer ``layer_prefix``;
        ``shard`` names the slice of the checkpoint tensor this rank holds (None: all of it)."""
        n = self.names
        prefix = f"{layer_prefix}.{n.block}"
        i = self.w2.shape[2]
        full = self.intermediate_size
        gate_up = down = None
        if self.shard is not None:
            gate_up, down = Shard(0, *self.shard, full), Shard(1, *self.shard, full)
        yield f"{prefix}.gate.weight", self.gate.weight.detach(), None
        w13, w2 = self.w13.detach(), self.w2.detach()
        if n.fused:
            if self.shard is not None:
                raise ValueError("fused expert checkpoints are not supported under tensor parallelism yet")
            yield f"{prefix}.experts.gate_up_proj", w13, None
            yield f"{prefix}.experts.down_proj", w2, None
            return
        for e in range(self.num_experts):
            yield f"{prefix}.experts.{e}.{n.gate}.weight", w13[e, :i], gate_up
            yield f"{prefix}.experts.{e}.{n.up}.weight", w13[e, i:], gate_up
            yield f"{prefix}.experts.{e}.{n.down}.weight", w2[e], down
            if self.w13.dtype == FP8:  # and the row scales of FP8 experts, sharded as their weights' rows
                s13, s2 = self.w13_scale.detach(), self.w2_scale.detach()
                yield f"{prefix}.experts.{e}.{n.gate}.weight_scale", s13[e, :i], gate_up
                yield f"{prefix}.experts.{e}.{n.up}.weight_scale", s13[e, i:], gate_up
                yield f"{prefix}.experts.{e}.{n.down}.weight_scale", s2[e], None
