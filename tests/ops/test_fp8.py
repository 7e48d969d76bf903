"""The FP8 linear: quantization formulas, an fp64 reference of the dequantized math, bitwise batch invariance on the
CPU path and on the Triton kernel (interpreter, every tile of the table), and a negative control."""

import pytest
import torch
import triton
import triton.language as tl
from invariance import MOVES, SIZES, check_moved_row, check_prefixes, randn, same_bits

from lockstep.ops import fp8
from lockstep.ops.fp8 import (
    FP8,
    FP8_CONFIGS,
    Fp8Config,
    _fp8_linear_triton,
    _fp8_mm_triton,
    _quantize_torch,
    _quantize_triton,
)


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
INTERPRETER_CONFIGS = [
    Fp8Config(16, 32),
    Fp8Config(32, 16, group_m=2),
    Fp8Config(64, 64),
    Fp8Config(16, 32, blocks=2),
    Fp8Config(32, 16, blocks=4),
    Fp8Config(16, 64, swap=True),
    Fp8Config(8, 64, blocks=2, swap=True),
    *FP8_CONFIGS,
]  # blocks 2 and 4 over K = 260 (3 blocks): a loop step past K; swap: the transposed MMA


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


TMA_CONFIGS = [Fp8Config(16, 32, tma=True), Fp8Config(32, 16, blocks=2, tma=True), Fp8Config(64, 64, tma=True)]


def test_tma_tiles_give_the_pointer_tiles_bits(monkeypatch):
    # The TMA kernel against the pointer kernel's bits; blocks=2 over K = 272 (3
    # blocks) runs a step past K. It must really run: the launches are counted.
    launches = []
    kernel = fp8._fp8_mm_tma_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(fp8, "_fp8_mm_tma_kernel", Counting())
    x, bias = randn(70, 272, seed=1), randn(40, seed=3)
    w8, ws = weights("block", 40, 272)
    a8, a_s = fp8.quantize_rows(x, 128)
    full = _fp8_mm_triton(a8, a_s, w8, ws, bias, torch.float32, INTERPRETER_CONFIGS[0])
    for cfg in TMA_CONFIGS:
        for m in [1, 3, 17, 70]:
            assert same_bits(_fp8_mm_triton(a8[:m], a_s[:m], w8, ws, bias, torch.float32, cfg), full[:m]), (cfg, m)
    assert len(launches) == 4 * len(TMA_CONFIGS)
    # Rows of 260 bytes (not a multiple of 16): no descriptor, the pointer kernel
    a260, w260 = a8[:, :260].contiguous(), w8[:, :260].contiguous()
    want = _fp8_mm_triton(a260, a_s, w260, ws, None, torch.float32, INTERPRETER_CONFIGS[0])
    assert same_bits(_fp8_mm_triton(a260, a_s, w260, ws, None, torch.float32, TMA_CONFIGS[0]), want)
    assert len(launches) == 4 * len(TMA_CONFIGS)


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


# The fused kernel: the activations quantized per (row, 128 columns) in the matmul's A load must give the bits of
# the quantization kernel followed by the matmul (under the interpreter; bench/fp8_check.py compares them on the
# GPU for every tile it times).
@triton.jit
def _e4m3_values_kernel(q_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    q = tl.load(q_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, fp8._e4m3_values(q), mask=offs < n)


def test_interpreter_e4m3_rounding_is_torchs():
    # Every e4m3 value, the midpoints between neighbours (ties to even), one fp32 step either side of them, and
    # random values over the whole range: the interpreter's rounding (fp8._e4m3_values) must be torch's cast.
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e9))])
    rand = randn(4000, seed=9) * torch.logspace(-4, 2.6, 4000)
    q = torch.cat([grid, mid, near, -grid, -mid, -near, rand]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX)
    out = torch.empty_like(q)
    _e4m3_values_kernel[(triton.cdiv(q.numel(), 1024),)](q, out, q.numel(), BLOCK=1024)
    want = q.to(FP8).float()
    assert torch.equal(out, want), q[out != want][:8]
    # The grid is what it should be: the ties went to even, some up and some down.
    assert (want[len(grid) : 2 * len(grid) - 1] > mid).any() and (want[len(grid) : 2 * len(grid) - 1] < mid).any()


FUSED_SHAPES = [(1, 300, 45, torch.float32), (3, 260, 17, torch.bfloat16), (17, 390, 33, torch.float32),
                (130, 200, 7, torch.bfloat16)]  # fmt: skip
FUSED_CONFIGS = [Fp8Config(16, 32), Fp8Config(64, 64, 64), Fp8Config(32, 16, 32, group_m=2)]


def activations(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    # Rows of very different ranges, a zero row, and one row whose largest value sits in the tail block.
    x = randn(m, k, seed=seed) * torch.logspace(-3, 2, m)[:, None]
    x[m // 2] = 0.0
    x[-1, -1] = 300.0
    return x.to(dtype)


@pytest.mark.parametrize("m,k,n,dtype", FUSED_SHAPES)
def test_fused_quantization_gives_the_two_kernels_bits(m, k, n, dtype):
    x, bias = activations(m, k, dtype), randn(n, seed=3)
    w8, ws = weights("block", n, k)
    a8, a_s = _quantize_triton(x, 128)  # the CUDA path's quantization kernel, through the interpreter
    q, s = fp8.quantize_rows(x, 128)  # the CPU path's torch formulas: the same bytes and scales
    assert torch.equal(bits8(a8), bits8(q)) and torch.equal(a_s, s)
    for cfg in FUSED_CONFIGS:
        for b in (None, bias):
            want = _fp8_mm_triton(a8, a_s, w8, ws, b, torch.float32, cfg)
            assert same_bits(_fp8_linear_triton(x, w8, ws, b, torch.float32, cfg), want), (cfg, b is None)
    out = _fp8_linear_triton(x, w8, ws, bias, torch.float32, FUSED_CONFIGS[0])
    assert rel_err(out, reference(x, w8, ws, bias, 128)) < 1e-5
    # Per-channel weight scales take the same fused activations.
    c8, cs = weights("channel", n, k)
    assert same_bits(_fp8_linear_triton(x, c8, cs, None, torch.float32, FUSED_CONFIGS[1]),
                     _fp8_mm_triton(a8, a_s, c8, cs, None, torch.float32, FUSED_CONFIGS[1]))  # fmt: skip


def test_fused_rows_do_not_depend_on_m_the_tile_or_their_neighbours():
    x = activations(130, 390, torch.bfloat16)
    w8, ws = weights("block", 33, 390)
    full = _fp8_linear_triton(x, w8, ws, None, torch.float32, FUSED_CONFIGS[0])
    for cfg, ms in [(FUSED_CONFIGS[0], [1, 3, 17, 129]), (FUSED_CONFIGS[2], [1, 17])]:  # BK 32: other bits here
        ref = full if cfg is FUSED_CONFIGS[0] else _fp8_linear_triton(x, w8, ws, None, torch.float32, cfg)
        for m in ms:
            assert same_bits(_fp8_linear_triton(x[:m], w8, ws, None, torch.float32, cfg), ref[:m]), (cfg, m)
    assert same_bits(_fp8_linear_triton(x, w8, ws, None, torch.float32, Fp8Config(64, 16)), full)  # another tile
    batch = activations(40, 390, torch.bfloat16, seed=7)
    batch[23] = x[101]
    assert same_bits(_fp8_linear_triton(batch, w8, ws, None, torch.float32, FUSED_CONFIGS[0])[23], full[101])


def test_negative_control_a_scale_one_step_off_changes_the_bits():
    # The comparison above sees a difference where there is one: the quantization kernel's scales moved by one fp32
    # step (a division rounded otherwise, say), or one scale per token instead of per 128 columns, change the bits.
    m, k, n = 17, 390, 33
    x = activations(m, k, torch.float32)
    w8, ws = weights("block", n, k)
    fused = _fp8_linear_triton(x, w8, ws, None, torch.float32, FUSED_CONFIGS[0])
    a8, a_s = _quantize_triton(x, 128)
    nudged = a_s.nextafter(torch.tensor(1.0))
    q = (x.float() / nudged.repeat_interleave(128, 1)[:, :k]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(FP8)
    assert not same_bits(_fp8_mm_triton(q, nudged, w8, ws, None, torch.float32, FUSED_CONFIGS[0]), fused)
    t8, ts = _quantize_triton(x, None)  # one scale per token: other rounding points
    assert not same_bits(_fp8_mm_triton(t8, ts, w8, ws, None, torch.float32, FUSED_CONFIGS[0]), fused)


def test_the_fast_sets_fp8_linear_follows_the_batch():
    """The fast kernel set's FP8 layer (vLLM's online FP8: one activation scale for the batch) gives a row other bits
    next to a larger neighbour, where fp8_linear does not; its values stay close; block scales take fp8_linear."""
    from lockstep.layers import kernels, torch_kernels

    assert kernels.get_kernels("default").fp8_linear is torch_kernels.fast_fp8_linear
    assert kernels.get_kernels("invariant").fp8_linear is fp8.fp8_linear
    x = randn(5, 300, seed=2)
    batch = torch.cat([x, 8 * randn(1, 300, seed=3)])
    w8, ws = weights("channel", 33, 300)
    fast = torch_kernels.fast_fp8_linear
    assert not same_bits(fast(batch, w8, ws, None, None)[:5], fast(x, w8, ws, None, None))
    assert same_bits(fp8.fp8_linear(batch, w8, ws, None, None)[:5], fp8.fp8_linear(x, w8, ws, None, None))
    assert rel_err(fast(x, w8, ws, None, None), fp8.fp8_linear(x, w8, ws, None, None)) < 0.1
    w8, ws = weights("block", 33, 300)
    assert same_bits(fast(x, w8, ws, None, 128), fp8.fp8_linear(x, w8, ws, None, 128))
