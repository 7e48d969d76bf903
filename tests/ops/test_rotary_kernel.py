"""The fused rotary kernel (through Triton's interpreter): torch's bits, close to fp64, and row-invariant."""

import pytest
import torch
from invariance import INVARIANCE_MS, MOVES, SIZES, check_moved_row, check_prefixes, randn, same_bits

from lockstep.ops.rotary import _rotary_triton, rotary_torch

HALF_DTYPES = [torch.bfloat16, torch.float16]
# Whether the kernel has torch's bits, by dtype: Triton's interpreter rounds fp16 as asked but truncates bf16 casts;
# on the H200 the compiler fuses products and sums into bf16 FMAs (ops/rotary.py), so there neither is claimed.
SAME_BITS_DTYPES = () if torch.cuda.is_available() else (torch.float16,)


def rope(n: int, head_dim: int, dtype: torch.dtype, seed: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin rows ``cat(c, c)`` for ``n`` arbitrary positions, ``[n, 1, head_dim]``."""
    angles = randn(n, head_dim // 2, seed=seed, scale=50.0)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    return torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]


def qkv(n: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    # q, k as views of one fused QKV row, as the model hands them over (a token stride wider than the heads).
    fused = randn(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=n)
    q = fused[:, : heads * head_dim].view(n, heads, head_dim)
    k = fused[:, heads * head_dim : (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    return q, k


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("n", [m for m in SIZES if m < 1000])  # the interpreter runs one program a token
@pytest.mark.parametrize("shape", [(4, 2, 16), (6, 2, 32), (3, 3, 64)])  # heads, kv heads, head_dim
def test_kernel_is_close_to_fp64_and_to_torchs_formula(n, shape, dtype):
    heads, kv_heads, head_dim = shape
    q, k = qkv(n, heads, kv_heads, head_dim, dtype)
    cos, sin = rope(n, head_dim, dtype)
    got_q, got_k = _rotary_triton(q, k, cos, sin)
    want_q, want_k = rotary_torch(q, k, cos, sin)
    if dtype in SAME_BITS_DTYPES:
        assert same_bits(got_q, want_q) and same_bits(got_k, want_k)
    half = head_dim // 2
    c, s = cos.double()[..., :half], sin.double()[..., :half]
    for x, got in ((q, got_q), (k, got_k)):
        x1, x2 = x.double()[..., :half], x.double()[..., half:]
        ref = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
        bound = 3 * torch.finfo(dtype).eps * (x1.abs() + x2.abs()).repeat(1, 1, 2) + 1e-6
        assert ((got.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_rows_do_not_depend_on_the_batch(dtype):
    heads, kv_heads, head_dim = 4, 2, 32
    ms = [m for m in INVARIANCE_MS if m <= 129]  # the interpreter runs one program a token
    n = max(ms)
    cos, sin = rope(n, head_dim, dtype)
    table = torch.cat([cos, sin], 1)  # [n, 2, head_dim]: each row carries its own rotation

    def op(x: torch.Tensor) -> torch.Tensor:
        # x: [m, heads + kv_heads + 2, head_dim] packs q, k and the row's cos/sin, so rows can be moved freely.
        q, k = x[:, :heads], x[:, heads : heads + kv_heads]
        c, s = x[:, -2:-1], x[:, -1:]
        return torch.cat(_rotary_triton(q, k, c, s), 1)

    q, k = qkv(n, heads, kv_heads, head_dim, dtype)
    x = torch.cat([q, k, table], 1)
    check_prefixes(op, x, ms)
    check_moved_row(op, x, MOVES)


def test_negative_control_one_rounding_differs():
    # The harness can see a difference: rounding x1*c - x2*s once (an FMA-like fp32 evaluation) instead of after
    # each product, as torch does, changes some bf16 results.
    q, k = qkv(257, 8, 2, 64, torch.bfloat16)
    cos, sin = rope(257, 64, torch.bfloat16)
    want_q, _ = rotary_torch(q, k, cos, sin)
    x1, x2 = q.float()[..., :32], q.float()[..., 32:]
    c, s = cos.float()[..., :32], sin.float()[..., :32]
    once = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(torch.bfloat16)
    assert not same_bits(once, want_q)
