"""ops.vision_attention: values against an fp64 reference on segments of odd lengths, and bitwise invariance of a
segment's rows to the batch (alone, with 1..N other segments of other sizes before and after it, moved to another
position) on the CPU path and on the Triton kernel under the interpreter (fp32, small). Negative control: an
online softmax whose KV tiles start at the batch's first row, not the segment's, gives a moved segment other
bits, and the harness sees it."""

import importlib

import pytest
import torch
from invariance import same_bits

from lockstep.ops import vision_attention
from lockstep.ops.vision_attention import TILE, _vision_attention_cpu, _vision_attention_triton

va = importlib.import_module("lockstep.ops.vision_attention")  # the attribute lockstep.ops.vision_attention is the op


def segment(length, heads, head_dim, dtype, seed):
    """One segment's q, k, v, fixed by its seed."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(length, heads, head_dim, generator=g).to(dtype) for _ in range(3))


def batch(segments):
    """Concatenate segments' (q, k, v) -> q, k, v, cu_seqlens."""
    q, k, v = (torch.cat([s[i] for s in segments]) for i in range(3))
    cu = torch.tensor([0] + [s[0].shape[0] for s in segments]).cumsum(0).to(torch.int32)
    return q, k, v, cu


def reference(q, k, v, cu, scale):
    """fp64 bidirectional attention within each segment."""
    out = torch.empty(q.shape, dtype=torch.float64)
    c = cu.tolist()
    for s, e in zip(c[:-1], c[1:], strict=True):
        scores = torch.einsum("qhd,khd->hqk", q[s:e].double(), k[s:e].double()) * scale
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[s:e].double())
    return out


def check_segment_invariance(op, length, others, heads=2, head_dim=72, dtype=torch.float32):
    """The segment of ``length`` rows keeps its bits alone and at every position among ``others`` (lengths)."""
    seg = segment(length, heads, head_dim, dtype, seed=1)
    scale = head_dim**-0.5
    alone = op(*batch([seg]), scale)
    for i in range(len(others) + 1):  # the segment before all others, between them, after all
        rest = [segment(n, heads, head_dim, dtype, seed=10 + j) for j, n in enumerate(others)]
        segs = rest[:i] + [seg] + rest[i:]
        q, k, v, cu = batch(segs)
        start = int(cu[i])
        out = op(q, k, v, cu, scale)
        assert same_bits(out[start : start + length], alone), f"segment of {length} at slot {i} of {len(segs)} differs"


# Qwen3-VL-8B vision: 16 heads x 72; Qwen2.5-VL: 16 x 80 (its windows are 64 patches). Fewer heads keep tests fast.
CPU_CASES = [
    ([1], 72),
    ([3], 80),
    ([17], 72),
    ([127], 80),
    ([64, 65, 1, 200], 72),
    ([5, 1, 33, 5], 16),
    ([300, 64, 64, 64], 80),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens, head_dim", CPU_CASES)
def test_cpu_matches_fp64(lens, head_dim, dtype):
    segs = [segment(n, 3, head_dim, dtype, seed=i) for i, n in enumerate(lens)]
    q, k, v, cu = batch(segs)
    out = vision_attention(q, k, v, cu, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    atol = 2e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), reference(q, k, v, cu, head_dim**-0.5), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 17, 64, 65, 129, 300])
def test_cpu_segment_is_batch_invariant(length, dtype):
    check_segment_invariance(vision_attention, length, [5, 130, 64, 1], dtype=dtype)
    check_segment_invariance(vision_attention, length, [length], dtype=dtype)  # a twin of the same size


def test_cpu_invariant_across_call_chunks(monkeypatch):
    # A batch bigger than one call's budget: entries split over several calls, the segment in any of them.
    monkeypatch.setattr(va, "_CPU_CHUNK_BYTES", 2 * 2 * va._CPU_ROWS * va._CPU_TILE * 4)  # 2 entries a call, 2 heads
    check_segment_invariance(vision_attention, 70, [40, 3, 100, 130])


def test_cpu_invariant_to_the_thread_count():
    q, k, v, cu = batch([segment(n, 4, 72, torch.float32, seed=n) for n in (300, 17, 129)])
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = vision_attention(q, k, v, cu, 0.1)
        torch.set_num_threads(2)
        two = vision_attention(q, k, v, cu, 0.1)
    finally:
        torch.set_num_threads(previous)
    assert same_bits(one, two)


def test_empty_segments_and_checks():
    seg = segment(9, 2, 16, torch.float32, seed=1)
    q, k, v, _ = batch([seg])
    cu = torch.tensor([0, 0, 9, 9], dtype=torch.int32)  # empty segments own no rows
    assert same_bits(vision_attention(q, k, v, cu, 0.25), vision_attention(q, k, v, cu[1:3], 0.25))
    assert same_bits(_vision_attention_triton(q, k, v, cu, 0.25), _vision_attention_triton(q, k, v, cu[1:3], 0.25))
    with pytest.raises(ValueError, match="rise from 0"):
        vision_attention(q, k, v, torch.tensor([0, 5], dtype=torch.int32), 0.25)
    with pytest.raises(ValueError, match="alike"):
        vision_attention(q, k[:, :1], v, cu, 0.25)
    with pytest.raises(TypeError, match="matching float"):
        vision_attention(q, k.double(), v, cu, 0.25)


def batch_tiled_attention(q, k, v, cu, scale):
    """Online softmax in TILE-key tiles aligned to row 0 of the batch (other segments' keys masked): where a tile
    boundary falls inside a segment follows the segment's place in the batch. The negative control."""
    total = q.shape[0]
    seg = torch.repeat_interleave(torch.arange(cu.shape[0] - 1), (cu[1:] - cu[:-1]).long())
    qf, kf, vf = q.float() * scale, k.float(), v.float()
    m = torch.full((q.shape[1], total), float("-inf"))
    den = torch.zeros(q.shape[1], total)
    acc = torch.zeros(q.shape[1], total, q.shape[2])
    for lo in range(0, total, TILE):
        keys = slice(lo, min(lo + TILE, total))
        s = torch.einsum("qhd,khd->hqk", qf, kf[keys])
        s = s.masked_fill(seg[:, None] != seg[None, keys], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        base = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha = torch.where(m == m_new, 1.0, torch.exp(m - base))
        p = torch.exp(s - base[..., None])
        den = den * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("hqk,khd->hqd", p, vf[keys])
        m = m_new
    return (acc / den[..., None]).transpose(0, 1).to(q.dtype)


def test_negative_control_batch_aligned_tiles_follow_the_position():
    q, k, v, cu = batch([segment(100, 2, 72, torch.float32, seed=3)])
    want = reference(q, k, v, cu, 0.1)
    torch.testing.assert_close(batch_tiled_attention(q, k, v, cu, 0.1).double(), want, atol=2e-6, rtol=2e-6)
    with pytest.raises(AssertionError, match="differs"):
        check_segment_invariance(batch_tiled_attention, 100, [5, 130])


# The Triton kernel, run by the interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1), in fp32:
# the interpreter's bf16 dot is wrong (the kernel upcasts there).
TRITON_CASES = [([1], 72), ([3, 17], 80), ([64, 65, 1], 72), ([130], 16)]


@pytest.mark.parametrize("lens, head_dim", TRITON_CASES)
def test_triton_matches_fp64(lens, head_dim):
    segs = [segment(n, 2, head_dim, torch.float32, seed=i) for i, n in enumerate(lens)]
    q, k, v, cu = batch(segs)
    out = _vision_attention_triton(q, k, v, cu, head_dim**-0.5)
    torch.testing.assert_close(out.double(), reference(q, k, v, cu, head_dim**-0.5), atol=2e-6, rtol=2e-6)


def test_triton_bf16_rounds_p_like_flash_attention():
    q, k, v, cu = batch([segment(70, 2, 80, torch.bfloat16, seed=2), segment(9, 2, 80, torch.bfloat16, seed=3)])
    out = _vision_attention_triton(q, k, v, cu, 80**-0.5)
    torch.testing.assert_close(out.double(), reference(q, k, v, cu, 80**-0.5), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("length", [1, 65])
def test_triton_segment_is_batch_invariant(length):
    check_segment_invariance(_vision_attention_triton, length, [70, 3])


def test_triton_takes_strided_views_of_a_fused_qkv():
    # q, k, v as views of one [total, 3, heads, head_dim] projection, as a vision block makes them
    qkv = torch.randn(40, 3, 2, 72, generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    q, k, v = qkv.unbind(1)
    want = _vision_attention_triton(q.contiguous(), k.contiguous(), v.contiguous(), cu, 0.1)
    assert same_bits(_vision_attention_triton(q, k, v, cu, 0.1), want)
    assert same_bits(_vision_attention_cpu(q, k, v, cu, 0.1), _vision_attention_cpu(q.contiguous(), k, v, cu, 0.1))
