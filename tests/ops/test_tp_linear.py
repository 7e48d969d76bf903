"""The chunk-tree linear: fp64 parity, one tree whatever the rank split, batch invariance, and a control showing
that a plain sum of rank partials does depend on the rank count."""

import pytest
import torch
from invariance import MOVES, SIZES, check_moved_row, check_prefixes, randn, same_bits

from lockstep import ops
from lockstep.ops.matmul import MatmulConfig, _bmm_triton
from lockstep.ops.tp_linear import CHUNKS, _tree_finish_triton, finish, subtree, tree_finish, tree_linear, tree_reduce

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
TP_SIZES = [1, 2, 4, 8]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def ranks_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, size: int) -> torch.Tensor:
    """What ``size`` ranks compute: each its own contiguous K slice (its shard), its subtree, then the gathered
    roots through the rest of the tree in rank order."""
    k = x.shape[1] // size
    roots = [
        subtree(x[:, r * k : (r + 1) * k].contiguous(), weight[:, r * k : (r + 1) * k].contiguous(), CHUNKS // size)
        for r in range(size)
    ]
    return finish(tree_reduce(torch.stack(roots)), bias, x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", SIZES)
@pytest.mark.parametrize("k", [96, 131])  # 131: not a multiple of 8, zero-padded to 136
def test_tree_linear_matches_fp64(m, k, dtype):
    n = 77
    x, w, b = randn(m, k, dtype=dtype, seed=1), randn(n, k, dtype=dtype, seed=2), randn(n, dtype=dtype, seed=3)
    out = tree_linear(x, w, b)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, x.double() @ w.double().t() + b.double()) < TOLERANCE[dtype]
    assert rel_err(tree_linear(x[None], w)[0], x.double() @ w.double().t()) < TOLERANCE[dtype]


def test_tree_order_is_pairwise():
    # Values whose sum depends on the order: the tree must give ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)).
    p = torch.tensor([1e8, 1.0, -1e8, 1.0, 3.0, 1e-8, 1e8, -1e8], dtype=torch.float32)[:, None, None]
    f = [t.reshape(()) for t in p]
    expected = ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]))
    assert same_bits(tree_reduce(p)[0, 0], expected)
    sequential = f[0]
    for t in f[1:]:
        sequential = sequential + t
    assert not same_bits(expected, sequential)  # the values do see the order


@pytest.mark.parametrize("length", [1, 2, 4, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_tree_kernel_makes_the_same_additions(length, with_bias):
    # CUDA's one-kernel tree (run here by Triton's interpreter) against the torch ops, fp32 out: the same bits.
    # (The interpreter truncates fp32 -> bf16 instead of rounding, so a rounded output is only checked for closeness.)
    p = randn(length, 37, 129, dtype=torch.float32, seed=7) * torch.logspace(-4, 4, length)[:, None, None]
    bias = randn(129, dtype=torch.bfloat16, seed=8) if with_bias else None
    assert same_bits(_tree_finish_triton(p, bias, torch.float32), tree_finish(p, bias, torch.float32))
    rounded = _tree_finish_triton(p, bias, torch.bfloat16)
    assert rounded.dtype == torch.bfloat16 and rel_err(rounded, tree_finish(p, bias, torch.float32).double()) < 1e-2
    order = torch.tensor([1e8, 1.0, -1e8, 1.0, 3.0, 1e-8, 1e8, -1e8], dtype=torch.float32)[:, None, None]
    assert same_bits(_tree_finish_triton(order, None, torch.float32), tree_reduce(order))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [8 * 23, 576])
def test_every_rank_split_gives_the_same_bits(k, dtype):
    m, n = 127, 300
    x, w, b = randn(m, k, dtype=dtype, seed=4), randn(n, k, dtype=dtype, seed=5), randn(n, dtype=dtype, seed=6)
    single = tree_linear(x, w, b)
    for size in TP_SIZES:
        split = ranks_linear(x, w, b, size)
        assert same_bits(split, single), f"TP {size}: {int((split != single).sum())} of {split.numel()} differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_linear_rows_are_batch_invariant(dtype):
    k, n = 576, 96
    x, w, b = randn(300, k, dtype=dtype, seed=7), randn(n, k, dtype=dtype, seed=8), randn(n, dtype=dtype, seed=9)
    check_prefixes(lambda t: tree_linear(t, w, b), x, [1, 2, 3, 7, 17, 64, 129])
    check_moved_row(lambda t: tree_linear(t, w, b), x, MOVES)
    # and at every rank split
    for size in (2, 8):
        check_prefixes(lambda t, size=size: ranks_linear(t, w, b, size), x, [1, 17, 129])


def test_plain_rank_sums_depend_on_the_rank_count():
    # Negative control: the usual row-parallel reduction (each rank's sequential partial, summed in rank order,
    # as an all-reduce would) gives different bits at TP 2 and TP 4, in the same harness.
    m, k, n = 127, 576, 300
    x, w = randn(m, k, seed=10), randn(n, k, seed=11)

    def rank_order_sum(size: int) -> torch.Tensor:
        part = k // size
        partials = [ops.linear(x[:, r * part : (r + 1) * part], w[:, r * part : (r + 1) * part]) for r in range(size)]
        total = partials[0]
        for p in partials[1:]:
            total = total + p
        return total

    two, four = rank_order_sum(2), rank_order_sum(4)
    assert not torch.equal(two, four)
    assert same_bits(ranks_linear(x, w, None, 2), ranks_linear(x, w, None, 4))


def test_fp32_output_is_the_unrounded_accumulator():
    # The Triton kernel (run by the interpreter here, which computes bf16 dots in fp32) with out_dtype=float32
    # stores the accumulator itself: the fp32 kernel's bits, not values rounded to bf16.
    a, b = randn(1, 37, 64, dtype=torch.bfloat16, seed=12), randn(1, 64, 48, dtype=torch.bfloat16, seed=13)
    cfg = MatmulConfig(16, 16, 32)
    acc = _bmm_triton(a, b, config=cfg, out_dtype=torch.float32)
    assert acc.dtype == torch.float32
    assert torch.equal(acc, _bmm_triton(a.float(), b.float(), config=cfg))
    assert not torch.equal(acc, acc.to(torch.bfloat16).float())


def test_bad_arguments_raise():
    x, w = torch.ones(3, 16), torch.ones(5, 16)
    with pytest.raises(ValueError, match="num_chunks"):
        subtree(x, w, 3)
    with pytest.raises(ValueError, match="expected x"):
        subtree(x, torch.ones(5, 8), 8)
    with pytest.raises(TypeError, match="matching"):
        subtree(x, w.bfloat16(), 8)
    with pytest.raises(ValueError, match="the tree takes 1, 2, 4 or 8 partials, got 3"):
        tree_reduce(torch.ones(3, 2, 2))
    with pytest.raises(TypeError, match="tree partials must be float32"):
        tree_finish(torch.ones(2, 2, 2, dtype=torch.bfloat16), None, torch.bfloat16)
