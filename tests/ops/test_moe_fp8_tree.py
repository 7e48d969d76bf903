"""The chunk tree over FP8 experts (``ops.moe_fp8_tree``): N simulated ranks, each holding I / N of every expert
(its rows of the gate and up projections with their row scales, its columns of the down projection with its K
blocks of scales), give after the all-gather and the tree the bits of one process, for block scales with
per-128 activations and per-channel scales with per-token activations (whose scales span the ranks: their maxima
are gathered), on the CPU path and the grouped Triton kernel (interpreter). Qwen3-30B-A3B's I = 768 at TP 4 and 8
cuts 128-column blocks between ranks (192 and 96 columns a rank): both ranks keep the shared block's scale and the
activations' group maxima are gathered. Negative controls: the experts without the tree are other bits (and
close), and so are ranks that quantize a cut group with their own part's maximum."""

import pytest
import torch
from invariance import randn, same_bits

from lockstep.ops import fp8, fp8_tree, moe, tp_linear
from lockstep.ops.moe_fp8 import experts_fp8
from lockstep.ops.moe_fp8_tree import down_roots_fp8, experts_fp8_tree

E, H, K = 4, 160, 2
# I; the activations' group. Block scales: chunks of 128 columns, and Qwen3-30B-A3B's I = 768, whose chunks of 96
# cut the 128-column blocks (a rank's 384 columns at TP 2 are whole blocks; its 192 at TP 4 and 96 at TP 8 are not).
CASES = {"block": (1024, 128), "block-768": (768, 128), "channel": (48, None)}
TP_SIZES = {"block": (2, 4), "block-768": (2, 4, 8), "channel": (2, 4, 8)}
TRITON_TP_SIZES = TP_SIZES | {"block-768": (4, 8)}  # the interpreter is slow: the sizes that cut blocks


def fp8_experts(kind: str, inter: int):
    w13 = randn(E, 2 * inter, H, seed=5, scale=H**-0.5)
    w2 = randn(E, H, inter, seed=6, scale=inter**-0.5)

    def q(w, parts):
        w8s, scales = [], []
        for m in w:
            for p in m.split(parts):
                if kind == "block":
                    w8, s = fp8.quantize_weight(p, (128, 128))
                    s = fp8.expand_block_scale(s, p.shape[0], 128)
                else:
                    w8, s = fp8.quantize_weight(p)
                w8s.append(w8)
                scales.append(s)
        n = len(w8s) // E
        return (torch.stack([torch.cat(w8s[i * n : (i + 1) * n]) for i in range(E)]),
                torch.stack([torch.cat(scales[i * n : (i + 1) * n]) for i in range(E)]))  # fmt: skip

    return (*q(w13, [inter, inter]), *q(w2, [H]))


def rank_slice(w13, s13, w2, s2, rank: int, size: int):
    inter = w2.shape[2]
    a, b = rank * inter // size, (rank + 1) * inter // size
    rows = torch.cat([torch.arange(a, b), inter + torch.arange(a, b)])
    g = fp8.GROUP_K
    s2r = s2[:, :, a // g : -(-b // g)] if s2.shape[2] > 1 else s2
    return w13[:, rows], s13[:, rows], w2[:, :, a:b].contiguous(), s2r.contiguous()


def simulated_ranks(x, weights, ids, experts, group, size: int, triton: bool, gather: bool = True) -> torch.Tensor:
    inter = experts[2].shape[2]
    shards = [rank_slice(*experts, r, size) for r in range(size)]
    columns = [(r * inter // size, inter) for r in range(size)]
    maxima = []  # pass 1: each rank's activation maxima; pass 2: with every rank's max, as the all-gather
    for shard, cols in zip(shards, columns, strict=True):
        down_roots_fp8(x, *shard, ids, group, 8 // size, lambda m: maxima.append(m) or m, triton, cols)
    amax = torch.stack(maxima).amax(0)
    roots = [
        down_roots_fp8(x, *s, ids, group, 8 // size, (lambda m: amax) if gather else (lambda m: m), triton, cols)
        for s, cols in zip(shards, columns, strict=True)
    ]
    root = tp_linear.tree_reduce(torch.stack([r for r, _ in roots]))
    return moe.combine(root.to(x.dtype), weights.float(), roots[0][1])


@pytest.mark.parametrize("triton", [False, True], ids=["cpu", "triton"])
@pytest.mark.parametrize("kind", list(CASES))
def test_fp8_expert_tree_does_not_depend_on_the_tp_size(kind, triton):
    inter, group = CASES[kind]
    experts = fp8_experts(kind, inter)
    x = randn(7, H, seed=1)
    weights, ids = moe.route(randn(7, E, seed=2), K, True)
    roots, rows = down_roots_fp8(x, *experts, ids, group, 8, triton=triton)
    one = moe.combine(roots.to(x.dtype), weights.float(), rows)
    if not triton:
        assert same_bits(experts_fp8_tree(x, *experts[:2], *experts[2:], weights, ids, group), one)
    for size in (TRITON_TP_SIZES if triton else TP_SIZES)[kind]:
        assert same_bits(simulated_ranks(x, weights, ids, experts, group, size, triton), one), size
    r3, rows3 = down_roots_fp8(x[3:4], *experts, ids[3:4], group, 8, triton=triton)  # a token alone
    assert same_bits(moe.combine(r3.to(x.dtype), weights[3:4].float(), rows3), one[3:4])


@pytest.mark.parametrize("size", [4, 8])
def test_negative_control_ranks_that_cut_a_group_without_its_gathered_maximum_differ(size):
    # Each rank quantizes the activations of a group it shares with its own part's maximum (no all-gather).
    inter, group = CASES["block-768"]
    experts = fp8_experts("block", inter)
    x = randn(7, H, seed=1)
    weights, ids = moe.route(randn(7, E, seed=2), K, True)
    one = experts_fp8_tree(x, *experts, weights, ids, group)
    local = simulated_ranks(x, weights, ids, experts, group, size, False, gather=False)
    assert not same_bits(local, one)
    assert ((local.double() - one.double()).norm() / one.double().norm()).item() < 5e-2


@pytest.mark.parametrize("size", [4, 8])
def test_the_fast_mode_at_ranks_that_cut_blocks_sums_to_the_experts(size):
    # Without the tree each rank's down projection is one chunk in pieces of one block (layers.moe's fast mode);
    # the ranks' outputs, summed, are the one-process FP8 experts up to the sum's rounding.
    inter, group = CASES["block-768"]
    experts = fp8_experts("block", inter)
    x = randn(7, H, seed=1)
    weights, ids = moe.route(randn(7, E, seed=2), K, True)
    shards = [rank_slice(*experts, r, size) for r in range(size)]
    columns = [(r * inter // size, inter) for r in range(size)]
    maxima = []
    for shard, cols in zip(shards, columns, strict=True):
        down_roots_fp8(x, *shard, ids, group, 1, lambda m: maxima.append(m) or m, False, cols)
    amax = torch.stack(maxima).amax(0)
    total = torch.zeros_like(x)
    for shard, cols in zip(shards, columns, strict=True):
        roots, rows = down_roots_fp8(x, *shard, ids, group, 1, lambda m: amax, False, cols)
        total += moe.combine(roots.to(x.dtype), weights.float(), rows)
    one = experts_fp8(x, *experts, weights, ids, group)
    assert ((total.double() - one.double()).norm() / one.double().norm()).item() < 1e-6


@pytest.mark.parametrize("kind", list(CASES))
def test_negative_control_fp8_experts_without_the_tree_differ(kind):
    inter, group = CASES[kind]
    experts = fp8_experts(kind, inter)
    x = randn(7, H, seed=1)
    weights, ids = moe.route(randn(7, E, seed=2), K, True)
    tree = experts_fp8_tree(x, *experts, weights, ids, group)
    plain = experts_fp8(x, *experts, weights, ids, group)
    assert not same_bits(tree, plain)
    assert ((tree.double() - plain.double()).norm() / plain.double().norm()).item() < 2e-2


def test_chunks_that_cut_scale_blocks_are_computed_in_pieces_of_one_block():
    assert fp8_tree.chunk_pieces(768, 8, True)[:3] == [[(0, 96)], [(96, 128), (128, 192)], [(192, 256), (256, 288)]]
    assert fp8_tree.chunk_pieces(768, 8, False)[1] == [(96, 192)]
    assert fp8_tree.chunk_pieces(1024, 8, True)[1] == [(128, 256)]  # whole blocks: the chunk itself
    # A rank's columns 192..384 of I = 768 (TP 4 rank 1): its chunks 2 and 3, cut at the whole I's block edges.
    assert fp8_tree.chunk_pieces(192, 2, True, 192) == [[(0, 64), (64, 96)], [(96, 192)]]
    assert fp8_tree.piece_blocks(0, 64, 192) == slice(0, 1) and fp8_tree.piece_blocks(96, 192, 192) == slice(1, 2)
    # A chunk in pieces is their partials summed in column order (here against the fp64 dequantized product).
    w8, ws = fp8.quantize_weight(randn(5, 256, seed=3), (128, 128))  # K = 256: two blocks
    ws = fp8.expand_block_scale(ws, 5, 128)
    a8, sa = fp8.quantize_rows(randn(3, 256, seed=4), 128)
    parts = fp8_tree.chunk_partials(a8, sa, w8, ws, 8)  # 8 chunks of 32 columns, inside the 128-column blocks
    ref = fp8.dequantize(a8, sa, torch.float64) @ fp8.dequantize(w8, ws, torch.float64).T
    torch.testing.assert_close(parts.double().sum(0), ref, rtol=1e-5, atol=1e-5)
