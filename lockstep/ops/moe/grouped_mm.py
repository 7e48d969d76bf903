"""The grouped expert matmul (Triton): tiles of sorted rows of one expert each, K reduced from 0 upward in one fp32
accumulator, the tile chosen from shapes alone (``moe_config``); the gate/up pass fuses silu-and-mul."""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lockstep.ops._common import interpreting
from lockstep.ops.moe.plan import RoutingPlan, tile_table


@triton.jit
def _grouped_mm_kernel(
    a_ptr, a_rows_ptr, b_ptr, c_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    N, K, num_experts,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    GATHER_A: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    # One program: the rows [start, end) of one expert's sorted rows (at most BM) times BN output columns.
    # SILU_MUL: b holds [gate; up] stacked ([2N, K] per expert) and c gets silu(x gate) * (x up), [rows, N].
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < num_experts:  # programs past the last tile do nothing (the grid is sized from shapes)
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_end_ptr + tile)
        offs_m = start + tl.arange(0, BM)
        mask_m = offs_m < end
        if GATHER_A:
            a_rows = tl.load(a_rows_ptr + offs_m, mask=mask_m, other=0)
        else:
            a_rows = offs_m
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BK)
        a_tile = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_tile = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        # The one reduction: k = 0 upward, BK at a time, into one fp32 accumulator per output.
        for k in range(0, K, BK):
            if EVEN_K:
                a = tl.load(a_tile, mask=mask_m[:, None], other=0.0)
                b = tl.load(b_tile, mask=mask_n[None, :], other=0.0)
            else:  # the zero-padded K tail adds exact zeros
                a = tl.load(a_tile, mask=mask_m[:, None] & (offs_k[None, :] < K - k), other=0.0)
                b = tl.load(b_tile, mask=mask_n[None, :] & (offs_k[:, None] < K - k), other=0.0)
            if UPCAST:  # the interpreter's bf16/fp16 dot is wrong; run it in fp32 there
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if SILU_MUL:
                if EVEN_K:
                    b_up = tl.load(b_tile + N * stride_bn, mask=mask_n[None, :], other=0.0)
                else:
                    b_up = tl.load(b_tile + N * stride_bn, mask=mask_n[None, :] & (offs_k[:, None] < K - k), other=0.0)
                if UPCAST:
                    b_up = b_up.to(tl.float32)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
            a_tile += BK * stride_ak
            b_tile += BK * stride_bk
        dtype = c_ptr.dtype.element_ty
        if SILU_MUL:
            # The dense MLP's roundings: gate and up rounded to the model dtype, silu(gate) rounded, then the product.
            gate = acc.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            out = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
        else:
            out = acc.to(dtype)
        c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c, out, mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class MoEConfig:
    bm: int
    bn: int
    bk: int
    num_warps: int = 4
    num_stages: int = 3


# Enough programs for two per SM of a large GPU (an H200 has 132 SMs); a shape constant, not read from the device.
_MIN_PROGRAMS = 256


def moe_config(num_pairs: int, num_experts: int, n: int, k: int, dtype: torch.dtype) -> MoEConfig:
    """The tile for one grouped matmul (``n`` output columns, reduction ``k``), from shapes alone: the dtype and
    the *average* number of rows an expert gets (``num_pairs / num_experts``), never the per-expert counts.

    BK is fixed per dtype, so every config reduces K in the same steps; BM, BN, warps and stages follow the
    average load (bench/moe.py checks that every config here gives the same bits on the GPU).
    """
    if dtype == torch.float32:
        return MoEConfig(bm=16, bn=32, bk=32)
    avg = num_pairs // max(1, num_experts)
    if avg <= 16:
        # Decode: bandwidth-bound, every program streams its experts' weight columns. At most min(E, P) row tiles
        # hold rows, so a few tokens get few programs: split N finer when 64-column tiles would give fewer than
        # _MIN_PROGRAMS (Qwen3-30B-A3B's gate/up at one token: 8 experts x 12 = 96 programs for 132 SMs).
        row_tiles = min(num_experts, num_pairs)
        bn = 64 if row_tiles * triton.cdiv(n, 64) >= _MIN_PROGRAMS else 32
        return MoEConfig(bm=16, bn=bn, bk=64, num_warps=4, num_stages=4)
    if avg <= 64:
        return MoEConfig(bm=64, bn=64, bk=64, num_warps=4, num_stages=4)
    if avg <= 256:
        return MoEConfig(bm=64, bn=128, bk=64, num_warps=4, num_stages=3)
    return MoEConfig(bm=128, bn=128, bk=64, num_warps=8, num_stages=3)


def _grouped_mm(
    a: torch.Tensor,
    a_rows: torch.Tensor | None,
    b: torch.Tensor,
    plan: RoutingPlan,
    cfg: MoEConfig,
    silu_mul: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    # a: [*, K]; row r of the result reads a[a_rows[r]] (a[r] without a_rows); b: [E, N(x2 if silu_mul), K]
    # -> c: [P, N] in out_dtype (default a's; float32 keeps the accumulator unrounded), the rows in sorted order.
    num_experts, n_full, k = b.shape
    n = n_full // 2 if silu_mul else n_full
    num_pairs = plan.order.numel()
    c = torch.empty((num_pairs, n), device=a.device, dtype=out_dtype or a.dtype)
    if num_pairs == 0:
        return c
    tile_expert, tile_start, tile_end = tile_table(plan, num_experts, cfg.bm)
    grid = (tile_expert.numel(), triton.cdiv(n, cfg.bn))
    _grouped_mm_kernel[grid](
        a, a_rows if a_rows is not None else tile_start, b, c,
        tile_expert, tile_start, tile_end,
        n, k, num_experts,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        GATHER_A=a_rows is not None, SILU_MUL=silu_mul, EVEN_K=k % cfg.bk == 0,
        UPCAST=interpreting() and a.dtype != torch.float32,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c
