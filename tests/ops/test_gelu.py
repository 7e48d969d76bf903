"""ops.gelu: values against an fp64 reference, and bitwise invariance of an element to the tensor around it (its
offset, the tensor's length, rows before it, the thread count) on the CPU path. Negative control: torch's own
fused CPU ``F.gelu``, whose vector body and scalar tail round differently (the reason ops.gelu composes it)."""

import math

import pytest
import torch
import torch.nn.functional as F
from invariance import check_moved_row, check_prefixes, randn, same_bits

from lockstep import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
APPROXIMATE = ["none", "tanh"]
# (start, length) windows of one tensor: vector-body and scalar-tail positions, lengths below and above a vector
WINDOWS = [(s, n) for s in (0, 1, 3, 7, 13, 100) for n in (1, 2, 3, 5, 7, 9, 15, 16, 17, 31, 33, 63, 64, 65, 127, 1000)]


def reference(x, approximate):
    xd = x.double()
    if approximate == "tanh":
        return 0.5 * xd * (1 + torch.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd**3)))
    return 0.5 * xd * (1 + torch.erf(xd / math.sqrt(2)))


def differing_windows(op, x):
    """How many WINDOWS of x the op gives other bits than it gives the same elements inside all of x."""
    full = op(x)
    return sum(not same_bits(op(x[s : s + n]), full[s : s + n]) for s, n in WINDOWS)


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_fp64(dtype, approximate):
    x = randn(4099, dtype=dtype, seed=1, scale=4.0)
    out = ops.gelu(x, approximate)
    assert out.dtype == dtype and out.shape == x.shape
    eps = 4e-7 if dtype == torch.float32 else torch.finfo(dtype).eps
    # relative to |x|: for x < 0, 1 + erf (or 1 + tanh) cancels, and its absolute error is x's times eps
    err = (out.double() - reference(x, approximate)).abs()
    assert (err <= 2 * eps * (x.double().abs() + 1e-3)).all(), f"max err {err.max().item()}"
    # torch's own within the same rounding
    torch.testing.assert_close(out, F.gelu(x, approximate=approximate))


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_elements_are_invariant(dtype, approximate):
    x = randn(4099, dtype=dtype, seed=2, scale=4.0)
    op = lambda t: ops.gelu(t, approximate)
    assert differing_windows(op, x) == 0
    rows = randn(300, 1152, dtype=dtype, seed=3, scale=4.0)  # [patches, hidden]: rows as the vision MLP has them
    check_prefixes(op, rows, [1, 2, 3, 7, 17, 64, 129])
    check_moved_row(op, rows, [(2, 1), (17, 16), (40, 3)])
    odd = randn(37, 4303, dtype=dtype, seed=4, scale=4.0)  # rows that end mid-vector
    check_prefixes(op, odd, [1, 2, 3, 17])


def test_cpu_elements_are_invariant_to_the_thread_count():
    x = randn(200_003, seed=5, scale=4.0)  # past ATen's grain: two threads split it
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [ops.gelu(x, a) for a in APPROXIMATE]
        torch.set_num_threads(2)
        two = [ops.gelu(x, a) for a in APPROXIMATE]
    finally:
        torch.set_num_threads(previous)
    assert all(same_bits(a, b) for a, b in zip(one, two, strict=True))
    assert same_bits(ops.gelu(x[:1000]), one[0][:1000])


def test_negative_control_torch_fused_gelu_follows_the_offset():
    # On the machines this was written on (AMD EPYC, torch 2.13) F.gelu gave other bits for some windows in every
    # dtype and form; a CPU whose kernels agree makes the control moot, not the op wrong.
    found = sum(
        differing_windows(lambda t, a=a: F.gelu(t, approximate=a), randn(4099, dtype=d, seed=2, scale=4.0))
        for d in DTYPES
        for a in APPROXIMATE
    )
    if found == 0:
        pytest.skip("torch's fused F.gelu gave the same bits at every offset on this CPU")
    assert found > 0


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="approximate"):
        ops.gelu(torch.ones(3), "fast")
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        ops.gelu(torch.ones(3, dtype=torch.float64))
