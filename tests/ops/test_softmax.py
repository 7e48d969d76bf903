import pytest
import torch
from invariance import INVARIANCE_MS, MOVES, SIZES, check_moved_row, check_prefixes, same_bits
from invariance import randn as base_randn

from lockstep import ops
from lockstep.ops.reduce import RowConfig, fold_rows
from lockstep.ops.softmax import _softmax_triton

LENGTHS = [1, 7, 576, 1000, 4099]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def randn(*shape, dtype=torch.float32, seed=0, scale=3.0):
    return base_randn(*shape, dtype=dtype, seed=seed, scale=scale)


def check_close(out, x, log, dtype, ulps=1):
    # Against fp64 on the same (already rounded) inputs: `ulps` of the output dtype, or fp32 arithmetic error.
    ref = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
    rtol = {torch.float32: 4e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype] * ulps
    atol = {torch.float32: 1e-6 if log else 1e-12, torch.bfloat16: 1e-12, torch.float16: 1e-7}[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("m", SIZES)
def test_cpu_matches_fp64(m, n, dtype):
    x = randn(m, n, dtype=dtype, seed=m * n)
    check_close(ops.softmax(x), x, False, dtype)
    check_close(ops.log_softmax(x), x, True, dtype)


def test_masked_logits_dims_and_dtypes_follow_torch():
    x = randn(9, 300, seed=1)
    x[x < -2.0] = -torch.inf  # masked logits, as top-k/top-p sampling leaves them
    x[4] = -torch.inf  # a fully masked row is NaN, as in torch
    for log, fn, ref in [(False, ops.softmax, torch.softmax), (True, ops.log_softmax, torch.log_softmax)]:
        torch.testing.assert_close(fn(x), ref(x, -1), equal_nan=True)
        y = randn(5, 6, 7, seed=2)
        for dim in [0, 1, -2]:
            out = fn(y, dim)
            assert out.is_contiguous()
            torch.testing.assert_close(out, ref(y, dim))
        assert same_bits(fn(y, 0), fn(y.movedim(0, -1), -1).movedim(-1, 0))
        yb = y.bfloat16()
        torch.testing.assert_close(fn(yb, dtype=torch.float32), ref(yb, -1, dtype=torch.float32))
        # A narrower dtype casts the input first, as torch does (whose bf16 log_softmax is 1 ulp off at times).
        check_close(fn(y, dtype=torch.bfloat16), y.bfloat16(), log, torch.bfloat16)
        assert fn(torch.tensor(2.0)).shape == () and fn(torch.empty(0, 5)).shape == (0, 5)
        assert fn(torch.empty(3, 0)).shape == (3, 0)
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        ops.softmax(torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("log", [False, True])
def test_cpu_rows_are_batch_invariant(log, dtype):
    fn = ops.log_softmax if log else ops.softmax
    x = randn(1000, 4099, dtype=dtype, seed=1)
    check_prefixes(fn, x, INVARIANCE_MS)
    check_moved_row(fn, x, MOVES)
    if dtype == torch.float32:  # a vocabulary's worth of logits
        x = randn(130, 49152, seed=2)
        check_prefixes(fn, x, [1, 2, 3, 17, 129])
        check_moved_row(fn, x, MOVES[:4])


# The Triton kernel, run by the interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1).
# Small blocks force the two-pass online loop; several rows per program exercise the 2-D layout.
TRITON_CONFIGS = [None, RowConfig(block=256, rows=1, num_warps=4), RowConfig(block=64, rows=4, num_warps=4)]
TRITON_CASES = [(1, 1, 0), (3, 7, 0), (3, 7, 2), (17, 576, 0), (17, 576, 2), (64, 1000, 0), (5, 4099, 0), (5, 4099, 1)]
# The interpreter rounds fp32 -> bf16 by truncation (GPUs round to nearest even): one ulp more there.
TRITON_ULPS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 1}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, config", TRITON_CASES)
def test_triton_matches_fp64(m, n, config, dtype):
    x = randn(m, n, dtype=dtype, seed=m + n)
    if m > 1:
        x[1] = x[1].sort().values  # the running max grows in every chunk
    if m > 2:
        x[2, ::3] = -torch.inf  # masked logits
    cfg = TRITON_CONFIGS[config]
    for log in [False, True]:
        check_close(_softmax_triton(x, log, dtype, cfg), x, log, dtype, TRITON_ULPS[dtype])
    if dtype != torch.float32:
        check_close(_softmax_triton(x, False, torch.float32, cfg), x, False, torch.float32)


@pytest.mark.parametrize("cfg", TRITON_CONFIGS[1:])
def test_triton_rows_are_batch_invariant(cfg):
    x = randn(40, 600, seed=3)
    for log in [False, True]:
        op = lambda t, log=log: _softmax_triton(t, log, torch.float32, cfg)
        check_prefixes(op, x, [1, 2, 3, 17])
        check_moved_row(op, x, [(2, 1), (9, 6)])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on the interpreter's -inf - -inf
def test_triton_fully_masked_row_is_nan_like_torch():
    x = randn(3, 600, seed=4)
    x[1] = -torch.inf
    for cfg in TRITON_CONFIGS:
        out = _softmax_triton(x, False, torch.float32, cfg)
        assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


# Negative control. torch's own CPU softmax/log_softmax did not vary with M here (torch 2.13, N up to 49152),
# so the control is constructed: a softmax whose sum of exponentials is split by the batch size, as a kernel
# that picks its split count from M would. The same harness that passes above must fail on it.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on the interpreter's -inf - -inf
@pytest.mark.parametrize("cfg", TRITON_CONFIGS)
def test_triton_row_stats_give_log_softmaxs_bits(cfg):
    # The stats pass (max, log of the sum) and the two subtractions of log_softmax_at against the whole
    # log_softmax gathered: rows that fit one block and rows that take the chunked pass, -inf entries and a
    # fully masked row.
    x = randn(7, 700, seed=4)
    x[2, ::3] = float("-inf")
    x[5] = float("-inf")
    index = torch.tensor([0, 699, 3, 350, 17, 5, 640])
    for n in (200, 700):
        xs = x[:, :n].contiguous()
        idx = index % n
        full = _softmax_triton(xs, True, torch.float32, config=cfg).gather(1, idx[:, None])[:, 0]
        stats = _softmax_triton(xs, True, torch.float32, config=cfg, stats=True)
        got = (xs.gather(1, idx[:, None])[:, 0] - stats[:, 0]) - stats[:, 1]
        rows = [0, 1, 2, 3, 4, 6]  # row 5 is NaN both ways, with whichever NaN bits each backend makes
        assert same_bits(got[rows], full[rows]) and got[5].isnan() and full[5].isnan()


def test_log_softmax_at_is_the_gathered_log_softmax(monkeypatch):
    x = randn(5, 300, seed=6)
    index = torch.tensor([1, 299, 0, 150, 7])
    want = ops.log_softmax(x, -1).gather(1, index[:, None])[:, 0]
    assert same_bits(ops.log_softmax_at(x, index), want)  # the CPU: the whole log_softmax, gathered
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the stats path, interpreted
    assert same_bits(ops.log_softmax_at(x, index), ops.log_softmax(x, -1).gather(1, index[:, None])[:, 0])
    with pytest.raises(ValueError, match="do not fit"):
        ops.log_softmax_at(x, index[:3])


def test_negative_control_batch_dependent_softmax_is_caught():
    def split_by_m(t):
        splits = 4 if t.shape[0] < 64 else 1
        e = torch.exp(t - t.amax(-1, keepdim=True))
        parts = fold_rows(e.reshape(t.shape[0] * splits, -1), torch.add).reshape(t.shape[0], splits)
        return e / fold_rows(parts, torch.add)[:, None]

    x = randn(128, 4096, seed=5)
    with pytest.raises(AssertionError, match="rows differ"):
        check_prefixes(split_by_m, x, [1, 2, 3, 17, 64, 128])
