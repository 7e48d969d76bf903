"""The vision towers' Kernels fields (``layer_norm``, ``gelu``, ``vision_attention``) in every registered set:
present, and right against an fp64 reference on segments of several lengths."""

import math

import pytest
import torch

from lockstep.layers.kernels import get_kernels, kernel_set_names

SETS = kernel_set_names()


def attention_reference(q, k, v, cu_seqlens, scale):
    """fp64 bidirectional attention within each segment."""
    out = torch.empty(q.shape, dtype=torch.float64)
    cu = cu_seqlens.tolist()
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        scores = torch.einsum("qhd,khd->hqk", q[s:e].double(), k[s:e].double()) * scale
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[s:e].double())
    return out


@pytest.mark.parametrize("name", SETS)
def test_every_set_has_the_vision_ops(name):
    kernels = get_kernels(name)
    assert kernels.layer_norm is not None and kernels.gelu is not None and kernels.vision_attention is not None


@pytest.mark.parametrize("name", SETS)
def test_layer_norm_and_gelu_values(name):
    kernels = get_kernels(name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(17, 72, generator=gen) * 3 + 1
    w, b = torch.randn(72, generator=gen), torch.randn(72, generator=gen)
    xd = x.double()
    ref = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + 1e-6)
    ref = ref * w.double() + b.double()
    torch.testing.assert_close(kernels.layer_norm(x, w, b, 1e-6).double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernels.layer_norm(x, w, None, 1e-6).double(), ref - b.double(), atol=1e-5, rtol=1e-5)
    exact = 0.5 * xd * (1 + torch.erf(xd / math.sqrt(2)))
    tanh = 0.5 * xd * (1 + torch.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd**3)))
    torch.testing.assert_close(kernels.gelu(x, "none").double(), exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernels.gelu(x, "tanh").double(), tanh, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", SETS)
def test_vision_attention_values(name):
    kernels = get_kernels(name)
    gen = torch.Generator().manual_seed(1)
    lens = [5, 1, 17, 5, 40]  # two of one length: the default set batches them
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lens), 3, 72, generator=gen) for _ in range(3))
    out = kernels.vision_attention(q, k, v, cu, 72**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), attention_reference(q, k, v, cu, 72**-0.5), atol=1e-5, rtol=1e-5)
