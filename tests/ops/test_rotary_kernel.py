"""The fused rotary kernel (through Triton's interpreter): torch's bits, close to fp64, and row-invariant."""

import pytest
import torch
from invariance import INVARIANCE_MS, MOVES, SIZES, check_moved_row, check_prefixes, randn, same_bits

from lockstep.ops.attention import write_kv
from lockstep.ops.rotary import _rotary_triton, rotary_torch, rotary_write_kv

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


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_rotary_into_the_cache_stores_what_rotary_then_write_kv_store(dtype):
    # The fused kernel's cache path (TO_CACHE) against the kernel's plain path and write_kv: the same q, the same
    # rotated k and the same v in the same slots; a slot of -1 (graph padding) writes nothing; other slots keep
    # what they held (NaN here).
    heads, kv_heads, head_dim, page = 4, 2, 32, 4
    n = 9
    fused = randn(n, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=3)
    q = fused[:, : heads * head_dim].view(n, heads, head_dim)
    k = fused[:, heads * head_dim : (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    v = fused[:, (heads + kv_heads) * head_dim :].view(n, kv_heads, head_dim)
    cos, sin = rope(n, head_dim, dtype)
    slots = torch.tensor([5, 0, 17, -1, 3, 12, 6, -1, 9], dtype=torch.int64)
    caches = [torch.full((6, page, kv_heads, head_dim), float("nan"), dtype=dtype) for _ in range(4)]
    want_q, want_k = _rotary_triton(q, k, cos, sin)
    write_kv(want_k, v, caches[0], caches[1], slots)
    got_q, none = _rotary_triton(q, k, cos, sin, (v, caches[2], caches[3], slots))
    assert none is None and same_bits(got_q, want_q)
    assert same_bits(caches[2], caches[0]) and same_bits(caches[3], caches[1])
    assert int(caches[2].isnan().sum()) == (6 * page - 7) * kv_heads * head_dim  # 7 tokens stored, 2 skipped
    # The public op takes the same path on CUDA and rotary_torch + write_kv elsewhere (here).
    cpu = [torch.full_like(caches[0], float("nan")) for _ in range(2)]
    out = rotary_write_kv(q, k, v, cos, sin, *cpu, slots)
    ref_q, ref_k = rotary_torch(q, k, cos, sin)
    ref = [torch.full_like(caches[0], float("nan")) for _ in range(2)]
    write_kv(ref_k, v, *ref, slots)
    assert same_bits(out, ref_q) and same_bits(cpu[0], ref[0]) and same_bits(cpu[1], ref[1])
