"""The routed experts under tensor parallelism: each pair's down projection through ``ops.tp_linear``'s chunk
tree over I (``down_roots``, a rank's subtree roots; ``experts_tree``, the whole tree in one process)."""

import torch

from lockstep.layers.activation import silu_and_mul
from lockstep.ops import tp_linear
from lockstep.ops.matmul import linear
from lockstep.ops.moe.combining import combine
from lockstep.ops.moe.grouped_mm import _grouped_mm, moe_config
from lockstep.ops.moe.layer import _check_experts, expert_weight
from lockstep.ops.moe.plan import RoutingPlan, plan_routing


def _down_partials_cpu(x, w13, w2, plan: RoutingPlan, num_chunks: int) -> torch.Tensor:
    bounds = plan.bounds.tolist()
    partials = x.new_zeros((num_chunks, plan.order.numel(), x.shape[1]), dtype=torch.float32)
    for e in range(w13.shape[0]):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            act = silu_and_mul(linear(x[plan.tokens[start:end]], expert_weight(w13, e)))  # [n_e, I_local]
            partials[:, start:end] = tp_linear.chunk_partials(act, expert_weight(w2, e), num_chunks)
    return partials


def _down_partials_triton(x, w13, w2, plan: RoutingPlan, num_chunks: int) -> torch.Tensor:
    num_experts, two_i, hidden = w13.shape
    num_pairs = plan.order.numel()
    act = _grouped_mm(x, plan.tokens, w13, plan, moe_config(num_pairs, num_experts, two_i // 2, hidden, x.dtype), True)
    width = -(-act.shape[1] // num_chunks)
    pad = width * num_chunks - act.shape[1]
    if pad:  # zero columns of act and of w2: each chunk's sum gains exact zeros at its end
        act = torch.nn.functional.pad(act, (0, pad))
        w2 = torch.nn.functional.pad(w2, (0, pad))
    # Every chunk is `width` wide at every TP size, so the tile (and its K steps) is the same at every TP size.
    cfg = moe_config(num_pairs, num_experts, hidden, width, x.dtype)
    partials = act.new_empty((num_chunks, num_pairs, hidden), dtype=torch.float32)
    for c in range(num_chunks):
        cols = slice(c * width, (c + 1) * width)
        partials[c] = _grouped_mm(act[:, cols], None, w2[:, :, cols], plan, cfg, False, out_dtype=torch.float32)
    return partials


def down_roots(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, num_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every routed pair's down projection as the fp32 root of a subtree of the chunk tree over I.

    ``x: [n, H]``, ``w13: [E, 2I', H]`` and ``w2: [E, H, I']`` (a rank's I' = I / N columns of every expert, or
    all of them), ``ids: [n, k]`` -> ``(roots fp32 [P, H] in sorted-row order, rows int64 [n, k])``, ``rows`` as
    ``combine`` takes them. I' is cut into ``num_chunks`` chunks (``8 / N`` on each of N ranks; 8 in one process,
    zero-padded when 8 does not divide I), each accumulated in fp32 and the chunks summed by ``tp_linear``'s
    pairwise tree. The ranks' roots, all-gathered in rank order and passed through ``tp_linear.tree_reduce``,
    are the one-process roots bit for bit.
    """
    _check_experts(x, w13, w2, ids, ids)
    if num_chunks not in (1, 2, 4, 8):
        raise ValueError(f"num_chunks must be 1, 2, 4 or 8, got {num_chunks}")
    plan = plan_routing(ids, w13.shape[0])
    if x.is_cuda:
        partials = _down_partials_triton(x, w13, w2, plan, num_chunks)
    else:
        partials = _down_partials_cpu(x, w13, w2, plan, num_chunks)
    return tp_linear.tree_reduce(partials), plan.rows.view(ids.shape)


def experts_tree(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``experts`` with each pair's down projection reduced through the whole chunk tree (``down_roots`` over 8
    chunks), rounded to x's dtype, then combined in rank order: the bits N ranks holding I / N each compute."""
    _check_experts(x, w13, w2, weights, ids)
    roots, rows = down_roots(x, w13, w2, ids, tp_linear.CHUNKS)
    return combine(roots.to(x.dtype), weights.float(), rows)
