"""The mixture-of-experts ops (lockstep.ops.moe): routing with explicit ties, the grouped expert matmuls (the CPU
path, and the Triton kernel through the interpreter) against float64, their row invariance (a prefix of the batch,
a row moved among other rows, a token alone at its experts vs with many others), and negative controls: torch's
per-expert loop, and combining a token's k outputs in an order that follows the batch."""

import pytest
import torch
from invariance import SIZES, randn, same_bits

from lockstep import ops
from lockstep.layers import torch_kernels
from lockstep.layers.activation import silu_and_mul
from lockstep.ops import moe
from lockstep.ops.moe import MoEConfig
from lockstep.ops.moe import combining as moe_combining
from lockstep.ops.moe import layer as moe_layer
from lockstep.ops.moe import routing as moe_routing

H, W, E, K = 48, 40, 8, 3  # hidden, expert width (W), experts, top k: odd-ish sizes, K not a multiple of BK


def weights(dtype=torch.float32, num_experts=E, hidden=H, width=W, seed=10):
    w13 = randn(num_experts, 2 * width, hidden, seed=seed, scale=hidden**-0.5).to(dtype)
    w2 = randn(num_experts, hidden, width, seed=seed + 1, scale=width**-0.5).to(dtype)
    return w13, w2


def routed(n, dtype=torch.float32, seed=0, top_k=K, num_experts=E):
    """``n`` tokens and their routing from random router logits."""
    x = randn(n, H, dtype=dtype, seed=seed)
    w, ids = moe.route(randn(n, num_experts, seed=seed + 1000), top_k, True)
    return x, w, ids


def reference(x, w13, w2, w, ids) -> torch.Tensor:
    return moe.experts_reference(x.double(), w13.double(), w2.double(), w.double(), ids)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


PATHS = {"cpu": moe_layer._experts_cpu, "triton": moe_layer._experts_triton}


# --- routing ---------------------------------------------------------------------------------------------------


def _brute_force_route(logits: torch.Tensor, top_k: int, renormalize: bool):
    probs = torch.softmax(logits.double(), -1)
    ids, ws = [], []
    for row in probs.tolist():
        best = sorted(range(len(row)), key=lambda e: (-row[e], e))[:top_k]
        ids.append(best)
        chosen = [row[e] for e in best]
        ws.append([c / sum(chosen) for c in chosen] if renormalize else chosen)
    return torch.tensor(ws, dtype=torch.float64), torch.tensor(ids)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("n", SIZES)
def test_route_matches_a_float64_reference(n, renormalize):
    logits = randn(n, 13, seed=n)
    w, ids = moe.route(logits, 4, renormalize)
    ref_w, ref_ids = _brute_force_route(logits, 4, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids)
    assert (w.double() - ref_w).abs().max() < 1e-6
    # Without ties, Hugging Face's routing (torch.topk) picks the same experts in the same order.
    hf_w, hf_ids = torch_kernels.torch_moe_route(logits, 4, renormalize)
    assert torch.equal(ids, hf_ids) and (w - hf_w).abs().max() < 1e-6


def test_route_ties_go_to_the_lowest_expert_id():
    logits = torch.tensor(
        [
            [0.0] * 8,  # all equal: experts 0, 1, 2
            [1.0, 3.0, 1.0, 3.0, 1.0, 3.0, 2.0, 2.0],  # three at the top: 1, 3, 5
            [5.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 5.0],  # 0 and 7 tie first, then 2 of four equal ones
            [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 4.0],
            [-200.0, -200.0, 0.0, -200.0, -200.0, -200.0, -200.0, -200.0],  # underflowed probabilities tie at 0
        ]
    )
    _, ids = moe.route(logits, 3, True)
    assert ids.tolist() == [[0, 1, 2], [1, 3, 5], [0, 7, 2], [7, 0, 1], [2, 0, 1]]
    # The same rows at other positions of another batch keep their choice.
    batch = torch.cat([randn(9, 8, seed=3), logits.flip(0)])
    assert moe.route(batch, 3, True)[1][9:].tolist() == ids.flip(0).tolist()


def test_renormalisation_sums_left_to_right():
    w = randn(50, 8, seed=4).abs()
    total = w[:, 0].clone()
    for j in range(1, 8):
        total += w[:, j]
    assert same_bits(moe.renormalize_in_order(w), w / total[:, None])


def test_route_is_row_invariant():
    logits = randn(300, 64, seed=5)
    w, ids = moe.route(logits, 8, True)
    for m in (1, 2, 17, 129):
        wm, idm = moe.route(logits[:m], 8, True)
        assert same_bits(wm, w[:m]) and torch.equal(idm, ids[:m])
    for m, pos in [(2, 1), (40, 3), (129, 128)]:
        batch = randn(m, 64, seed=100 + m)
        batch[pos] = logits[0]
        wb, idb = moe.route(batch, 8, True)
        assert same_bits(wb[pos], w[0]) and torch.equal(idb[pos], ids[0])


def test_route_bad_input():
    with pytest.raises(ValueError, match="top_k"):
        moe.route(torch.zeros(3, 4), 5, True)
    with pytest.raises(ValueError, match=r"\[num_tokens, num_experts\]"):
        moe.route(torch.zeros(4), 1, True)


# --- the routing plan ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,bm", [(1, 16), (5, 16), (37, 4), (200, 16), (64, 64)])
def test_tile_table_covers_every_sorted_row_once(n, bm):
    # Skewed routing: experts 0 and 1 take most pairs, 6 and 7 none.
    bias = torch.tensor([4.0, 3.0, 0.0, 0.0, 0.0, 0.0, -1e4, -1e4])
    _, ids = moe.route(randn(n, E, seed=n) + bias, K, False)
    plan = moe.plan_routing(ids, E)
    flat = ids.flatten()
    assert torch.equal(flat[plan.order], flat.sort(stable=True).values)
    assert torch.equal(plan.order[plan.rows], torch.arange(n * K))
    assert torch.equal(plan.tokens, plan.order // K)
    expert, start, end = moe.tile_table(plan, E, bm)
    assert len(expert) == -(-n * K // bm) + min(E, n * K)  # fixed by shapes
    real = expert < E
    assert not real[int(real.sum()) :].any()  # the real tiles first, then only empty slots
    covered = torch.zeros(n * K, dtype=torch.int64)
    for e, s, t in zip(expert[real].tolist(), start[real].tolist(), end[real].tolist(), strict=True):
        rows = torch.arange(s, min(t, s + bm))
        assert len(rows) > 0 and (flat[plan.order[rows]] == e).all()  # a tile never spans two experts
        covered[rows] += 1
    assert (covered == 1).all()


# --- the expert matmuls against float64 --------------------------------------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("n", [1, 3, 17, 127])
def test_experts_match_float64(path, n):
    w13, w2 = weights()
    x, w, ids = routed(n, seed=n)
    out = PATHS[path](x, w13, w2, w, ids)
    assert out.dtype == torch.float32 and out.shape == (n, H)
    assert rel_err(out, reference(x, w13, w2, w, ids)) < 1e-5


def test_experts_cpu_half_precision_is_close():
    w13, w2 = weights(torch.bfloat16)
    x, w, ids = routed(33, torch.bfloat16)
    out = ops.moe_experts(x, w13, w2, w, ids)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, reference(x, w13, w2, w, ids)) < 2e-2


def test_experts_with_one_expert_per_token_and_all_experts():
    w13, w2 = weights(num_experts=4)
    for top_k in (1, 4):
        x, w, ids = routed(9, top_k=top_k, num_experts=4, seed=top_k)
        for path in PATHS.values():
            assert rel_err(path(x, w13, w2, w, ids), reference(x, w13, w2, w, ids)) < 1e-5


def test_experts_bad_input():
    w13, w2 = weights()
    x, w, ids = routed(4)
    with pytest.raises(ValueError, match="expert weights do not fit"):
        ops.moe_experts(x[:, :10], w13, w2, w, ids)
    with pytest.raises(ValueError, match="must both be"):
        ops.moe_experts(x, w13, w2, w[:3], ids)
    with pytest.raises(TypeError, match="matching"):
        ops.moe_experts(x.bfloat16(), w13, w2, w, ids)


# --- row invariance --------------------------------------------------------------------------------------------


def _check_rows(fn, n=130):
    """A prefix of the batch, and token 0 moved among other tokens, keep their bits."""
    w13, w2 = weights()
    x, w, ids = routed(n)
    full = fn(x, w13, w2, w, ids)
    for m in (1, 2, 3, 17, 64, n):
        assert same_bits(fn(x[:m], w13, w2, w[:m], ids[:m]), full[:m]), f"prefix {m}"
    alone = fn(x[:1], w13, w2, w[:1], ids[:1])[0]
    for m, pos in [(2, 1), (16, 15), (40, 3), (129, 128)]:
        bx, bw, bids = routed(m, seed=100 + m)
        bx[pos], bw[pos], bids[pos] = x[0], w[0], ids[0]
        assert same_bits(fn(bx, w13, w2, bw, bids)[pos], alone), f"moved to {pos} of {m}"


@pytest.mark.parametrize("path", list(PATHS))
def test_experts_are_row_invariant(path):
    _check_rows(PATHS[path])


def _alone_vs_crowded(fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Token 0's output when it is the only token at its experts, and when 60 other tokens share them."""
    w13, w2 = weights()
    x, w, _ = routed(61, seed=7)
    mine = torch.tensor([2, 5, 6])
    others = torch.tensor([[0, 1, 3], [1, 4, 7], [3, 7, 0]])
    alone_ids = torch.cat([mine[None], others.repeat(20, 1)])  # nobody else at 2, 5 or 6
    crowded_ids = torch.cat([mine[None], mine[None].repeat(60, 1).roll(1, dims=1)])
    return fn(x, w13, w2, w, alone_ids)[0], fn(x, w13, w2, w, crowded_ids)[0]


@pytest.mark.parametrize("path", list(PATHS))
def test_a_token_alone_at_its_experts_or_with_many_others(path):
    alone, crowded = _alone_vs_crowded(PATHS[path])
    assert same_bits(alone, crowded)


def test_torch_expert_loop_depends_on_the_crowd():
    # Negative control: torch's F.linear picks its CPU kernel from the row count, so the per-expert loop gives a
    # token other bits when its experts are crowded.
    alone, crowded = _alone_vs_crowded(moe.experts_reference)
    assert not same_bits(alone, crowded)


@pytest.mark.parametrize(
    "cfg", [MoEConfig(16, 16, 32), MoEConfig(32, 64, 32), MoEConfig(64, 32, 32), MoEConfig(16, 128, 32)]
)
def test_triton_tile_shape_does_not_change_the_bits(cfg):
    # BK fixed, BM and BN varied: every row reduced in the same steps (here in the interpreter, fp32).
    w13, w2 = weights()
    x, w, ids = routed(70, seed=3)
    base = moe_layer._experts_triton(x, w13, w2, w, ids)
    assert same_bits(moe_layer._experts_triton(x, w13, w2, w, ids, config=cfg), base)


def test_triton_bf16_rows_are_invariant():
    # Triton against Triton only: the interpreter truncates fp32 -> bf16 casts.
    w13, w2 = weights(torch.bfloat16)
    x, w, ids = routed(40, torch.bfloat16, seed=4)
    full = moe_layer._experts_triton(x, w13, w2, w, ids)
    for m in (1, 5, 39):
        assert same_bits(moe_layer._experts_triton(x[:m], w13, w2, w[:m], ids[:m]), full[:m])


# --- the combine ---------------------------------------------------------------------------------------------------


def test_triton_combine_equals_the_cpu_combine():
    y = randn(60, 70, seed=1)
    w = randn(20, 3, seed=2).abs()
    rows = torch.randperm(60, generator=torch.Generator().manual_seed(3)).view(20, 3)
    cpu = moe_combining._combine_cpu(y, w, rows)
    assert same_bits(moe_combining._combine_triton(y, w, rows), cpu)
    ref = (w.double()[:, :, None] * y.double()[rows]).sum(1)
    assert (cpu.double() - ref).abs().max() < 1e-5


def _combine_by_load(y, weights, plan, ids) -> torch.Tensor:
    """A token's k terms added expert by expert, busiest expert first: the order a load-balancing scheduler
    would run the experts in, which follows the whole batch's routing."""
    counts = (plan.bounds[1:] - plan.bounds[:-1]).tolist()
    rows = plan.rows.view(ids.shape)
    out = torch.zeros(ids.shape[0], y.shape[1])
    for e in sorted(range(len(counts)), key=lambda e: (-counts[e], e)):
        token, rank = (ids == e).nonzero(as_tuple=True)
        out[token] += weights[token, rank, None] * y[rows[token, rank]]
    return out


def _combine_sorted(y, weights, plan, ids) -> torch.Tensor:
    """Each sorted row added into its token in sorted order: for a token, expert id order, not rank order."""
    out = torch.zeros(ids.shape[0], y.shape[1])
    return out.index_add_(0, plan.tokens, weights.reshape(-1)[plan.order][:, None] * y)


def _expert_outputs(x, w13, w2, ids):
    """The invariant CPU path's expert outputs in sorted rows, and the plan."""
    plan = moe.plan_routing(ids, E)
    y = torch.empty(ids.numel(), H)
    bounds = plan.bounds.tolist()
    for e in range(E):
        if bounds[e + 1] > bounds[e]:
            rows = slice(bounds[e], bounds[e + 1])
            act = silu_and_mul(ops.linear(x[plan.tokens[rows]], moe.expert_weight(w13, e)))
            y[rows] = ops.linear(act, moe.expert_weight(w2, e))
    return y, plan


@pytest.mark.parametrize("combine_fn", [_combine_by_load, _combine_sorted], ids=["by-load", "sorted"])
def test_combine_orders_other_than_rank_order_change_the_bits(combine_fn):
    # Negative controls: the same expert outputs combined in another order differ somewhere from the rank-order
    # combine, so the harness sees the order of a token's k terms (k = 4: with two terms order cannot matter).
    w13, w2 = weights()
    x, w, ids = routed(64, seed=11, top_k=4)
    y, plan = _expert_outputs(x, w13, w2, ids)
    out = combine_fn(y, w, plan, ids)
    assert (out - moe_layer._experts_cpu(x, w13, w2, w, ids)).abs().max() < 1e-5
    assert not same_bits(out, moe_layer._experts_cpu(x, w13, w2, w, ids))


def test_a_combine_order_that_follows_the_batch_changes_a_tokens_bits():
    # Negative control for the invariance harness: with the busiest-expert-first order, some token's bits
    # differ between the batch and alone; with the rank order (ops.moe) none do.
    w13, w2 = weights()
    x, w, ids = routed(64, seed=12, top_k=4)
    y, plan = _expert_outputs(x, w13, w2, ids)
    batched = _combine_by_load(y, w, plan, ids)
    invariant = moe_layer._experts_cpu(x, w13, w2, w, ids)
    moved = 0
    for t in range(64):
        y1, plan1 = _expert_outputs(x[t : t + 1], w13, w2, ids[t : t + 1])
        moved += not same_bits(_combine_by_load(y1, w[t : t + 1], plan1, ids[t : t + 1])[0], batched[t])
        assert same_bits(moe_layer._experts_cpu(x[t : t + 1], w13, w2, w[t : t + 1], ids[t : t + 1])[0], invariant[t])
    assert moved > 0


# --- the Triton router (CUDA's; here through the interpreter) ----------------------------------------------------


@pytest.mark.parametrize("renormalize", [False, True])
def test_triton_route_matches_the_cpu_route(renormalize):
    logits = randn(67, 13, seed=8) * 3
    w, ids = moe_routing._route_triton(logits, 4, renormalize)
    ref_w, ref_ids = moe_routing._route_cpu(logits, 4, renormalize)
    assert torch.equal(ids, ref_ids) and (w - ref_w).abs().max() < 1e-6
    for m in (1, 2, 30):  # row invariance
        wm, idm = moe_routing._route_triton(logits[:m], 4, renormalize)
        assert same_bits(wm, w[:m]) and torch.equal(idm, ids[:m])


@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_triton_route_ties_and_nan():
    logits = torch.tensor([[0.0] * 8, [1.0, 3.0, 1.0, 3.0, 1.0, 3.0, 2.0, 2.0], [5.0, 1, 2, 2, 2, 2, 0, 5]])
    assert moe_routing._route_triton(logits, 3, True)[1].tolist() == [[0, 1, 2], [1, 3, 5], [0, 7, 2]]
    _, ids = moe_routing._route_triton(torch.full((1, 8), float("nan")), 3, True)
    assert ((0 <= ids) & (ids < 8)).all()  # garbage in, but no id out of range for the expert matmuls


def test_default_sets_cuda_experts_match_float64():
    # The fast mode's CUDA path (grouped matmul, outputs added in sorted order), here through the interpreter.
    w13, w2 = weights()
    x, w, ids = routed(29, seed=6)
    out = torch_kernels.sorted_order_moe_experts(x, w13, w2, w, ids)
    assert rel_err(out, reference(x, w13, w2, w, ids)) < 1e-5


# --- tile configs --------------------------------------------------------------------------------------------------


def test_tile_configs_keep_bk_fixed_per_dtype():
    for dtype, bk in ((torch.bfloat16, 64), (torch.float16, 64), (torch.float32, 32)):
        got = {
            moe.moe_config(pairs, experts, n, k, dtype).bk
            for pairs in (1, 8, 64, 512, 2048, 8192, 131072)
            for experts in (8, 128)
            for n, k in ((768, 2048), (2048, 768), (14336, 4096))
        }
        assert got == {bk}


@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
def test_decode_tiles_fill_the_gpu_at_the_qwen3_30b_shape(tokens):
    # A few tokens (8-64 pairs over 128 experts): 16-row tiles, and columns split so that the matmuls launch
    # at least ~200 programs with rows (an H200 has 132 SMs), each expert's N spread over many programs.
    pairs = tokens * 8
    for n, k in ((768, 2048), (2048, 768)):  # gate/up (N = expert width), down (N = hidden)
        cfg = moe.moe_config(pairs, 128, n, k, torch.bfloat16)
        assert cfg.bm == 16
        assert min(128, pairs) * -(-n // cfg.bn) >= 192, (n, cfg)
        assert -(-n // cfg.bn) >= 12  # programs per expert
