"""SiLU-and-mul on the CPU: close to torch's formula, and a row's bits do not depend on the batch (torch's own
silu does depend on where an element sits: the negative control)."""

import pytest
import torch
import torch.nn.functional as F

from lockstep.layers.activation import silu_and_mul
from lockstep.layers.torch_kernels import torch_silu_and_mul


@pytest.mark.parametrize("width", [1, 17, 80, 1000, 1536, 40000])
def test_silu_and_mul_rows_do_not_depend_on_the_batch(width):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(67 if width < 5000 else 9, 2 * width, generator=gen) * 4
    full = silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    assert torch.allclose(full, F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 40), slice(-1, None)):
        assert torch.equal(silu_and_mul(x[rows]), full[rows])


def test_torch_silu_changes_bits_with_position():
    # Negative control: ATen's scalar tail and its SIMD body round silu differently, so one element's result
    # depends on where in the tensor it sits. silu_and_mul above exists because of this.
    x = torch.randn(1, 2 * 4099, generator=torch.Generator().manual_seed(0)) * 4
    whole = torch_silu_and_mul(x)[0]
    singles = torch.stack([torch_silu_and_mul(x[:, [i, 4099 + i]])[0, 0] for i in range(2000)])
    assert not torch.equal(whole[:2000], singles)
