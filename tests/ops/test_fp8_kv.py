"""The FP8 KV cache: write_kv's rounding into e4m3, and paged attention over an e4m3 cache giving exactly the bits
of the same attention over a cache holding the dequantized values (CPU path; the Triton kernel under the
interpreter), so everything proved for full-precision caches carries over; plus chunked vs one-shot vs decode."""

import pytest
import torch
from test_attention import Paged, Seq, assert_bitwise

from lockstep.ops import paged_attention, write_kv
from lockstep.ops.attention import FP8_KV, cache_values
from lockstep.ops.attention.launch import _paged_attention_triton
from lockstep.ops.rotary import rotary, rotary_write_kv


def test_write_kv_rounds_to_nearest_and_saturates():
    k = torch.tensor([[[0.3, -1000.0, 447.0, 500.0]], [[1e-4, 2.0, -3.1, 0.0]]])
    v = -k
    k_cache = torch.zeros(2, 2, 1, 4, dtype=FP8_KV)
    v_cache = torch.zeros_like(k_cache)
    write_kv(k, v, k_cache, v_cache, torch.tensor([3, -1]))  # -1: skipped
    got = k_cache.view(-1, 1, 4)[3].float()
    assert got.tolist() == [[0.3125, -448.0, 448.0, 448.0]]
    assert torch.equal(v_cache.view(-1, 1, 4)[3].float(), -got)
    assert torch.equal(cache_values(k[:1], FP8_KV).float(), got[None])
    assert k_cache.view(torch.uint8).view(-1, 4)[[0, 1, 2]].eq(0).all()


def fp8_and_dequantized(hkv: int, d: int, seqs: dict, dtype=torch.float32) -> tuple[Paged, Paged]:
    """Two caches with the same block layout: one e4m3, one of ``dtype`` holding the e4m3 values."""
    p8, pf = Paged(hkv, d, FP8_KV), Paged(hkv, d, dtype)
    for name, (seq, length) in seqs.items():
        p8.write(name, seq, 0, length)
        pf.write(name, seq, 0, length)
    used = ~torch.isnan(p8.k.float())
    pf.k[used], pf.v[used] = p8.k.float()[used].to(dtype), p8.v.float()[used].to(dtype)
    return p8, pf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attention_over_fp8_reads_the_dequantized_values(dtype):
    a, b = Seq(150, 4, 2, 32, dtype, seed=1), Seq(40, 4, 2, 32, dtype, seed=2)
    p8, pf = fp8_and_dequantized(2, 32, {"a": (a, 150), "b": (b, 40)}, dtype)
    items = [("a", a, 100, 150), ("b", b, 39, 40)]
    for o8, of in zip(p8.attend(paged_attention, items), pf.attend(paged_attention, items), strict=True):
        assert_bitwise(o8, of)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_attention_over_fp8_reads_the_dequantized_values(dtype):
    # bf16: the probabilities rounded to bf16 for the P @ V dot as over a bf16 cache (the interpreter once ran them
    # in fp32 over an e4m3 cache: the values converted to the upcast query's dtype)
    a, b = Seq(150, 4, 2, 32, dtype, seed=1), Seq(70, 4, 2, 32, dtype, seed=2)
    p8, pf = fp8_and_dequantized(2, 32, {"a": (a, 150), "b": (b, 70)}, dtype)
    items = [("a", a, 140, 150), ("b", b, 0, 70)]
    for o8, of in zip(
        p8.attend(_paged_attention_triton, items), pf.attend(_paged_attention_triton, items), strict=True
    ):
        assert_bitwise(o8, of)


def test_fp8_cache_rows_do_not_depend_on_how_they_arrive():
    # One sequence prefilled at once, in chunks, and decoded token by token, over an e4m3 cache (the CPU path).
    seq = Seq(90, 4, 2, 32, torch.bfloat16, seed=3)
    whole = Paged(2, 32, FP8_KV, seed=1)
    whole.write("s", seq, 0, 90)
    [full] = whole.attend(paged_attention, [("s", seq, 0, 90)])
    steps = Paged(2, 32, FP8_KV, seed=2)
    pieces = []
    for start, end in [(0, 37), (37, 64), *[(p, p + 1) for p in range(64, 90)]]:
        steps.write("s", seq, start, end)
        pieces += steps.attend(paged_attention, [("s", seq, start, end)])
    assert_bitwise(torch.cat(pieces), full)


def test_rotary_write_kv_into_fp8_equals_rotary_then_write_kv():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(6, h, 32, generator=g).to(torch.bfloat16) for h in (4, 2, 2))
    angle = torch.randn(6, 1, 16, generator=g)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    slots = torch.tensor([5, 0, 9, -1, 3, 12])
    caches = [torch.zeros(4, 4, 2, 32, dtype=FP8_KV) for _ in range(4)]
    q1 = rotary_write_kv(q, k, v, cos, sin, caches[0], caches[1], slots)
    q2, k2 = rotary(q, k, cos, sin)
    write_kv(k2, v, caches[2], caches[3], slots)
    assert torch.equal(q1, q2)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


def test_attention_refuses_mismatched_caches():
    q = torch.zeros(1, 4, 32)
    k8 = torch.zeros(2, 4, 2, 32, dtype=FP8_KV)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        paged_attention(q, k8, torch.zeros(2, 4, 2, 32), torch.zeros(1, 1, dtype=torch.int32),
                        torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1.0)  # fmt: skip
