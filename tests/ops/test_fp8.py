"""The FP8 linear: quantization formulas, an fp64 reference of the dequantized math, bitwise batch invariance on the
CPU path and on the Triton kernel (interpreter, every tile of the table), and a negative control."""

import pytest
import torch
from invariance import MOVES, SIZES, check_moved_row, check_prefixes, randn, same_bits

from lockstep.ops import fp8
from lockstep.ops.fp8 import FP8, FP8_CONFIGS, Fp8Config, _fp8_mm_triton, _quantize_torch, _quantize_triton


def bits8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def weights(kind: str, n: int, k: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight and its row scales: 128 x 128 blocks, per channel, or one per-tensor scale on every row."""
    w = randn(n, k, seed=seed) * torch.linspace(0.2, 3.0, n)[:, None]  # rows of different ranges
    if kind == "block":
        w8, s = fp8.quantize_weight(w, (128, 128))
        return w8, fp8.expand_block_scale(s, n, 128)
    if kind == "channel":
        return fp8.quantize_weight(w)
    scale = w.abs().amax() / fp8.FP8_MAX
    return (w / scale).to(FP8), scale.expand(n, 1).contiguous()


def reference(x, w8, ws, bias, group):
    # fp64 of the dequantized math: the quantized activations times the dequantized weight.
    a8, a_s = fp8.quantize_rows(x, group)
    ref = fp8.dequantize(a8, a_s).double() @ fp8.dequantize(w8, ws).double().t()
    return ref if bias is None else ref + bias.double()


@pytest.mark.parametrize("group", [None, 128])
def test_quantize_rows_formulas_and_the_kernel_agree(group):
    x = randn(37, 300, seed=1) * torch.logspace(-3, 2, 37)[:, None]
    x[5] = 0.0  # an all-zero row: finite scale, zero values
    q, s = _quantize_torch(x, group)
    assert s.shape == (37, 1 if group is None else 3)
    deq = fp8.dequantize(q, s)
    row_scale = s if group is None else s.repeat_interleave(128, 1)[:, :300]
    assert torch.all((deq - x).abs() <= x.abs() * 2**-4 + row_scale * 2**-9)
    # The largest magnitude of each scale block maps to 448 exactly.
    blocks = q.float().abs() if group is None else torch.nn.functional.pad(q.float().abs(), (0, 84)).view(37, 3, 128)
    top = blocks.amax(-1)
    assert torch.all((top == fp8.FP8_MAX) | (top == 0)) and torch.all(deq[5] == 0)
    tq, ts = _quantize_triton(x, group)  # the CUDA kernel, through the interpreter
    assert torch.equal(bits8(tq), bits8(q)) and torch.equal(ts, s)


def test_quantize_weight_blocks_take_their_own_amax():
    w = randn(200, 260, seed=3)
    w8, s = fp8.quantize_weight(w, (128, 128))
    assert s.shape == (2, 3)
    assert s[1, 2] == w[128:, 256:].abs().amax() / fp8.FP8_MAX
    assert rel_err(fp8.dequantize(w8, fp8.expand_block_scale(s, 200, 128)), w.double()) < 0.03


@pytest.mark.parametrize("kind", ["block", "channel", "tensor"])
@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("m", SIZES)
def test_fp8_linear_matches_the_fp64_dequantized_math(kind, group, m):
    k, n = 300, 77  # K a block and a ragged tail
    x, bias = randn(m, k, seed=1), randn(n, seed=3)
    w8, ws = weights(kind, n, k)
    out = fp8.fp8_linear(x, w8, ws, bias, act_group=group)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert rel_err(out, reference(x, w8, ws, bias, group)) < 1e-5
    # And against the unquantized product: only the e4m3 rounding of both operands separates them.
    assert rel_err(out, x.double() @ fp8.dequantize(w8, ws).double().t() + bias.double()) < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [None, 128])
def test_fp8_linear_rows_are_batch_invariant_on_the_cpu(dtype, group):
    x = randn(200, 300, dtype=dtype, seed=1)
    w8, ws = weights("block", 96, 300)
    op = lambda t: fp8.fp8_linear(t, w8, ws, act_group=group)  # noqa: E731
    check_prefixes(op, x, [1, 2, 3, 5, 17, 127, 200])
    check_moved_row(op, x, MOVES)


def test_fp8_linear_takes_leading_dims_and_rejects_bad_scales():
    x = randn(2, 5, 64, seed=1)
    w8, ws = weights("channel", 33, 64)
    assert torch.equal(fp8.fp8_linear(x, w8, ws), fp8.fp8_linear(x.view(10, 64), w8, ws).view(2, 5, 33))
    with pytest.raises(ValueError, match="weight scale"):
        fp8.fp8_linear(x, w8, ws[:, :1].expand(33, 2))
    with pytest.raises(ValueError, match="does not fit"):
        fp8.fp8_linear(x, w8.float(), ws)


# The Triton kernel under the interpreter (no e4m3 MMA there: the kernel upcasts the exact e4m3 values to fp32). One
# BK (128, the table's): the interpreter's dot sums a whole BK slice at once, so BK would change its bits; on the
# GPU bench/fp8_check.py compares every tile of the table.
INTERPRETER_CONFIGS = [Fp8Config(16, 32), Fp8Config(32, 16, group_m=2), Fp8Config(64, 64), *FP8_CONFIGS]


@pytest.mark.parametrize("kind", ["block", "channel"])
@pytest.mark.parametrize("group", [None, 128])
def test_triton_fp8_matmul_matches_fp64(kind, group):
    x, bias = randn(23, 300, seed=1), randn(45, seed=3)
    w8, ws = weights(kind, 45, 300)
    a8, a_s = fp8.quantize_rows(x, group)
    out = _fp8_mm_triton(a8, a_s, w8, ws, bias, torch.float32, Fp8Config(16, 32))
    assert rel_err(out, reference(x, w8, ws, bias, group)) < 1e-5


def test_triton_fp8_rows_do_not_depend_on_m_or_the_tile():
    x = randn(70, 260, seed=1)
    w8, ws = weights("block", 40, 260)
    a8, a_s = fp8.quantize_rows(x, 128)
    full = _fp8_mm_triton(a8, a_s, w8, ws, None, torch.float32, INTERPRETER_CONFIGS[0])
    for cfg in INTERPRETER_CONFIGS:
        for m in [1, 2, 3, 17, 70]:
            assert same_bits(_fp8_mm_triton(a8[:m], a_s[:m], w8, ws, None, torch.float32, cfg), full[:m]), (cfg, m)
    # A row among other neighbours, at another position.
    batch = randn(19, 260, seed=5)
    batch[11] = x[7]
    b8, b_s = fp8.quantize_rows(batch, 128)
    assert same_bits(_fp8_mm_triton(b8, b_s, w8, ws, None, torch.float32, INTERPRETER_CONFIGS[1])[11], full[7])


def test_negative_control_a_per_batch_activation_scale_moves_rows():
    # The harness sees a difference where there is one: one dynamic activation scale for the whole batch (what a
    # per-tensor dynamic scheme does) makes a row's bits depend on its neighbours.
    x = randn(64, 300, seed=1)
    w8, ws = weights("channel", 77, 300)

    def per_batch(t: torch.Tensor) -> torch.Tensor:
        scale = t.abs().amax() / fp8.FP8_MAX
        a8 = (t / scale).to(FP8)
        return fp8._fp8_mm_cpu(a8, scale.expand(t.shape[0], 1), w8, ws, None, torch.float32)

    full = per_batch(x)
    assert any(not same_bits(per_batch(x[:m]), full[:m]) for m in [1, 2, 3, 17])
