import importlib

import pytest
import torch
from invariance import INVARIANCE_MS, MOVES, SIZES, check_moved_row, check_prefixes, randn, same_bits

from lockstep import ops
from lockstep.ops.reduce import RowConfig
from lockstep.ops.rms_norm import _rms_norm_triton

LENGTHS = [1, 7, 576, 1000, 4099]
EPS = 1e-6


def reference(x, weight, residual=None):
    """HF LlamaRMSNorm's rounding in fp64: normalize, round to x's dtype, times weight, round. -> (out, h, rstd)."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    rstd = torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + EPS)
    y = (h.double() * rstd).to(x.dtype)
    out = y if weight is None else (y.double() * weight.double()).to(x.dtype)
    return out, h, rstd


def check_close(out, ref, ulps):
    # |out - ref| within `ulps` units of the output dtype's epsilon, relative to |ref| (plus a floor near zero).
    eps = torch.finfo(out.dtype).eps if out.dtype != torch.float32 else 4e-7
    bound = ulps * eps * (ref.double().abs() + 1e-3)
    assert out.dtype == ref.dtype and ((out.double() - ref.double()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("m", SIZES)
def test_cpu_matches_fp64_hf_rounding(m, n, dtype):
    x, r, w = randn(m, n, dtype=dtype, seed=1), randn(m, n, dtype=dtype, seed=2), randn(n, dtype=dtype, seed=3)
    ref_out, ref_h, ref_rstd = reference(x, w, r)
    out, h = ops.rms_norm(x, w, EPS, r)
    assert same_bits(h, ref_h)  # the residual add is one rounding, exact
    # fp32 vs fp64 rstd can tip the first rounding; the weight product and the second rounding add to it.
    check_close(out, ref_out, ulps=2)
    check_close(ops.rms_norm(x, None, EPS), reference(x, None)[0], ulps=1)
    _, rstd = ops.rms_norm_with_rstd(h, w, EPS)
    assert rstd.dtype == torch.float32 and ((rstd.double() - ref_rstd).abs() / ref_rstd).max() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_with_rstd_matches_aten_fused_rms_norm_layout(dtype):
    # rms_norm_with_rstd stands in for aten::_fused_rms_norm(x, [N], weight, eps) -> (out, rstd [..., 1] fp32).
    x, w = randn(2, 5, 64, dtype=dtype, seed=1), randn(64, dtype=dtype, seed=2)
    for weight, eps in [(w, EPS), (None, None)]:
        out, rstd = ops.rms_norm_with_rstd(x, weight, eps)
        t_out, t_rstd = torch.ops.aten._fused_rms_norm(x, [64], weight, eps)
        assert out.shape == t_out.shape and out.dtype == t_out.dtype
        assert rstd.shape == t_rstd.shape == (2, 5, 1) and rstd.dtype == t_rstd.dtype == torch.float32
        torch.testing.assert_close(rstd, t_rstd, rtol=1e-6, atol=0)
        # torch rounds once (x * rstd * weight in fp32), HF and lockstep round before the weight: 1 ulp apart.
        torch.testing.assert_close(out.float(), t_out.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)


def test_3d_strided_empty_and_mixed_dtype_inputs():
    x, w = randn(2, 3, 8, seed=1), randn(8, seed=2)
    # Leading dims are rows: the bits of the same rows flattened to 2-D, and of the HF-rounding reference's values.
    out = ops.rms_norm(x, w, EPS)
    assert same_bits(out, ops.rms_norm(x.reshape(6, 8), w, EPS).reshape(2, 3, 8))
    check_close(out, reference(x, w)[0], ulps=2)
    # Strided rows: the bits of the same rows made contiguous.
    strided = x[..., ::2]
    assert same_bits(ops.rms_norm(strided, w[:4], EPS), ops.rms_norm(strided.contiguous(), w[:4], EPS))
    assert ops.rms_norm(torch.empty(0, 8), w, EPS).shape == (0, 8)
    # An fp32 weight with bf16 x: the output keeps x's dtype and rounds like the reference.
    xb = x.bfloat16()
    check_close(ops.rms_norm(xb, w, EPS), reference(xb, w)[0], ulps=2)


def test_bad_shapes_and_dtypes_raise():
    x, w = randn(2, 3, 8, seed=1), randn(8, seed=2)
    with pytest.raises(ValueError, match="weight must have shape"):
        ops.rms_norm(x, randn(7), EPS)
    with pytest.raises(ValueError, match="residual must match"):
        ops.rms_norm(x, w, EPS, x.bfloat16())
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        ops.rms_norm(x.double(), w, EPS)


def fused(weight):
    # [M, 2N] = [x | residual] -> [M, 2N] = [out | h], so one tensor carries both results through the checks.
    def op(t):
        n = t.shape[1] // 2
        return torch.cat(ops.rms_norm(t[:, :n], weight, EPS, t[:, n:]), dim=1)

    return op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [576, 4099])
def test_cpu_rows_are_batch_invariant(n, dtype):
    x, w = randn(1000, n, dtype=dtype, seed=1), randn(n, dtype=dtype, seed=2)
    op = lambda t: ops.rms_norm(t, w, EPS)
    check_prefixes(op, x, INVARIANCE_MS)
    check_moved_row(op, x, MOVES)
    xr = randn(1000, 2 * n, dtype=dtype, seed=3)
    check_prefixes(fused(w), xr, INVARIANCE_MS)
    check_moved_row(fused(w), xr, MOVES)


# The Triton kernel, run by the interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1).
# Small blocks force the two-pass chunk loop; several rows per program exercise the 2-D layout.
TRITON_CONFIGS = [None, RowConfig(block=256, rows=1, num_warps=4), RowConfig(block=64, rows=4, num_warps=4)]
TRITON_CASES = [(1, 1, 0), (3, 7, 0), (3, 7, 2), (17, 576, 0), (17, 576, 2), (64, 1000, 0), (5, 4099, 0), (5, 4099, 1)]
# The interpreter rounds fp32 -> bf16 by truncation (GPUs round to nearest even): allow a few ulps there.
TRITON_ULPS = {torch.float32: 2, torch.bfloat16: 4, torch.float16: 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, config", TRITON_CASES)
def test_triton_matches_fp64(m, n, config, dtype):
    x, r, w = randn(m, n, dtype=dtype, seed=1), randn(m, n, dtype=dtype, seed=2), randn(n, dtype=dtype, seed=3)
    cfg, ulps = TRITON_CONFIGS[config], TRITON_ULPS[dtype]
    out, h, rstd = _rms_norm_triton(x, w, EPS, r, config=cfg)
    check_close(h, (x.double() + r.double()).to(dtype), ulps)
    check_close(out, reference(h, w)[0], ulps)  # normalizing the h it computed
    ref_rstd = torch.rsqrt(h.double().pow(2).mean(-1) + EPS)
    assert ((rstd.double() - ref_rstd).abs() / ref_rstd).max() < 1e-5
    check_close(_rms_norm_triton(x, None, EPS, config=cfg)[0], reference(x, None)[0], ulps)


@pytest.mark.parametrize("cfg", TRITON_CONFIGS[1:])
def test_triton_rows_are_batch_invariant(cfg):
    n = 600
    x, w = randn(40, 2 * n, seed=1), randn(n, seed=2)

    def op(t):
        out, h, _ = _rms_norm_triton(t[:, :n], w, EPS, t[:, n:], config=cfg)
        return torch.cat([out, h], dim=1)

    check_prefixes(op, x, [1, 2, 3, 7, 17])
    check_moved_row(op, x, [(2, 1), (9, 6), (17, 16)])


def fused_qkv(dtype, tokens=5, q_heads=4, k_heads=2, n=128):
    """A fused QKV output ``[tokens, (q_heads + 2 * k_heads) * n]``: q, k and v heads side by side in each row."""
    return randn(tokens, (q_heads + 2 * k_heads) * n, dtype=dtype, seed=4), tokens, q_heads, k_heads, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [None, 2])
def test_triton_heads_of_a_strided_view_need_no_copy(dtype, config):
    # q and k inside a fused QKV output: [tokens, heads, N] views whose rows cannot be flattened without a copy.
    # Each head's row gets the bits of the same row made contiguous and normalized as 2-D, the k heads too.
    qkv, tokens, q_heads, k_heads, n = fused_qkv(dtype)
    cfg = TRITON_CONFIGS[config] if config is not None else None
    w = randn(n, dtype=dtype, seed=5)
    for lo, heads in ((0, q_heads), (q_heads * n, k_heads)):
        view = qkv[:, lo : lo + heads * n].view(tokens, heads, n)
        assert view.stride() == (qkv.shape[1], n, 1)
        out, h, rstd = _rms_norm_triton(view, w, EPS, config=cfg)
        flat, _, flat_rstd = _rms_norm_triton(view.reshape(-1, n), w, EPS, config=cfg)
        assert out.shape == view.shape and out.is_contiguous() and h is view
        assert same_bits(out.reshape(-1, n), flat) and torch.equal(rstd, flat_rstd)
    with pytest.raises(ValueError, match="no residual"):
        _rms_norm_triton(view, w, EPS, residual=view)


def test_cuda_dispatch_hands_the_strided_heads_over_uncopied(monkeypatch):
    # ops.rms_norm on CUDA gives the kernel the [tokens, heads, N] view itself (is_cuda faked; the kernel stubbed).
    module = importlib.import_module("lockstep.ops.rms_norm")  # the attribute lockstep.ops.rms_norm is the function
    view = randn(5, 96, seed=6)[:, :64].view(5, 4, 16)
    seen = []

    def kernel(x, weight, eps, residual=None, config=None):
        seen.append(x)
        return torch.zeros(x.shape), x, torch.zeros(x.shape[0] * x.shape[1])

    monkeypatch.setattr(module, "_rms_norm_triton", kernel)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert ops.rms_norm(view, randn(16, seed=7), EPS).shape == view.shape
    assert seen[0] is view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [None, 2])
def test_triton_q_and_k_heads_in_one_launch(dtype, config):
    # Qwen3's q and k norms over the adjacent heads of the fused QKV output, two weights in one launch: each head
    # gets the bits of its own launch with its own weight.
    qkv, tokens, q_heads, k_heads, n = fused_qkv(dtype)
    cfg = TRITON_CONFIGS[config] if config is not None else None
    wq, wk = randn(n, dtype=dtype, seed=5), randn(n, dtype=dtype, seed=6)
    q = qkv[:, : q_heads * n].view(tokens, q_heads, n)
    k = qkv[:, q_heads * n : (q_heads + k_heads) * n].view(tokens, k_heads, n)
    both = qkv[:, : (q_heads + k_heads) * n].view(tokens, q_heads + k_heads, n)
    out, _, rstd = _rms_norm_triton(both, wq, EPS, config=cfg, second=(wk, q_heads))
    want_q, _, rstd_q = _rms_norm_triton(q, wq, EPS, config=cfg)
    want_k, _, rstd_k = _rms_norm_triton(k, wk, EPS, config=cfg)
    assert same_bits(out[:, :q_heads], want_q) and same_bits(out[:, q_heads:], want_k)
    assert torch.equal(rstd.view(tokens, -1), torch.cat((rstd_q.view(tokens, -1), rstd_k.view(tokens, -1)), 1))
    assert not same_bits(out[:, q_heads:], _rms_norm_triton(k, wq, EPS, config=cfg)[0])  # the weight does matter


@pytest.mark.parametrize("tokens", [3, 1])
def test_rms_norm_qk_takes_one_launch_for_adjacent_heads(monkeypatch, tokens):
    # The public op with CUDA faked (the kernel runs in the interpreter): adjacent q and k views take one launch
    # (the outputs are views of one tensor), with the bits of two rms_norm calls; other layouts take two. One token
    # (a batch-1 decode step) too, where torch gives the q and k views different strides for their size-1 dim.
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    qkv = randn(tokens, 8 * 16, dtype=torch.bfloat16, seed=8)
    q, k = qkv[:, : 4 * 16].view(tokens, 4, 16), qkv[:, 4 * 16 : 6 * 16].view(tokens, 2, 16)
    wq, wk = randn(16, dtype=torch.bfloat16, seed=3), randn(16, dtype=torch.bfloat16, seed=4)
    got_q, got_k = ops.rms_norm_qk(q, k, wq, wk, EPS)
    assert got_k.data_ptr() == got_q.data_ptr() + 4 * 16 * got_q.element_size()
    assert same_bits(got_q, ops.rms_norm(q, wq, EPS)) and same_bits(got_k, ops.rms_norm(k, wk, EPS))
    apart_k = qkv[:, 5 * 16 : 7 * 16].view(tokens, 2, 16)  # not right after q
    got_q, got_k = ops.rms_norm_qk(q, apart_k, wq, wk, EPS)
    assert got_k.data_ptr() != got_q.data_ptr() + 4 * 16 * got_q.element_size()
    assert same_bits(got_k, ops.rms_norm(apart_k, wk, EPS))


def test_rms_norm_qk_off_the_gpu_is_two_rms_norms():
    q, k = randn(3, 4, 16, seed=1), randn(3, 2, 16, seed=2)
    wq, wk = randn(16, seed=3), randn(16, seed=4)
    got_q, got_k = ops.rms_norm_qk(q, k, wq, wk, EPS)
    assert same_bits(got_q, ops.rms_norm(q, wq, EPS)) and same_bits(got_k, ops.rms_norm(k, wk, EPS))


# Negative control: an RMSNorm whose sum of squares is chunked by M, like a kernel that picks its split from the
# batch. The same harness that passes above must fail on it.
def test_negative_control_batch_dependent_rms_norm_is_caught():
    def split_by_m(t):
        splits = 4 if t.shape[0] < 64 else 1
        sq = t * t
        ss = sq.reshape(t.shape[0], splits, -1).sum(-1).sum(-1)
        return t * torch.rsqrt(ss / t.shape[1] + EPS)[:, None]

    x = randn(128, 4096, seed=4)
    with pytest.raises(AssertionError, match="rows differ"):
        check_prefixes(split_by_m, x, [1, 2, 3, 17, 64, 128])
