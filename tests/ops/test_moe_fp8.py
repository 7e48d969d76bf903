"""The FP8 experts: values against an fp64 evaluation of the dequantized experts, the CPU path against the grouped
Triton kernel (interpreter), and a token's bits alone vs in other batches on both paths."""

import pytest
import torch
from invariance import randn, same_bits

from lockstep.ops import fp8, moe
from lockstep.ops.moe import MoEConfig
from lockstep.ops.moe_fp8 import _experts_fp8_cpu, _experts_fp8_triton, experts_fp8

E, H, INTER, K = 6, 160, 136, 2  # H and the intermediate INTER: a full 128-column block and a ragged one


def fp8_experts(kind: str, seed: int = 0):
    w13 = randn(E, 2 * INTER, H, seed=seed, scale=H**-0.5)
    w2 = randn(E, H, INTER, seed=seed + 1, scale=INTER**-0.5)

    def q(w):
        if kind == "block":
            parts = [fp8.quantize_weight(m, (128, 128)) for m in w]
            scales = [fp8.expand_block_scale(p[1], w.shape[1], 128) for p in parts]
            return torch.stack([p[0] for p in parts]), torch.stack(scales)
        parts = [fp8.quantize_weight(m) for m in w]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])

    return (*q(w13), *q(w2))


def batch(n: int, seed: int):
    x = randn(n, H, seed=seed)
    weights, ids = moe.route(randn(n, E, seed=seed + 1000), K, True)
    return x, weights, ids


@pytest.mark.parametrize("kind, group", [("block", 128), ("channel", None)])
def test_fp8_experts_track_the_dequantized_experts(kind, group):
    w13, s13, w2, s2 = fp8_experts(kind)
    x, weights, ids = batch(37, seed=1)
    out = experts_fp8(x, w13, s13, w2, s2, weights, ids, group)
    deq13 = torch.stack([fp8.dequantize(w, s, torch.float64) for w, s in zip(w13, s13, strict=True)])
    deq2 = torch.stack([fp8.dequantize(w, s, torch.float64) for w, s in zip(w2, s2, strict=True)])
    ref = moe.experts_reference(x.double(), deq13, deq2, weights.double(), ids)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.06, err  # the two activations' e4m3 rounding only
    tri = _experts_fp8_triton(x, w13, s13, w2, s2, weights, ids, group, MoEConfig(16, 32, 64))
    assert ((tri.double() - out.double()).norm() / out.double().norm()).item() < 1e-3


@pytest.mark.parametrize("path", ["cpu", "triton"])
def test_fp8_experts_token_bits_do_not_depend_on_the_batch(path):
    w13, s13, w2, s2 = fp8_experts("block")
    x, weights, ids = batch(20, seed=2)

    def run(x, weights, ids, cfg=None):
        cfg = cfg or MoEConfig(16, 32, 64)
        if path == "cpu":
            return _experts_fp8_cpu(x, w13, s13, w2, s2, weights, ids, 128)
        return _experts_fp8_triton(x, w13, s13, w2, s2, weights, ids, 128, cfg)

    full = run(x, weights, ids)
    for m in [1, 5] if path == "triton" else [1, 3, 17]:
        assert same_bits(run(x[:m], weights[:m], ids[:m]), full[:m]), m
    other, ow, oi = batch(11, seed=3)
    other[9], ow[9], oi[9] = x[4], weights[4], ids[4]
    assert same_bits(run(other, ow, oi)[9], full[4])
    if path == "triton":  # another tile of the same BK
        assert same_bits(run(x, weights, ids, MoEConfig(32, 16, 64)), full)
