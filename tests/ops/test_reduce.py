import pytest
import torch
from invariance import INVARIANCE_MS, MOVES, SIZES, check_moved_row, check_prefixes, randn, same_bits

from lockstep import ops
from lockstep.ops.reduce import RowConfig, _row_sum_triton, fold_rows, row_config

LENGTHS = [1, 7, 576, 1000, 4099]
# Relative error bounds against fp64, on sums of terms of both signs: normalized by the sum of |x|.
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def check_sum_and_mean(x, s, mu):
    ref = x.double().sum(-1)
    scale = x.double().abs().sum(-1).clamp_min(1e-30)
    assert s.dtype == x.dtype and mu.dtype == x.dtype
    assert ((s.double() - ref).abs() / scale).max() < TOLERANCE[x.dtype]
    n = x.shape[-1]
    assert ((mu.double() - ref / n).abs() / (scale / n)).max() < TOLERANCE[x.dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("m", SIZES)
def test_cpu_sum_mean_match_fp64(m, n, dtype):
    x = randn(m, n, dtype=dtype, seed=m * n)
    check_sum_and_mean(x, ops.sum(x), ops.mean(x))


def test_dims_keepdim_dtype_and_edge_cases_follow_torch():
    x = randn(3, 4, 5, seed=1)
    for dim in [0, 1, -1, (0, 2), [2, 0], None, ()]:
        for keepdim in [False, True]:
            torch.testing.assert_close(ops.sum(x, dim, keepdim), torch.sum(x, dim, keepdim))
            torch.testing.assert_close(ops.mean(x, dim, keepdim), torch.mean(x, dim, keepdim))
    xb = x.bfloat16()
    assert ops.sum(xb, dtype=torch.float32).dtype == torch.float32
    torch.testing.assert_close(ops.sum(xb, dtype=torch.float32), xb.double().sum(-1).float())
    assert ops.mean(x, dtype=torch.float16).dtype == torch.float16  # casts first, like torch
    assert ops.sum(torch.tensor(3.0)).item() == 3.0
    assert ops.sum(torch.ones(2, 0)).tolist() == [0.0, 0.0]
    assert ops.mean(torch.ones(2, 0)).isnan().all()
    assert ops.sum(torch.ones(0, 3)).shape == (0,)
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        ops.sum(torch.ones(3, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rows_are_batch_invariant(dtype):
    x = randn(1000, 4099, dtype=dtype, seed=1)
    check_prefixes(ops.sum, x, INVARIANCE_MS)
    check_prefixes(ops.mean, x, INVARIANCE_MS)
    check_moved_row(ops.sum, x, MOVES)
    # A length where torch's own CPU sum changes its bits with M (see the negative control below).
    x = randn(130, 65536, seed=2)
    check_prefixes(ops.sum, x, [1, 2, 3, 17, 129])
    check_moved_row(ops.mean, x, MOVES)


@pytest.mark.parametrize("n", [3, 577, 20011])
def test_cpu_short_rows_through_torch_sum_are_batch_invariant(n):
    # Rows under ATen's grain go to torch's own sum (reduce.row_sums): odd lengths put rows at every alignment.
    x = randn(300, n, seed=n, scale=1e3)
    check_prefixes(ops.sum, x, [1, 2, 3, 17, 299])
    check_moved_row(ops.sum, x, MOVES)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.sum(x)
    finally:
        torch.set_num_threads(threads)
    assert same_bits(one, ops.sum(x))


def test_cpu_strided_and_non_last_dims_keep_row_bits():
    x = randn(40, 300, seed=3)
    full = ops.sum(x)
    assert same_bits(ops.sum(x.t().contiguous(), dim=0), full)
    assert same_bits(ops.sum(x.t(), dim=0), full)
    assert same_bits(ops.sum(x[:, None, :], dim=-1)[:, 0], full)


def test_fold_rows_order_is_fixed_pairwise():
    # [a, b, c, d, e] -> [a+d, b+e, c] -> [(a+d)+c, b+e] -> ((a+d)+c)+(b+e)
    x = torch.tensor([[1e8, 1.0, -1e8, 1.0, 1.0]])
    a, b, c, d, e = x[0].tolist()
    expected = torch.tensor(a + d, dtype=torch.float32) + c + torch.tensor(b + e, dtype=torch.float32)
    assert same_bits(fold_rows(x, torch.add), expected.reshape(1))


# Negative controls: the harness sees a difference when there is one.


def split_count_sum(x: torch.Tensor) -> torch.Tensor:
    # Like a split-K kernel: more splits when the batch is small, each split folded, then the partials.
    splits = 4 if x.shape[0] < 64 else 1
    parts = fold_rows(x.reshape(x.shape[0] * splits, -1), torch.add).reshape(x.shape[0], splits)
    return fold_rows(parts, torch.add)


def test_negative_control_split_count_from_m_is_caught():
    x = randn(200, 4096, seed=4)
    with pytest.raises(AssertionError, match="rows differ"):
        check_prefixes(split_count_sum, x, [1, 2, 3, 17, 64, 200])


def test_negative_control_neighbour_dependence_is_caught():
    # A running sum over the batch passes every prefix check but not a row moved among other neighbours.
    x = randn(200, 64, seed=5)
    check_prefixes(lambda t: t.cumsum(0), x, [1, 2, 3, 17, 200])
    with pytest.raises(AssertionError, match="row moved"):
        check_moved_row(lambda t: t.cumsum(0), x, MOVES)


def test_negative_control_torch_cpu_sum_varies_with_m():
    # Measured with torch 2.13 on the 2-core CPU machines: torch's fp32 sum over the last dim of a 65536-long row
    # gives other bits at M=1 than at M>=2 (one row is split across threads); shorter rows (<=40000) and one
    # thread did not vary, nor did torch's softmax, log_softmax, mean below 65536 or F.rms_norm.
    if torch.get_num_threads() < 2:
        pytest.skip("torch's single-row split needs two threads")
    x = randn(8, 65536, seed=6)
    if torch.equal(torch.sum(x[:1], -1), torch.sum(x, -1)[:1]):
        pytest.skip("this torch build's CPU sum no longer varies with M here")
    with pytest.raises(AssertionError, match="rows differ"):
        check_prefixes(lambda t: torch.sum(t, -1), x, [1, 8])


# The Triton kernel, run by the interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1).
# Small blocks force the chunk loop; several rows per program exercise the 2-D layout.
TRITON_CONFIGS = [RowConfig(block=256, rows=1, num_warps=4), RowConfig(block=64, rows=4, num_warps=4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n", [(1, 1), (3, 7), (17, 576), (64, 1000), (5, 4099)])
def test_triton_matches_fp64(m, n, dtype):
    x = randn(m, n, dtype=dtype, seed=m + n)
    for cfg in [None, *TRITON_CONFIGS]:
        check_sum_and_mean(x, _row_sum_triton(x, False, dtype, cfg), _row_sum_triton(x, True, dtype, cfg))


@pytest.mark.parametrize("cfg", TRITON_CONFIGS)
def test_triton_rows_are_batch_invariant(cfg):
    x = randn(40, 1000, seed=7)
    op = lambda t: _row_sum_triton(t, False, torch.float32, cfg)
    check_prefixes(op, x, [1, 2, 3, 7, 17])
    check_moved_row(op, x, [(2, 1), (9, 6), (17, 16)])


def test_row_config_depends_only_on_n():
    assert row_config(4096) == RowConfig(block=4096, rows=1, num_warps=8)
    assert row_config(576).block == 1024 and row_config(128).rows > 1
    assert row_config(151936) == row_config(20000)  # long rows: fixed chunk width
