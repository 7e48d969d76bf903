"""ops.layer_norm: values against an fp64 reference on odd sizes, and bitwise row invariance (prefixes, a row moved
among other rows, rows permuted) on the CPU path and on the Triton kernel under the interpreter (fp32, small).
Negative controls: the harness sees the order of a row's sums change, and a LayerNorm whose row sums go through a
BLAS call shaped by the batch."""

import pytest
import torch
import torch.nn.functional as F
from invariance import INVARIANCE_MS, MOVES, SIZES, check_moved_row, check_prefixes, randn, same_bits

from lockstep import ops
from lockstep.ops.layer_norm import _layer_norm_cpu, _layer_norm_triton
from lockstep.ops.reduce import RowConfig

# Qwen3-VL's vision head_dim and hidden (72, 1152), Qwen2.5-VL's (80, 1280), odd ones, and a row past ATen's grain
# (row_sums folds it pairwise).
LENGTHS = [1, 72, 80, 1152, 1280, 4099]
EPS = 1e-6


def reference(x, weight, bias):
    """fp64 LayerNorm of x's values, rounded to x's dtype once."""
    xd = x.double()
    y = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + EPS)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y


def check_close(out, ref, dtype):
    # fp32 inside: a few fp32 ulps of the normalized value, plus the output's one rounding.
    tol = 4 * torch.finfo(dtype).eps if dtype != torch.float32 else 2e-6
    assert out.dtype == dtype
    err = (out.double() - ref).abs()
    assert (err <= tol * (ref.abs() + 1)).all(), f"max err {err.max().item()}"


def inputs(m, n, dtype, seed=0):
    # an offset and a scale, so the mean matters
    x = (randn(m, n, seed=seed + 1, scale=3.0) + 1.5).to(dtype)
    return x, randn(n, dtype=dtype, seed=seed + 2), randn(n, dtype=dtype, seed=seed + 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("m", SIZES)
def test_cpu_matches_fp64(m, n, dtype):
    x, w, b = inputs(m, n, dtype)
    check_close(ops.layer_norm(x, w, b, EPS), reference(x, w, b), dtype)
    check_close(ops.layer_norm(x, w, None, EPS), reference(x, w, None), dtype)
    check_close(ops.layer_norm(x, None, None, EPS), reference(x, None, None), dtype)


def test_matches_torch_layer_norm_and_takes_any_leading_shape():
    x, w, b = inputs(6, 80, torch.float32)
    torch.testing.assert_close(ops.layer_norm(x, w, b, EPS), F.layer_norm(x, (80,), w, b, EPS), rtol=1e-5, atol=1e-5)
    # bf16 x with fp32 weights (a model that keeps its norms in fp32): x's dtype out, the same values as fp32 weights
    xb = x.bfloat16()
    assert ops.layer_norm(xb, w, b, EPS).dtype == torch.bfloat16
    check_close(ops.layer_norm(xb, w, b, EPS), reference(xb, w, b), torch.bfloat16)
    assert same_bits(ops.layer_norm(x.view(2, 3, 80), w, b, EPS), ops.layer_norm(x, w, b, EPS).view(2, 3, 80))
    strided = torch.cat([x, x], 1)[:, ::2]
    assert same_bits(ops.layer_norm(strided, w, b, EPS), ops.layer_norm(strided.contiguous(), w, b, EPS))
    assert ops.layer_norm(torch.empty(0, 80), w, b, EPS).shape == (0, 80)


def test_bad_inputs_raise():
    x, w, b = inputs(2, 8, torch.float32)
    with pytest.raises(ValueError, match="weight must have shape"):
        ops.layer_norm(x, w[:7], b, EPS)
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.layer_norm(x, w, b[:7], EPS)
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        ops.layer_norm(x.double(), w, b, EPS)


def permuted(op, x):
    """Rows in a shuffled order keep their bits."""
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(7))
    assert same_bits(op(x[perm]), op(x)[perm])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [72, 1152, 4099])
def test_cpu_rows_are_batch_invariant(n, dtype):
    x, w, b = inputs(1000, n, dtype)
    op = lambda t: ops.layer_norm(t, w, b, EPS)
    check_prefixes(op, x, INVARIANCE_MS)
    check_moved_row(op, x, MOVES)
    permuted(op, x)


def test_cpu_rows_are_invariant_to_the_thread_count():
    x, w, b = inputs(300, 1152, torch.float32)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.layer_norm(x, w, b, EPS)
        torch.set_num_threads(2)
        two = ops.layer_norm(x, w, b, EPS)
    finally:
        torch.set_num_threads(previous)
    assert same_bits(one, two)


def blas_sum_layer_norm(x, w, b):
    """A LayerNorm whose two row sums are matmuls with a ones vector: the BLAS picks its kernel from the row count."""
    n = x.shape[1]
    ones = torch.ones(1, n)
    mean = F.linear(x, ones)[:, 0] / n
    d = x - mean[:, None]
    var = F.linear(d * d, ones)[:, 0] / n
    return d * torch.rsqrt(var + EPS)[:, None] * w + b


def test_negative_controls_the_harness_sees_a_difference():
    x, w, b = inputs(200, 1152, torch.float32)
    # The same rows with their columns summed in another order: the order of the sums shows in the bits.
    perm = torch.randperm(1152, generator=torch.Generator().manual_seed(3))
    shuffled = ops.layer_norm(x[:, perm], w[perm], b[perm], EPS)[:, perm.argsort()]
    assert not same_bits(shuffled, ops.layer_norm(x, w, b, EPS))
    with pytest.raises(AssertionError, match="rows differ"):
        check_prefixes(lambda t: blas_sum_layer_norm(t, w, b), x, [1, 2, 3, 7, 17, 64, 127])


# The Triton kernel, run by the interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1).
# Small blocks force the three-pass chunk loop; several rows per program exercise the 2-D layout.
TRITON_CONFIGS = [None, RowConfig(block=256, rows=1, num_warps=4), RowConfig(block=64, rows=4, num_warps=4)]
TRITON_CASES = [(1, 1, 0), (3, 72, 0), (3, 72, 2), (17, 1152, 0), (17, 1152, 1), (64, 80, 0), (5, 1280, 2)]


@pytest.mark.parametrize("m, n, config", TRITON_CASES)
def test_triton_matches_fp64(m, n, config):
    x, w, b = inputs(m, n, torch.float32)
    cfg = TRITON_CONFIGS[config]
    check_close(_layer_norm_triton(x, w, b, EPS, config=cfg), reference(x, w, b), torch.float32)
    check_close(_layer_norm_triton(x, None, None, EPS, config=cfg), reference(x, None, None), torch.float32)
    # the CPU path computes the same formula; both within fp32 rounding of each other
    torch.testing.assert_close(_layer_norm_triton(x, w, b, EPS, config=cfg), _layer_norm_cpu(x, w, b, EPS))


@pytest.mark.parametrize("cfg", TRITON_CONFIGS)
def test_triton_rows_are_batch_invariant(cfg):
    x, w, b = inputs(40, 600, torch.float32)
    op = lambda t: _layer_norm_triton(t, w, b, EPS, config=cfg)
    check_prefixes(op, x, [1, 2, 3, 7, 17])
    check_moved_row(op, x, [(2, 1), (9, 6), (17, 16)])
    permuted(op, x)
