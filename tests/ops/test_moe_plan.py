"""The fused routing plan (``ops.moe.plan_routing_triton``, CUDA's: two Triton launches with grids sized from
shapes) against the torch plan (``plan_routing_torch``, the CPU path) through the interpreter: the plan is integer
arithmetic, so every field must be equal, tile table included, on many random routings and the edge cases
(experts with no pairs, every pair on one expert, top 1 and top 8, 8 and 128 experts, blocks of pairs cut
anywhere). A negative control shows the comparison sees a plan that sorts within an expert in another order."""

import pytest
import torch
from invariance import randn, same_bits

from lockstep.ops import moe
from lockstep.ops.moe import MoEConfig
from lockstep.ops.moe import layer as moe_layer
from lockstep.ops.moe import plan as moe_plan

FIELDS = ("order", "tokens", "rows", "bounds")


def plan_differences(got: moe.RoutingPlan, ref: moe.RoutingPlan, num_experts: int, bm: int) -> list[str]:
    """The fields of ``got`` (its tile table for ``bm`` included) that differ from ``ref``'s, dtype included."""
    bad = [f for f in FIELDS if not _same(getattr(got, f), getattr(ref, f))]
    ref_tiles = moe.tile_table_torch(ref.bounds, ref.order.numel(), num_experts, bm)
    bad += [
        name for name, a, b in zip(("expert", "start", "end"), got.tiles, ref_tiles, strict=True) if not _same(a, b)
    ]
    return bad


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def distinct_ids(n: int, top_k: int, num_experts: int, seed: int, skew: float = 0.0) -> torch.Tensor:
    """Each token's ``top_k`` distinct experts (as the router gives them), optionally skewed to low ids."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, num_experts, generator=gen) - skew * torch.arange(num_experts) / num_experts
    return scores.argsort(1, descending=True)[:, :top_k].contiguous()


def cases() -> list[tuple[str, torch.Tensor, int]]:
    out = []
    for num_experts in (8, 128):
        for top_k in (1, 8):
            for n in (1, 3, 7, 8, 9, 17, 65, 127, 300):
                out.append((f"E{num_experts}-k{top_k}-n{n}", distinct_ids(n, top_k, num_experts, seed=n), num_experts))
            # Most pairs on the first few experts, the rest empty.
            out.append((f"E{num_experts}-k{top_k}-skewed", distinct_ids(90, top_k, num_experts, 1, 4.0), num_experts))
            # Every token at the same experts (a whole batch crowding one tile row after another).
            same = torch.arange(top_k).roll(3 % top_k).repeat(70, 1)
            out.append((f"E{num_experts}-k{top_k}-all-same", same, num_experts))
        # Repeats inside a token (never from the router, but the plan is defined for them).
        gen = torch.Generator().manual_seed(num_experts)
        out.append((f"E{num_experts}-k3-repeats", torch.randint(0, num_experts, (41, 3), generator=gen), num_experts))
    # Every pair on one expert, the last one and the first one.
    out.append(("E8-all-on-7", torch.full((100, 1), 7), 8))
    out.append(("E128-all-on-0", torch.zeros(33, 1, dtype=torch.int64), 128))
    out.append(("E128-k8-all-on-few", torch.arange(8).repeat(200, 1), 128))
    out.append(("E5-k2-odd-experts", distinct_ids(29, 2, 5, seed=5), 5))  # E not a power of two
    return out


CASES = cases()


@pytest.mark.parametrize("bm", [16, 64])
@pytest.mark.parametrize("name,ids,num_experts", CASES, ids=[c[0] for c in CASES])
def test_fused_plan_equals_the_torch_plan(name, ids, num_experts, bm):
    got = moe.plan_routing_triton(ids, num_experts, bm)
    ref = moe.plan_routing_torch(ids, num_experts)
    assert got.tile_rows == bm
    assert plan_differences(got, ref, num_experts, bm) == []


@pytest.mark.parametrize("seed", range(12))
def test_fused_plan_on_random_routings(seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    num_experts = int(torch.randint(2, 130, (1,), generator=gen))
    top_k = int(torch.randint(1, min(num_experts, 8) + 1, (1,), generator=gen))
    n = int(torch.randint(1, 200, (1,), generator=gen))
    ids = distinct_ids(n, top_k, num_experts, seed=seed, skew=float(seed % 3))
    bm = (16, 32, 64)[seed % 3]
    ref = moe.plan_routing_torch(ids, num_experts)
    assert plan_differences(moe.plan_routing_triton(ids, num_experts, bm), ref, num_experts, bm) == []


@pytest.mark.parametrize("bm", [16, 32, 128])
def test_the_tile_table_launch_alone_equals_torch(bm):
    # tile_table for a BM the plan was not built for: the placing kernel's tile programs alone.
    ids = distinct_ids(77, 8, 128, seed=3, skew=2.0)
    plan = moe.plan_routing_torch(ids, 128)
    got = moe.tile_table_triton(plan.bounds, ids.numel(), 128, bm)
    ref = moe.tile_table_torch(plan.bounds, ids.numel(), 128, bm)
    assert all(_same(a, b) for a, b in zip(got, ref, strict=True))


def test_no_tokens_gives_an_empty_plan():
    plan = moe.plan_routing_triton(torch.zeros(0, 4, dtype=torch.int64), 8, 16)
    assert plan.order.numel() == 0 and plan.bounds.tolist() == [0] * 9 and plan.tiles[0].numel() == 0


def test_a_plan_sorted_another_way_within_an_expert_is_seen():
    # Negative control: the same pairs grouped by expert, but latest pair first within an expert, is a valid
    # grouping that the kernels would also compute correctly; the comparison must still call it a different plan.
    ids = distinct_ids(50, 4, 8, seed=9)
    ref = moe.plan_routing_torch(ids, 8)
    flat = ids.flatten()
    pairs = torch.arange(flat.numel())
    order = torch.from_numpy((flat * 1000 - pairs).numpy().argsort(kind="stable"))
    rows = torch.empty_like(order)
    rows[order] = pairs
    other = moe.RoutingPlan(order, order // 4, rows, ref.bounds, moe.tile_table_torch(ref.bounds, 200, 8, 16), 16)
    assert plan_differences(other, ref, 8, 16) == ["order", "tokens", "rows"]


def test_experts_with_per_matmul_configs_of_other_row_tiles():
    # The down matmul with another BM than gate/up's reads its own tile table (the tile-only launch on CUDA):
    # same bits as one config for both (fp32, the interpreter).
    w13 = randn(8, 2 * 40, 48, seed=1, scale=48**-0.5)
    w2 = randn(8, 48, 40, seed=2, scale=40**-0.5)
    x = randn(37, 48, seed=3)
    w, ids = moe.route(randn(37, 8, seed=4), 3, True)
    base = moe_layer._experts_triton(x, w13, w2, w, ids, config=MoEConfig(16, 32, 32))
    mixed = moe_layer._experts_triton(x, w13, w2, w, ids, config=(MoEConfig(16, 32, 32), MoEConfig(64, 16, 32)))
    assert same_bits(mixed, base)


def test_past_the_fused_plan_size_the_torch_plan_gives_the_same_bits(monkeypatch):
    # Above FUSED_PLAN_MAX_PAIRS the Triton experts take the torch plan (with its tile table): the same layout,
    # so the same bits.
    w13 = randn(8, 2 * 40, 48, seed=1, scale=48**-0.5)
    w2 = randn(8, 48, 40, seed=2, scale=40**-0.5)
    x = randn(29, 48, seed=5)
    w, ids = moe.route(randn(29, 8, seed=6), 3, True)
    fused = moe_layer._experts_triton(x, w13, w2, w, ids)
    monkeypatch.setattr(moe_plan, "FUSED_PLAN_MAX_PAIRS", 10)  # read by plan_routing
    monkeypatch.setattr(moe_layer, "FUSED_PLAN_MAX_PAIRS", 10)  # and by the Triton experts
    plan = moe.plan_routing(ids, 8, 16)
    assert plan.tile_rows == 16 and plan_differences(plan, moe.plan_routing_torch(ids, 8), 8, 16) == []
    assert same_bits(moe_layer._experts_triton(x, w13, w2, w, ids), fused)
