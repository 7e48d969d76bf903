"""The autograd Functions over the batch-invariant ops (linear, tree_linear, rms_norm, log_softmax): each fp32 gradient,
projected on a random direction, equals the central finite difference of a float64 reference of the same
function along that direction."""

import pytest
import torch
import torch.nn.functional as F
from gradients import check_directional, randn

from lockstep import ops
from lockstep.ops import autograd, tp_linear


@pytest.mark.parametrize("bias", [False, True])
def test_linear_grad(bias):
    x, w, b = randn(17, 33), randn(19, 33, seed=2) * 0.2, randn(19, seed=3)
    if bias:
        check_directional(autograd.linear, F.linear, [x, w, b])
    else:
        check_directional(lambda x, w: autograd.linear(x, w), lambda x, w: F.linear(x, w), [x, w])


@pytest.mark.parametrize("bias", [False, True])
def test_tree_linear_grad_and_forward_bits(bias):
    # K = 33: the tree pads it to 40 (8 chunks of 5). The forward is the op's own bits.
    x, w, b = randn(17, 33), randn(19, 33, seed=2) * 0.2, randn(19, seed=3)
    b_or_none = b if bias else None
    assert torch.equal(autograd.tree_linear(x, w, b_or_none), tp_linear.tree_linear(x, w, b_or_none))
    if bias:
        check_directional(autograd.tree_linear, F.linear, [x, w, b])
    else:
        check_directional(lambda x, w: autograd.tree_linear(x, w), lambda x, w: F.linear(x, w), [x, w])


def _rms_ref(x, w, eps=1e-6):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_rms_norm_grad():
    x, w, r = randn(17, 40), 1 + 0.1 * randn(40, seed=2), randn(17, 40, seed=3)
    check_directional(lambda x, w: autograd.rms_norm(x, w, 1e-6), _rms_ref, [x, w])

    def fused(x, w, r):  # both outputs: the normed sum and the residual stream
        out, h = autograd.rms_norm(x, w, 1e-6, r)
        return torch.cat((out, 0.5 * h), dim=-1)

    def fused_ref(x, w, r):
        return torch.cat((_rms_ref(x + r, w), 0.5 * (x + r)), dim=-1)

    check_directional(fused, fused_ref, [x, w, r])


def test_log_softmax_grad():
    check_directional(autograd.log_softmax, lambda x: torch.log_softmax(x, -1), [3 * randn(7, 1000)])


def test_negative_control_a_wrong_gradient_is_caught():
    # A gradient 1% off (the fp32 function scaled against its fp64 reference) fails the check.
    with pytest.raises(AssertionError):
        check_directional(lambda x: 1.01 * autograd.log_softmax(x), lambda x: torch.log_softmax(x, -1), [randn(7, 50)])


def _route64(ids, renormalize):
    def fn(logits):
        chosen = torch.softmax(logits, -1).gather(1, ids)
        return chosen / chosen.sum(-1, keepdim=True) if renormalize else chosen

    return fn


@pytest.mark.parametrize("renormalize", [False, True])
def test_moe_route_grad(renormalize):
    logits = randn(13, 8) * 2
    _, ids = autograd.moe_route(logits, 3, renormalize)  # distinct probabilities: the choice is stable nearby
    check_directional(lambda x: autograd.moe_route(x, 3, renormalize)[0], _route64(ids, renormalize), [logits])


def test_moe_experts_grad():
    from lockstep.ops import moe

    x, w13, w2 = randn(11, 16), randn(4, 2 * 12, 16, seed=2) * 0.3, randn(4, 16, 12, seed=3) * 0.3
    weights, ids = moe.route(randn(11, 4, seed=4), 2, True)
    check_directional(
        lambda x, a, b, w: autograd.moe_experts(x, a, b, w, ids),
        lambda x, a, b, w: moe.experts_reference(x, a, b, w, ids),
        [x, w13, w2, weights],
    )


def _layer_norm_ref(x, w, b, eps=1e-6):
    return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps) * w + b


def test_layer_norm_grad_and_forward_bits():
    x, w, b = 2 * randn(17, 72) + 1, 1 + 0.1 * randn(72, seed=2), randn(72, seed=3)
    assert torch.equal(autograd.layer_norm(x, w, b, 1e-6), ops.layer_norm(x, w, b, 1e-6))
    check_directional(lambda x, w, b: autograd.layer_norm(x, w, b, 1e-6), _layer_norm_ref, [x, w, b])
    check_directional(lambda x: autograd.layer_norm(x, None, None, 1e-6), lambda x: _layer_norm_ref(x, 1, 0), [x])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_grad_and_forward_bits(approximate):
    x = 3 * randn(7, 50)
    assert torch.equal(autograd.gelu(x, approximate), ops.gelu(x, approximate))
    check_directional(lambda x: autograd.gelu(x, approximate), lambda x: F.gelu(x, approximate=approximate), [x])


def test_vision_attention_grad_and_forward_bits():
    q, k, v = randn(30, 2, 16), randn(30, 2, 16, seed=2), randn(30, 2, 16, seed=3)
    cu = torch.tensor([0, 7, 7, 30], dtype=torch.int32)
    assert torch.equal(autograd.vision_attention(q, k, v, cu, 0.3), ops.vision_attention(q, k, v, cu, 0.3))

    def ref(q, k, v):
        parts = []
        for a, b in ((0, 7), (7, 30)):
            s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * 0.3
            parts.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v[a:b]))
        return torch.cat(parts)

    check_directional(lambda q, k, v: autograd.vision_attention(q, k, v, cu, 0.3), ref, [q, k, v])


def test_rms_norm_backward_kernel_matches_the_formula():
    """ops.rms_norm_backward's Triton kernel (the CUDA path; the interpreter here) against the CPU's formula
    (``autograd.rms_norm``'s backward, checked against finite differences above): with and without a weight and a
    gradient into the returned sum, rows not a multiple of a program's, an odd width; the same bits run to run."""
    from lockstep.ops.rms_norm_backward import rms_norm_backward

    gen = torch.Generator().manual_seed(3)
    for dtype, rows, n, with_weight, with_gh in ((torch.float32, 37, 127, True, True),
                                                 (torch.float32, 5, 64, False, False),
                                                 (torch.bfloat16, 21, 200, True, False)):  # fmt: skip
        x = torch.randn(rows, n, generator=gen).to(dtype)
        res = torch.randn(rows, n, generator=gen).to(dtype)
        w = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype).requires_grad_() if with_weight else None
        grad = torch.randn(rows, n, generator=gen).to(dtype)
        gh = torch.randn(rows, n, generator=gen).to(dtype) if with_gh else None
        xr = x.clone().requires_grad_()
        out, h = autograd.rms_norm(xr, w, 1e-6, res)
        torch.autograd.backward([out, h] if with_gh else [out], [grad, gh] if with_gh else [grad])
        dh, dw = rms_norm_backward(h.detach(), None if w is None else w.detach(), 1e-6, grad, gh)
        tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        assert dh.dtype == dtype and dh.abs().max() > 0.1
        torch.testing.assert_close(dh, xr.grad, **tol)
        if with_weight:
            torch.testing.assert_close(dw, w.grad, **tol)
        again = rms_norm_backward(h.detach(), None if w is None else w.detach(), 1e-6, grad, gh)
        assert torch.equal(dh, again[0]) and (dw is None or torch.equal(dw, again[1]))
