"""Linear layers, optionally several checkpoint matrices stacked into one (q/k/v, gate/up): one matmul instead
of three reads the activations once and launches once.

Under tensor parallelism (Megatron's layout) a ``Linear`` is column-parallel: it holds this rank's output rows of
each stacked matrix and needs no communication. A ``RowParallelLinear`` holds this rank's input columns and
combines the ranks' partial sums: through the chunk tree (``ops.tp_linear``), whose bits do not depend on the
number of ranks, or, in the non-invariant fast mode, through a plain all-reduce.

FP8 layers (``models.quantization``) hold an e4m3 ``weight`` with row scales ``weight_scale`` and run
``ops.fp8.fp8_linear``; a row-parallel one runs the FP8 chunk tree (``ops.fp8_tree``) instead, its per-token
activation scales taken over the whole row (the ranks' maxima all-gathered). A trainer's FP8 layer
(``quantization.train_fp8``) holds a full-precision master ``weight`` and ``fp8_train``, which quantizes it as the
sampler holds it, and runs ``ops.autograd.fp8_linear``: the sampler's forward bits, a straight-through backward.
"""

from typing import TYPE_CHECKING

import torch
from torch import nn

from lockstep.distributed import Shard, TPGroup, split_evenly
from lockstep.ops import autograd, fp8_tree, tp_linear
from lockstep.ops.fp8 import FP8, scaled_mm

if TYPE_CHECKING:
    from lockstep.layers.kernels import Kernels


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight: [sum(out_parts), in_features]``.

    ``out_parts`` lists the output widths of the checkpoint matrices stacked into this one, in order;
    ``load(tensor, part)`` copies one of them in. Column-parallel: ``part_shards`` names, per part, the rows of
    the checkpoint matrix this rank holds (None: the whole matrices).
    """

    fp8_train = None  # a trainer's FP8 layer: models.quantization.Fp8Train (set by quantization.train_fp8)

    def __init__(
        self,
        in_features: int,
        out_parts: int | tuple[int, ...],
        bias: bool,
        kernels: "Kernels",
        dtype: torch.dtype,
        device: torch.device | str,
        part_shards: tuple[Shard, ...] | None = None,
    ):
        super().__init__()
        self.out_parts = (out_parts,) if isinstance(out_parts, int) else tuple(out_parts)
        if part_shards is not None and [s.stop - s.start for s in part_shards] != list(self.out_parts):
            raise ValueError(f"part shards {part_shards} do not match the output widths {self.out_parts}")
        self.part_shards = part_shards
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
        if self.weight.dtype == FP8:  # an FP8 layer (models/quantization.py): e4m3 weight, weight_scale, act_group
            return self.kernels.fp8_linear(x, self.weight, self.weight_scale, self.bias, self.act_group)
        if self.fp8_train is not None:  # a trainer's FP8 layer: the master weight, quantized
            w8, scale = self.fp8_train.quantize(self.weight.detach())
            return autograd.fp8_linear(x, self.weight, self.bias, w8, scale, self.act_group)
        return self.kernels.linear(x, self.weight, self.bias)

    def part_slice(self, part: int) -> slice:
        start = sum(self.out_parts[:part])
        return slice(start, start + self.out_parts[part])

    def shard_of(self, param_name: str, part: int | None) -> Shard | None:
        """The slice of the checkpoint tensor behind ``param_name`` (and stacked ``part``) this rank holds."""
        return None if self.part_shards is None or part is None else self.part_shards[part]


class RowParallelLinear(nn.Module):
    """``y = x @ weight.T + bias`` with K = ``in_features`` split over the ranks of ``tp``: this rank holds
    ``weight[:, its K slice]`` and the whole bias, takes ``x: [num_tokens, in_features / tp.size]`` and returns
    the full ``[num_tokens, out_features]`` on every rank.

    With ``tree`` the reduction is the chunk tree (``ops.tp_linear``; rank r of N owns chunks
    ``[8r / N, 8(r + 1) / N)``), the same bits at every TP size including one process. Without it: the kernel
    set's linear, plus an all-reduce of the partial sums when ``tp.size > 1`` (not invariant).
    """

    fp8_train = None  # as Linear's

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        kernels: "Kernels",
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TPGroup,
        tree: bool,
    ):
        super().__init__()
        start, stop = split_evenly(in_features, tp.size, tp.rank, "the row-parallel input size")
        if tree and tp_linear.CHUNKS % tp.size:
            raise ValueError(f"the chunk tree needs a tensor-parallel size dividing {tp_linear.CHUNKS}, not {tp.size}")
        if tree and tp.size > 1 and in_features % tp_linear.CHUNKS:
            raise ValueError(f"a row-parallel input size of {in_features} is not a multiple of {tp_linear.CHUNKS}")
        self.kernels = kernels
        self.tp = tp
        self.tree = tree
        self.shard = Shard(1, start, stop, in_features) if tp.size > 1 else None
        self.weight = nn.Parameter(
            torch.empty(out_features, stop - start, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features / tp.size] -> [num_tokens, out_features]
        if self.weight.dtype == FP8:
            return self._fp8_forward(x)
        if self.fp8_train is not None:  # a trainer's FP8 layer (one process)
            w8, scale = self.fp8_train.quantize(self.weight.detach())
            return autograd.fp8_linear(x, self.weight, self.bias, w8, scale, self.act_group, tree=self.tree)
        if self.tree and self.tp.size == 1:
            return self.kernels.tree_linear(x, self.weight, self.bias)  # the whole tree (with autograd: RL)
        if self.tree:
            root = tp_linear.subtree(x, self.weight, tp_linear.CHUNKS // self.tp.size)  # [num_tokens, out] fp32
            return tp_linear.tree_finish(self.tp.all_gather(root), self.bias, x.dtype)
        if self.tp.size == 1:
            return self.kernels.linear(x, self.weight, self.bias)
        # The bias goes in once, on rank 0, before the sum.
        partial = self.kernels.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(partial)

    def _fp8_forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features / tp.size] -> [num_tokens, out_features]; weight e4m3, weight_scale [N, KB]
        if self.tp.size == 1 and not self.tree:
            return self.kernels.fp8_linear(x, self.weight, self.weight_scale, self.bias, self.act_group)
        amax = None
        if self.act_group is None:  # one scale per token over all of K: every rank's columns
            amax = fp8_tree.row_amax(x)
            if self.tp.size > 1:
                amax = self.tp.all_gather(amax).amax(0)
        a8, a_scale = fp8_tree.activation_scales(x, self.act_group, amax)
        if not self.tree:  # the fast mode: partial sums, all-reduced (not invariant)
            bias = self.bias if self.tp.rank == 0 else None
            return self.tp.all_reduce(scaled_mm(a8, a_scale, self.weight, self.weight_scale, bias, x.dtype))
        root = fp8_tree.subtree(a8, a_scale, self.weight, self.weight_scale, tp_linear.CHUNKS // self.tp.size)
        return tp_linear.tree_finish(self.tp.all_gather(root), self.bias, x.dtype)

    def shard_of(self, param_name: str, part: int | None) -> Shard | None:
        return self.shard if param_name == "weight" else None
