"""The experts' down projections through the chunk tree over I (``ops.moe.down_roots``, ``ops.moe.experts_tree``),
the numerics of a mixture of experts under tensor parallelism: N simulated ranks, each holding I / N of every
expert and reducing its own chunks, then the tree over their roots, give the one-process tree's bits (the CPU path
and the Triton path through the interpreter). Also: close to float64, row invariant, zero-padded when 8 does not
divide I. Negative controls: the ranks' roots summed left to right, and the experts without the tree."""

import pytest
import torch
from invariance import randn, same_bits

from lockstep.ops import moe, tp_linear
from lockstep.ops.moe import tree as moe_tree

H, E, K = 48, 8, 3
PATHS = {"cpu": moe_tree._down_partials_cpu, "triton": moe_tree._down_partials_triton}


def weights(width: int, dtype=torch.float32, seed=10):
    w13 = randn(E, 2 * width, H, seed=seed, scale=H**-0.5).to(dtype)
    w2 = randn(E, H, width, seed=seed + 1, scale=width**-0.5).to(dtype)
    return w13, w2


def routed(n: int, dtype=torch.float32, seed=0):
    x = randn(n, H, dtype=dtype, seed=seed)
    w, ids = moe.route(randn(n, E, seed=seed + 1000), K, True)
    return x, w, ids


def rank_slice(w13, w2, rank: int, size: int):
    """Rank ``rank`` of ``size``'s experts: its I / size rows of gate and of up, its I / size columns of down."""
    width = w2.shape[2]
    part = width // size
    rows = slice(rank * part, (rank + 1) * part)
    gate_up = torch.cat([w13[:, rows], w13[:, width + rank * part : width + (rank + 1) * part]], dim=1)
    return gate_up, w2[:, :, rows].contiguous()


def roots(path, x, w13, w2, ids, num_chunks):
    plan = moe.plan_routing(ids, E)
    return tp_linear.tree_reduce(PATHS[path](x, w13, w2, plan, num_chunks))


def ranks_roots(path, x, w13, w2, ids, size, combine=tp_linear.tree_reduce):
    parts = [roots(path, x, *rank_slice(w13, w2, r, size), ids, tp_linear.CHUNKS // size) for r in range(size)]
    return combine(torch.stack(parts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [1, 17])
def test_ranks_finish_the_one_process_tree(path, n, dtype):
    # I = 40: 5 columns a chunk, so each BK step of the Triton path is a masked tail.
    x, _, ids = routed(n, dtype, seed=n)
    w13, w2 = weights(40, dtype)
    full = roots(path, x, w13, w2, ids, tp_linear.CHUNKS)
    for size in (2, 4, 8):
        assert same_bits(ranks_roots(path, x, w13, w2, ids, size), full), f"TP {size}"


def test_the_down_roots_match_the_public_entry():
    x, _, ids = routed(17)
    w13, w2 = weights(40)
    got, rows = moe.down_roots(x, w13, w2, ids, tp_linear.CHUNKS)
    assert same_bits(got, roots("cpu", x, w13, w2, ids, tp_linear.CHUNKS))
    assert torch.equal(rows, moe.plan_routing(ids, E).rows.view(ids.shape))


@pytest.mark.parametrize("width", [40, 21])  # 21: zero-padded to 24, in one process
@pytest.mark.parametrize("n", [1, 3, 17, 127])
def test_experts_tree_matches_float64(n, width):
    x, w, ids = routed(n, seed=n)
    w13, w2 = weights(width)
    ref = moe.experts_reference(x.double(), w13.double(), w2.double(), w.double(), ids)
    out = moe.experts_tree(x, w13, w2, w, ids)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_experts_tree_is_row_invariant():
    x, w, ids = routed(127, seed=3)
    w13, w2 = weights(40)
    full = moe.experts_tree(x, w13, w2, w, ids)
    for m in (1, 3, 17):
        assert same_bits(moe.experts_tree(x[:m], w13, w2, w[:m], ids[:m]), full[:m])
    moved = torch.roll(torch.arange(127), 40)
    assert same_bits(moe.experts_tree(x[moved], w13, w2, w[moved], ids[moved]), full[moved])


def _left_to_right(partials: torch.Tensor) -> torch.Tensor:
    total = partials[0]
    for p in partials[1:]:
        total = total + p
    return total


def test_negative_control_ranks_summed_left_to_right_differ():
    # What a ring all-reduce could do with 4 ranks: ((r0 + r1) + r2) + r3 instead of (r0 + r1) + (r2 + r3).
    x, _, ids = routed(127, seed=5)
    w13, w2 = weights(40)
    full = roots("cpu", x, w13, w2, ids, tp_linear.CHUNKS)
    assert not same_bits(ranks_roots("cpu", x, w13, w2, ids, 4, _left_to_right), full)


def test_negative_control_experts_without_the_tree_differ():
    x, w, ids = routed(127, seed=6)
    w13, w2 = weights(40)
    assert not same_bits(moe.experts(x, w13, w2, w, ids), moe.experts_tree(x, w13, w2, w, ids))


def test_down_roots_bad_input():
    x, _, ids = routed(3)
    w13, w2 = weights(40)
    with pytest.raises(ValueError, match="num_chunks must be 1, 2, 4 or 8"):
        moe.down_roots(x, w13, w2, ids, 3)
    with pytest.raises(ValueError, match="expert weights do not fit"):
        moe.down_roots(x, w13, w2[:, :, :20], ids, 8)
