"""``experts``: the whole routed-expert layer (plan, the two grouped matmuls, the combine) on either device, and
``experts_reference``, its plain-torch counterpart without the contract."""

import torch

from lockstep.layers.activation import silu_and_mul
from lockstep.ops._common import FLOATS
from lockstep.ops.matmul import linear
from lockstep.ops.moe.combining import _combine_cpu, combine
from lockstep.ops.moe.grouped_mm import MoEConfig, _grouped_mm, moe_config
from lockstep.ops.moe.plan import FUSED_PLAN_MAX_PAIRS, plan_routing, plan_routing_triton


def _check_experts(x, w13, w2, weights, ids) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"expected x [n, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, {tuple(w13.shape)}, "
            f"{tuple(w2.shape)}"
        )
    num_experts, two_i, hidden = w13.shape
    if two_i % 2 or x.shape[1] != hidden or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"expert weights do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(f"weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both be [{x.shape[0]}, k]")
    if x.dtype != w13.dtype or x.dtype != w2.dtype or x.dtype not in FLOATS:
        raise TypeError(f"expected matching float32/bfloat16/float16 tensors, got {x.dtype}, {w13.dtype}, {w2.dtype}")


def _experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    config: MoEConfig | tuple[MoEConfig, MoEConfig] | None = None,
) -> torch.Tensor:
    # config (benches and tests): one tile for both matmuls, or (gate/up's, down's); None: moe_config's.
    num_experts, two_i, hidden = w13.shape
    num_pairs = ids.numel()
    if config is None:
        cfg1 = moe_config(num_pairs, num_experts, two_i // 2, hidden, x.dtype)
        cfg2 = moe_config(num_pairs, num_experts, hidden, two_i // 2, x.dtype)
    else:
        cfg1, cfg2 = config if isinstance(config, tuple) else (config, config)
    # The fused plan (the torch one past FUSED_PLAN_MAX_PAIRS); cfg2 shares the tile table when its BM is the same.
    if num_pairs <= FUSED_PLAN_MAX_PAIRS:
        plan = plan_routing_triton(ids, num_experts, cfg1.bm)
    else:
        plan = plan_routing(ids, num_experts, cfg1.bm)
    act = _grouped_mm(x, plan.tokens, w13, plan, cfg1, silu_mul=True)  # [P, I], sorted rows
    y = _grouped_mm(act, None, w2, plan, cfg2, silu_mul=False)  # [P, H], sorted rows
    return combine(y, weights.float(), plan.rows.view(ids.shape))


_VIEWS_ATTR = "_lockstep_expert_views"


def expert_weight(w: torch.Tensor, e: int) -> torch.Tensor:
    """``w[e]``, the same view object every call, so the CPU matmul's packed copy of it (``_cpu_weight``) is kept."""
    key = (w.data_ptr(), tuple(w.shape), w.dtype)
    cached = getattr(w, _VIEWS_ATTR, None)
    if cached is None or cached[0] != key:
        cached = (key, [w.detach()[i] for i in range(w.shape[0])])
        try:
            setattr(w, _VIEWS_ATTR, cached)
        except (AttributeError, RuntimeError):  # a tensor that takes no attributes: a fresh view each call
            return w.detach()[e]
    return cached[1][e]


def _experts_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    num_experts = w13.shape[0]
    plan = plan_routing(ids, num_experts)
    bounds = plan.bounds.tolist()
    y = x.new_empty((plan.order.numel(), x.shape[1]))
    for e in range(num_experts):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            rows = x[plan.tokens[start:end]]  # [n_e, H]
            act = silu_and_mul(linear(rows, expert_weight(w13, e)))
            y[start:end] = linear(act, expert_weight(w2, e))
    return _combine_cpu(y, weights.float(), plan.rows.view(ids.shape))


def experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The routed expert MLPs, batch-invariant: ``x: [n, H]``, ``w13: [E, 2I, H]`` (each expert's gate and up
    projections stacked), ``w2: [E, H, I]``, ``weights: [n, k]`` and ``ids: [n, k]`` from ``route`` ->
    ``sum_j weights[:, j] * down_j(silu(gate_j(x)) * up_j(x))``: ``[n, H]`` in x's dtype."""
    _check_experts(x, w13, w2, weights, ids)
    if x.is_cuda:
        return _experts_triton(x, w13, w2, weights, ids)
    return _experts_cpu(x, w13, w2, weights, ids)


def experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``experts`` in plain torch ops, differentiable, with no invariance contract: each expert's rows through
    ``F.linear`` (whose reduction follows the number of rows), the k outputs summed by ``torch.sum``. Reads the
    per-expert counts on the host. The ``torch`` kernel set's experts, and the recomputation behind the trainer's
    backward (deterministic run to run: every index it scatters through is a permutation, no atomics add up)."""
    num_tokens, top_k = ids.shape
    hidden = x.shape[1]
    plan = plan_routing(ids, w13.shape[0])
    bounds = plan.bounds.tolist()
    # x once per pair ([n, k, H] -> [P, H]: its gradient sums over k), then in sorted order (a permutation).
    sorted_x = x[:, None, :].expand(num_tokens, top_k, hidden).reshape(-1, hidden)[plan.order]
    outs = []
    for e in range(w13.shape[0]):
        if bounds[e + 1] > bounds[e]:
            gate, up = torch.nn.functional.linear(sorted_x[bounds[e] : bounds[e + 1]], w13[e]).chunk(2, dim=-1)
            outs.append(torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e]))
    y = torch.cat(outs) if outs else x.new_zeros((0, hidden))  # [P, H], sorted rows
    y = y[plan.rows].view(num_tokens, top_k, hidden)  # back in pair order (a permutation)
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for a float64 reference
    return (y.to(acc) * weights.to(acc)[:, :, None]).sum(1).to(x.dtype)
