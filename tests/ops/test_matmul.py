import pytest
import torch
from invariance import INVARIANCE_MS, MOVES, SIZES, check_moved_row, check_prefixes, randn

from lockstep import ops
from lockstep.ops import matmul
from lockstep.ops._common import ROW_TILE, map_row_tiles
from lockstep.ops.matmul import MatmulConfig, _bmm_triton, _cpu_weight, _mm_cpu, matmul_config

# Relative error bounds against fp64 (METHOD.md: fp32 far under 1e-3; bf16 operands 1e-3..1e-2).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", SIZES)
def test_linear_matches_fp64(m, dtype):
    k, n = 131, 77
    x, w, b = randn(m, k, dtype=dtype, seed=1), randn(n, k, dtype=dtype, seed=2), randn(n, dtype=dtype, seed=3)
    ref = x.double() @ w.double().t() + b.double()
    out = ops.linear(x, w, b)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert rel_err(ops.linear(x, w), x.double() @ w.double().t()) < TOLERANCE[dtype]


def test_mm_addmm_bmm_and_3d_linear_match_fp64():
    a, b = randn(17, 33, seed=1), randn(33, 5, seed=2)
    assert rel_err(ops.mm(a, b), a.double() @ b.double()) < 1e-6
    full_bias = randn(17, 5, seed=3)
    ref = 0.5 * full_bias.double() + 2.0 * (a.double() @ b.double())
    assert rel_err(ops.addmm(full_bias, a, b, beta=0.5, alpha=2.0), ref) < 1e-6
    ba, bb = randn(3, 17, 33, seed=4), randn(3, 33, 5, seed=5)
    assert rel_err(ops.bmm(ba, bb), ba.double() @ bb.double()) < 1e-6
    x, w = randn(2, 7, 33, seed=6), randn(5, 33, seed=7)
    assert rel_err(ops.linear(x, w), x.double() @ w.double().t()) < 1e-6


def test_bad_shapes_and_dtypes_raise():
    with pytest.raises(ValueError, match="cannot be multiplied"):
        ops.mm(torch.ones(3, 4), torch.ones(5, 6))
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        ops.mm(torch.ones(3, 4), torch.ones(4, 6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        ops.mm(torch.ones(3), torch.ones(3, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_are_batch_invariant(dtype):
    k, n = 576, 300
    x, w, b = randn(1000, k, dtype=dtype, seed=1), randn(n, k, dtype=dtype, seed=2), randn(n, dtype=dtype, seed=3)
    full = ops.linear(x, w, b)
    for m in INVARIANCE_MS:
        assert torch.equal(ops.linear(x[:m], w, b), full[:m]), f"rows differ at m={m}"
    # One row at other positions, with other neighbours.
    row = x[5]
    for m, pos in [(1, 0), (2, 1), (16, 15), (17, 16), (40, 3), (129, 128)]:
        batch = randn(m, k, dtype=dtype, seed=100 + m)
        batch[pos] = row
        assert torch.equal(ops.linear(batch, w, b)[pos], full[5]), f"row moved to {pos} of {m} differs"


@pytest.mark.parametrize("k,n", [(131, 77), (576, 960), (1536, 576), (64, 17)])
def test_cpu_packed_weight_gives_the_plain_weights_bits(k, n):
    # linear keeps a packed copy of its weight (_cpu_weight); mm/addmm/bmm hand oneDNN the plain weight. Both
    # must give the same bits, so every entry point agrees with every other.
    x, w = randn(37, k, seed=1), randn(n, k, seed=2)
    packed = _mm_cpu(x, _cpu_weight(w), None, 1.0, 1.0)
    assert torch.equal(packed, _mm_cpu(x, w, None, 1.0, 1.0))
    assert torch.equal(ops.linear(x, w), ops.mm(x, w.t()))
    assert torch.equal(ops.linear(x, w), ops.mm(x, w.t().contiguous()))


def test_cpu_fallback_without_onednn_is_invariant(monkeypatch):
    # Builds without oneDNN multiply through aten.mm on the same fixed row tiles.
    monkeypatch.setattr(matmul, "_ONEDNN", False)
    x, w = randn(200, 131, seed=1), randn(77, 131, seed=2)
    assert rel_err(ops.linear(x, w), x.double() @ w.double().t()) < TOLERANCE[torch.float32]
    check_prefixes(lambda t: ops.linear(t, w), x, [1, 3, 17, 127, 200])
    check_moved_row(lambda t: ops.linear(t, w), x, MOVES)


def test_cpu_packed_weight_follows_in_place_updates():
    x = randn(5, 64, seed=1)
    w = torch.nn.Parameter(randn(33, 64, seed=2), requires_grad=False)
    before = ops.linear(x, w)
    new = randn(33, 64, seed=3)
    w.copy_(new)  # on the tensor itself
    assert torch.equal(ops.linear(x, w), ops.mm(x, new.t()))
    w.detach()[:10].copy_(randn(10, 64, seed=4))  # a view, as ModelRunner.load_weights writes
    assert torch.equal(ops.linear(x, w), ops.mm(x, w.detach().clone().t()))
    w.data = randn(33, 64, seed=2)  # new storage
    assert torch.equal(ops.linear(x, w), before)
    with torch.inference_mode():  # no version counter: never cached, still right
        wi = randn(33, 64, seed=2) + 0
        assert torch.equal(ops.linear(x, wi), before)
        assert not hasattr(wi, "_lockstep_packed")


def test_cpu_trainable_weight_follows_a_fused_optimizer_step():
    # torch.optim.AdamW(fused=True) (transformers' Trainer default) writes the parameter without bumping its version
    # counter: a weight that requires grad is never served from a packed copy.
    x = randn(5, 64, seed=1)
    w = torch.nn.Parameter(randn(33, 64, seed=2))
    ops.linear(x, w)
    w.grad = randn(33, 64, seed=3)
    version = w._version
    torch.optim.AdamW([w], lr=0.1, fused=True).step()
    assert w._version == version  # what makes a version-keyed cache go stale
    assert torch.equal(ops.linear(x, w), ops.mm(x, w.detach().clone().t()))


def test_cpu_linear_bits_do_not_depend_on_the_thread_count(monkeypatch):
    # One-tile calls on small weights run on one thread (_CPU_SERIAL_WEIGHT_BYTES), the rest on all of them.
    x, w = randn(9, 576, seed=1), randn(1536, 576, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.linear(x, w)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(ops.linear(x, w), one)
        assert torch.equal(ops.linear(x[:3], w), one[:3])
        monkeypatch.setattr(matmul, "_CPU_SERIAL_WEIGHT_BYTES", 0)
        assert torch.equal(ops.linear(x[:3], w), one[:3])
    finally:
        torch.set_num_threads(threads)


def test_bmm_entries_are_batch_invariant():
    a, b = randn(9, 33, 70, seed=1), randn(9, 70, 21, seed=2)
    full = ops.bmm(a, b)
    for m in [1, 2, 5]:
        assert torch.equal(ops.bmm(a[:m], b[:m]), full[:m])
        assert torch.equal(ops.bmm(a[:, :m], b), full[:, :m])


def test_negative_control_torch_cpu_mm_varies_with_m():
    # Proof that the invariance harness can see a difference: MKL picks another kernel at M=1 than at M>=16
    # (docs/design.md, "Matmul": 3 distinct row-0 results over M=1..129).
    x, w = randn(64, 576, seed=1), randn(1536, 576, seed=2)
    full = x @ w.t()
    assert any(not torch.equal((x[:m] @ w.t())[0], full[0]) for m in [1, 2, 3, 7, 17])


# The Triton kernel, run by the interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1).

# One BK: the interpreter's dot sums a whole BK slice at once (numpy), so BK changes its bits; on the H200 the
# MMA accumulates in fixed k-steps and BK did not (docs/design.md, "Matmul"); bench/ops.py re-checks every M.
TRITON_CONFIGS = [
    MatmulConfig(16, 32, 32),
    MatmulConfig(32, 64, 32, group_m=2),
    MatmulConfig(64, 16, 32),
    MatmulConfig(16, 16, 32, flat=True),
]


@pytest.mark.parametrize("m", [1, 3, 17, 70])
def test_triton_matches_fp64(m):
    k, n = 45, 37  # odd K exercises the masked tail
    a, b, bias = randn(1, m, k, seed=1), randn(1, k, n, seed=2), randn(n, seed=3)
    out = _bmm_triton(a, b, bias, alpha=0.5, beta=2.0, config=MatmulConfig(16, 32, 16))
    ref = 0.5 * (a.double() @ b.double()) + 2.0 * bias.double()
    assert rel_err(out, ref) < 1e-6


def test_triton_bf16_upcast_matches_fp64():
    a, b = randn(2, 20, 64, dtype=torch.bfloat16, seed=1), randn(2, 64, 48, dtype=torch.bfloat16, seed=2)
    out = _bmm_triton(a, b, config=MatmulConfig(16, 16, 32))
    assert out.dtype == torch.bfloat16
    assert rel_err(out, a.double() @ b.double()) < 1e-2


def test_triton_rows_are_invariant_across_m_and_tile_configs():
    # Rows depend neither on M nor on the tile's BM/BN (the config table varies the tile with M).
    k, n = 96, 40
    a, b = randn(1, 80, k, seed=1), randn(1, k, n, seed=2)
    full = _bmm_triton(a, b, config=TRITON_CONFIGS[0])
    for cfg in TRITON_CONFIGS:
        for m in [1, 2, 3, 17, 33, 80]:
            assert torch.equal(_bmm_triton(a[:, :m], b, config=cfg), full[:, :m]), (cfg, m)
    row = a[0, 7]
    batch = randn(1, 19, k, seed=5)
    batch[0, 11] = row
    assert torch.equal(_bmm_triton(batch, b, config=TRITON_CONFIGS[1])[0, 11], full[0, 7])


@pytest.mark.parametrize("m", [1, 5, 33])
def test_triton_flat_loop_gives_the_tile_loops_bits(m):
    # One loop over a program's (tile, k step) pairs: programs here own several tiles (4 programs on the CPU), K
    # has a tail, and bias, alpha and a batch of 3 go through the shared epilogue.
    k, n = 75, 70
    a, b, bias = randn(3, m, k, seed=1), randn(3, k, n, seed=2), randn(n, seed=3)
    for bm, bn in ((16, 16), (32, 32)):
        tiles = MatmulConfig(bm, bn, 32)
        flat = MatmulConfig(bm, bn, 32, flat=True)
        expected = _bmm_triton(a, b, bias, alpha=0.5, beta=2.0, config=tiles)
        assert torch.equal(_bmm_triton(a, b, bias, alpha=0.5, beta=2.0, config=flat), expected), (bm, bn)
    assert rel_err(expected, 0.5 * (a.double() @ b.double()) + 2.0 * bias.double()) < 1e-6


def test_triton_handles_transposed_weight_strides():
    w = randn(40, 96, seed=3)  # [N, K], used as w.t() like F.linear
    a = randn(1, 9, 96, seed=4)
    out = _bmm_triton(a, w.t()[None], config=TRITON_CONFIGS[0])
    assert rel_err(out, a.double() @ w.double().t()) < 1e-6


@pytest.mark.parametrize("transposed", [True, False])
def test_triton_tma_path_matches_fp64_and_is_invariant(transposed):
    # Tensor descriptors zero-fill out-of-bounds rows, columns and the K tail (M, N, K not tile multiples).
    a, w, bias = randn(1, 40, 72, seed=1), randn(36, 72, seed=2), randn(36, seed=3)
    b = w.t()[None] if transposed else w.t().contiguous()[None]
    cfg = MatmulConfig(16, 16, 32, tma=True)
    out = _bmm_triton(a, b, bias, alpha=0.5, config=cfg)
    assert rel_err(out, 0.5 * (a.double() @ w.double().t()) + bias.double()) < 1e-6
    for m in [1, 3, 17]:
        assert torch.equal(_bmm_triton(a[:, :m], b, bias, alpha=0.5, config=cfg), out[:, :m])
    if not transposed:  # the interpreter's dot on a transposed tile takes another numpy path; the H200 does not
        assert torch.equal(out, _bmm_triton(a, b, bias, alpha=0.5, config=MatmulConfig(16, 16, 32)))


def test_triton_tma_kept_weight_descriptor_gives_the_same_bits_and_follows_the_storage():
    # linear passes its [N, K] weight along, and the weight's descriptor is built once and kept on the tensor: the
    # bits equal a fresh descriptor's; a new storage (weight.data swapped) gets a new descriptor, in-place writes
    # keep it (the descriptor encodes the address, not the values).
    a, w, bias = randn(1, 40, 72, seed=1), randn(36, 72, seed=2), randn(36, seed=3)
    cfg = MatmulConfig(16, 16, 32, tma=True)
    fresh = _bmm_triton(a, w.t()[None], bias, config=cfg)
    assert torch.equal(_bmm_triton(a, w.t()[None], bias, config=cfg, weight=w), fresh)
    kept = w._lockstep_tma[1]
    assert torch.equal(_bmm_triton(a[:, :17], w.t()[None], bias, config=cfg, weight=w), fresh[:, :17])
    assert w._lockstep_tma[1] is kept
    w.mul_(2.0)  # in place: the same descriptor, the new values
    assert w._lockstep_tma[1] is kept
    assert torch.equal(
        _bmm_triton(a, w.t()[None], bias, config=cfg, weight=w), _bmm_triton(a, w.t()[None], bias, config=cfg)
    )
    w.data = randn(36, 72, seed=4)
    out = _bmm_triton(a, w.t()[None], bias, config=cfg, weight=w)
    assert w._lockstep_tma[1] is not kept
    assert torch.equal(out, _bmm_triton(a, w.t()[None], bias, config=cfg))
    assert not torch.equal(out, fresh)  # negative control: the harness sees another weight


def test_config_table_depends_only_on_m_bucket_n_k_dtype():
    for m in [1, 7, 16]:
        assert matmul_config(m, 4096, 4096, torch.bfloat16) == matmul_config(1, 4096, 4096, torch.bfloat16)


def test_cpu_tall_tiles_give_the_4_row_tiles_bits(monkeypatch):
    # Calls of many rows go in taller tiles where a probe found them equal to 4-row tiles (matmul._tall_tile_ok):
    # the bits must be the 4-row tiles' at every height, and a row's wherever it sits.
    monkeypatch.setattr(matmul, "_tall_ok", {})
    heights = []
    real = matmul._onednn_mm
    monkeypatch.setattr(matmul, "_onednn_mm", lambda rows, w: heights.append(rows.shape[0]) or real(rows, w))
    x, w = randn(300, 576, seed=1), randn(960, 576, seed=2)
    packed = _cpu_weight(w)
    four = map_row_tiles(lambda rows: real(rows, packed), x)
    assert torch.equal(ops.linear(x, w), four)  # probes 256, 32 and 8 rows
    heights.clear()
    assert torch.equal(ops.linear(x, w), four)
    if all(ok for key, ok in matmul._tall_ok.items()):  # as on the 2-core machines: 300 rows in 4 calls
        assert heights == [256, 32, 8, 4]
    for m in [8, 9, 37, 255, 256, 257]:
        assert torch.equal(ops.linear(x[:m], w), four[:m]), f"rows differ at m={m}"
    check_moved_row(lambda t: ops.linear(t, w), x, MOVES + [(300, 299), (64, 33)])


def test_cpu_tall_tile_probe_rejects_a_height_with_other_bits(monkeypatch):
    # Negative control: a library whose taller calls sum in another order (here fp64 for calls of more than 4 rows).
    # Taken without the probe it changes the bits (the harness sees it); with the probe those heights are refused
    # and the rows keep the 4-row tiles' bits.
    real = matmul._onednn_mm

    def other_order(rows, w):
        if rows.shape[0] <= ROW_TILE:
            return real(rows, w)
        dense = w.to_dense() if w.is_mkldnn else w
        return (rows.double() @ dense.double().t()).float()

    x, w = randn(100, 131, seed=1), randn(77, 131, seed=2)
    four = map_row_tiles(lambda rows: real(rows, _cpu_weight(w)), x)
    monkeypatch.setattr(matmul, "_onednn_mm", other_order)
    monkeypatch.setattr(matmul, "_tall_ok", {})
    assert torch.equal(ops.linear(x, w), four)
    assert matmul._tall_ok and not any(matmul._tall_ok.values())
    monkeypatch.setattr(matmul, "_tall_tile_ok", lambda tile_mm, w, tile: True)
    assert not torch.equal(ops.linear(x, w), four)
