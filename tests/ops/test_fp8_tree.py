"""The FP8 chunk tree (``ops.fp8_tree``): one process's bits are those of 2, 4 and 8 simulated ranks finishing their
subtrees (each rank its K columns, per-token scales from the whole row's gathered maxima), a row's bits do not follow
M or its neighbours, the values track ``fp8_linear``; the Triton chunk partial on a column view has the bits of the
same columns copied out (interpreter). Negative control: the ranks' plain partial sums in an all-reduce's order
differ. Blocks the tree's chunks would cut are refused by name."""

import pytest
import torch
from invariance import MOVES, check_moved_row, check_prefixes, randn, same_bits

from lockstep.ops import fp8, fp8_tree, tp_linear
from lockstep.ops.fp8 import Fp8Config, _fp8_mm_triton

K, N = 1024, 40  # 8 chunks of 128 columns: one scale block each


def weights(kind: str) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    w = randn(N, K, seed=4) * torch.linspace(0.2, 3.0, N)[:, None]
    if kind == "block":
        w8, s = fp8.quantize_weight(w, (128, 128))
        return w8, fp8.expand_block_scale(s, N, 128), 128
    return (*fp8.quantize_weight(w), None)


def ranks(x, w8, ws, group, size: int) -> torch.Tensor:
    """What ``size`` ranks compute: each its columns' subtree, from the whole row's scales; the roots finished."""
    amax = fp8_tree.row_amax(x)  # the ranks' maxima, gathered: here the max of the whole row
    cols = K // size
    roots = []
    for r in range(size):
        xr = x[:, r * cols : (r + 1) * cols]
        a8, a_s = fp8_tree.activation_scales(xr, group, None if group else amax)
        blocks = slice(r * cols // 128, (r + 1) * cols // 128)
        wr, sr = w8[:, r * cols : (r + 1) * cols].contiguous(), ws[:, blocks] if ws.shape[1] > 1 else ws
        roots.append(fp8_tree.subtree(a8, a_s, wr, sr, 8 // size))
    return tp_linear.tree_finish(torch.stack(roots), None, x.dtype)


@pytest.mark.parametrize("kind", ["block", "channel"])
def test_the_tree_has_the_bits_of_every_tp_size(kind):
    x = randn(13, K, seed=1)
    w8, ws, group = weights(kind)
    full = fp8_tree.tree_linear(x, w8, ws, None, group)
    for size in (2, 4, 8):
        assert same_bits(ranks(x, w8, ws, group, size), full), size
    check_prefixes(lambda t: fp8_tree.tree_linear(t, w8, ws, None, group), x, [1, 2, 3, 7, 13])
    check_moved_row(lambda t: fp8_tree.tree_linear(t, w8, ws, None, group), x, MOVES)
    plain = fp8.fp8_linear(x, w8, ws, None, group)
    assert torch.allclose(full, plain, rtol=1e-5, atol=1e-5) and not same_bits(full, plain)


@pytest.mark.parametrize("kind", ["block", "channel"])
def test_negative_control_an_all_reduce_of_partials_differs(kind):
    x = randn(13, K, seed=1)
    w8, ws, group = weights(kind)
    a8, a_s = fp8_tree.activation_scales(x, group)
    half = K // 2
    parts = []
    for r in range(2):
        sa = a_s[:, r * 4 : (r + 1) * 4] if a_s.shape[1] > 1 else a_s
        sw = ws[:, r * 4 : (r + 1) * 4] if ws.shape[1] > 1 else ws
        parts.append(fp8.scaled_mm(a8[:, r * half : (r + 1) * half], sa, w8[:, r * half : (r + 1) * half].contiguous(),
                                   sw, None, torch.float32))  # fmt: skip
    assert not same_bits(parts[0] + parts[1], fp8.fp8_linear(x, w8, ws, None, group))


def test_the_triton_partial_of_a_column_view_is_the_copys():
    # On CUDA the tree hands the kernel strided column views of the weight (no copy); the strides must not matter.
    x = randn(9, 512, seed=2)
    w8, s = fp8.quantize_weight(randn(24, 512, seed=3), (128, 128))
    ws = fp8.expand_block_scale(s, 24, 128)
    a8, a_s = fp8.quantize_rows(x, 128)
    cfg = Fp8Config(16, 32)
    view = _fp8_mm_triton(a8[:, 256:], a_s[:, 2:], w8[:, 256:], ws[:, 2:], None, torch.float32, cfg)
    copy = _fp8_mm_triton(a8[:, 256:].contiguous(), a_s[:, 2:].contiguous(), w8[:, 256:].contiguous(),
                          ws[:, 2:].contiguous(), None, torch.float32, cfg)  # fmt: skip
    assert same_bits(view, copy)
    assert torch.allclose(view, fp8.scaled_mm(a8[:, 256:], a_s[:, 2:], w8[:, 256:].contiguous(), ws[:, 2:], None,
                                              torch.float32), rtol=1e-5, atol=1e-5)  # fmt: skip


def test_blocks_the_chunks_would_cut_are_refused():
    with pytest.raises(ValueError, match=r"down_proj: the FP8 chunk tree cuts K=512 into 8 chunks of 64 columns"):
        fp8_tree.check_tree("down_proj", 512, blocked=True)
    fp8_tree.check_tree("down_proj", 512, blocked=False)  # per-channel weights, per-token activations: no blocks
    with pytest.raises(ValueError, match="multiple of 8"):
        fp8_tree.check_tree("o_proj", 100, blocked=False)
