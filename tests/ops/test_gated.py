"""ops.gated.silu_and_mul (the CUDA path of layers.activation.silu_and_mul), run here through Triton's interpreter:
values against fp64, row invariance, bad shapes. Its bits equal torch's on the GPU (bench/activation.py); the
interpreter lacks CUDA's expf, so bits are not compared here."""

import pytest
import torch

from lockstep.ops.gated import BLOCK, silu_and_mul


def reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize("width", [1, 7, BLOCK - 1, BLOCK + 3, 2 * BLOCK + 17])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_matches_fp64(width, dtype, tol):
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(5, 2 * width, generator=g) * 6).to(dtype)
    out = silu_and_mul(x)
    assert out.shape == (5, width) and out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(x), rtol=tol, atol=tol)


def test_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 2 * 1500, generator=g)
    full = silu_and_mul(x)
    assert torch.equal(silu_and_mul(x[:1]), full[:1])
    assert torch.equal(silu_and_mul(x[[4, 0, 8]]), full[[4, 0, 8]])
    # The harness sees a difference when there is one: another row's input gives other bits.
    assert not torch.equal(silu_and_mul(x[[1]]), full[:1])


def test_strided_input_and_bad_shapes():
    x = torch.randn(4, 2 * 33)
    wide = torch.randn(4, 2 * 33 + 10)[:, : 2 * 33]  # rows with a longer stride than their width
    wide.copy_(x)
    assert torch.equal(silu_and_mul(wide), silu_and_mul(x))
    assert silu_and_mul(torch.empty(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="2 \\* I"):
        silu_and_mul(torch.randn(3, 5))
    with pytest.raises(ValueError, match="2 \\* I"):
        silu_and_mul(torch.randn(2, 3, 4))
