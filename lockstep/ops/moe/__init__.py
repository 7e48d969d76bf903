"""Batch-invariant mixture-of-experts: routing, the grouped expert matmuls, and the combine.

The contract, as for every op here: a token's output bits depend only on the token and the weights.

- ``route``: softmax of the router logits in fp32, then the top k by probability with ties broken by the lowest
  expert id, made explicit (CUDA: one Triton program per token takes k rounds of "the largest, lowest id among
  equals"; CPU: ``ops.softmax``, then each probability packed with its expert id into one unique int64 key, so
  ``torch.topk`` has no ties to break). The top-k weights are renormalised (when the model asks) by a sum taken
  left to right in rank order.
- ``experts``: the (token, expert) pairs are sorted by expert (a stable sort) and each expert's rows multiplied by
  its weights: ``silu(x W_gate) * (x W_up)``, then ``W_down``. A row's value never depends on how many rows share
  its expert: every output element is accumulated over K from k = 0 upward, BK at a time, in one fp32
  accumulator, with a tile chosen from shapes alone (``moe_config``); rows are independent inside a tile.
- the k expert outputs of a token are combined in fp32 in rank order (``_combine``): never atomics, never the
  order of the sort.
No capacity factor: no token is ever dropped (that would make a token depend on its neighbours).

Under tensor parallelism the experts are split along their intermediate dimension I, and each routed pair's down
projection (a reduction over I) goes through the chunk tree of ``ops.tp_linear``: ``down_roots`` gives a rank's
fp32 subtree roots, one row per routed pair, and ``experts_tree`` is the whole tree in one process. A pair's output
then has the same bits at every TP size; it is rounded to the model dtype where ``experts`` rounds it, before the
combine.

CUDA runs Triton kernels throughout: the routing plan and tile table (two launches, ``plan_routing_triton``; the
torch plan past ``FUSED_PLAN_MAX_PAIRS``), a grouped matmul over tiles of sorted rows (twice; the first fuses
silu-and-mul) and the combine. The launch grids are sized from shapes (an upper bound on the number of row
tiles); programs past the last real tile do nothing, so a decode step can be captured in a CUDA graph. The CPU runs
each expert's rows through ``ops.linear`` (fixed row tiles) and the CPU ``silu_and_mul``, both row-invariant.

The package, in the order a layer runs: ``routing`` (``route``), ``plan`` (the sorted pairs and the tile table),
``grouped_mm`` (the Triton grouped matmul and its shape-only tile choice), ``combining`` (``combine``), ``layer``
(``experts`` on either device, ``experts_reference``), ``tree`` (the chunk tree over I for tensor parallelism).
"""

from lockstep.ops.moe.combining import combine
from lockstep.ops.moe.grouped_mm import MoEConfig, moe_config
from lockstep.ops.moe.layer import expert_weight, experts, experts_reference
from lockstep.ops.moe.plan import (
    FUSED_PLAN_MAX_PAIRS,
    RoutingPlan,
    plan_routing,
    plan_routing_torch,
    plan_routing_triton,
    tile_table,
    tile_table_torch,
    tile_table_triton,
)
from lockstep.ops.moe.routing import renormalize_in_order, route, top_k_lowest_id
from lockstep.ops.moe.tree import down_roots, experts_tree

__all__ = [
    "FUSED_PLAN_MAX_PAIRS", "MoEConfig", "RoutingPlan", "combine", "down_roots", "expert_weight", "experts",
    "experts_reference", "experts_tree", "moe_config", "plan_routing", "plan_routing_torch", "plan_routing_triton",
    "renormalize_in_order", "route", "tile_table", "tile_table_torch", "tile_table_triton", "top_k_lowest_id",
]  # fmt: skip
