"""The routed experts with e4m3 weights: ``ops.moe.experts``' plan, tiles and combine, with ``ops.fp8``'s numerics in
both grouped matmuls.

The token rows are quantized once (per token, or per token and 128 columns: ``ops.fp8.quantize_rows``), gathered
into expert order with their scales; each expert's gate/up matmul sums the e4m3 products of every 128-column K
block in fp32 from zero and adds the block times its two scales, blocks in order, then silu-and-mul with the dense
MLP's roundings; the activations are quantized per row the same way and the down matmul follows the same block
order. Every step is row-local or a reduction fixed by K, so a token's output does not depend on its neighbours or
on how many of them share its experts. CUDA runs one grouped Triton kernel (twice); the CPU runs each expert's rows
through ``ops.fp8``'s CPU blocks. The weights: ``w13: [E, 2I, H]`` and ``w2: [E, H, I]`` e4m3 with row scales
``s13: [E, 2I, KB]``, ``s2: [E, H, KB']`` (KB 1 or the K blocks).
"""

from dataclasses import replace

import torch
import triton
import triton.language as tl

from lockstep.layers.activation import silu_and_mul
from lockstep.ops import fp8_tree
from lockstep.ops._common import interpreting
from lockstep.ops.fp8 import FP8, GROUP_K, _fp8_mm_cpu, quantize_rows
from lockstep.ops.moe import MoEConfig, combine, expert_weight, moe_config, plan_routing, tile_table
from lockstep.ops.moe.combining import _combine_cpu


@triton.jit
def _grouped_fp8_kernel(
    a_ptr, as_ptr, a_rows_ptr, b_ptr, bs_ptr, c_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    N, K, num_experts,
    stride_am, stride_asm, stride_asg, stride_be, stride_bn, stride_bse, stride_bsn, stride_bsg, stride_cm,
    GATHER_A: tl.constexpr, SILU_MUL: tl.constexpr, UPCAST: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_K: tl.constexpr,
):  # fmt: skip
    # One program: rows [start, end) of one expert's sorted rows (at most BM) times BN output columns; K contiguous.
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < num_experts:  # programs past the last tile do nothing (the grid is sized from shapes)
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_end_ptr + tile)
        offs_m = start + tl.arange(0, BM)
        m_ok = offs_m < end
        a_rows = tl.load(a_rows_ptr + offs_m, mask=m_ok, other=0) if GATHER_A else offs_m
        a_rows = a_rows.to(tl.int64)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BK)
        b_base = b_ptr + expert.to(tl.int64) * stride_be
        bs_base = bs_ptr + expert.to(tl.int64) * stride_bse
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for g in range(0, tl.cdiv(K, GROUP_K)):
            part = tl.zeros((BM, BN), dtype=tl.float32)
            part_up = tl.zeros((BM, BN), dtype=tl.float32)
            for kk in tl.static_range(0, GROUP_K, BK):
                k = g * GROUP_K + kk + offs_k
                k_ok = k < K
                a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0)  # fmt: skip
                b = tl.load(b_base + offs_n[None, :] * stride_bn + k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                            other=0.0)  # fmt: skip
                if UPCAST:  # the interpreter has no e4m3 dot: the same values in fp32 (exact)
                    a = a.to(tl.float32)
                    part = tl.dot(a, b.to(tl.float32), part, input_precision="ieee")
                else:
                    part = tl.dot(a, b, part)
                if SILU_MUL:
                    b_up = tl.load(b_base + (offs_n + N)[None, :] * stride_bn + k[:, None],
                                   mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # fmt: skip
                    if UPCAST:
                        part_up = tl.dot(a, b_up.to(tl.float32), part_up, input_precision="ieee")
                    else:
                        part_up = tl.dot(a, b_up, part_up)
            sa = tl.load(as_ptr + a_rows * stride_asm + g * stride_asg, mask=m_ok, other=0.0)
            sb = tl.load(bs_base + offs_n * stride_bsn + g * stride_bsg, mask=n_ok, other=0.0)
            acc += part * (sa[:, None] * sb[None, :])
            if SILU_MUL:
                sb_up = tl.load(bs_base + (offs_n + N) * stride_bsn + g * stride_bsg, mask=n_ok, other=0.0)
                acc_up += part_up * (sa[:, None] * sb_up[None, :])
        dtype = c_ptr.dtype.element_ty
        if SILU_MUL:  # the dense MLP's roundings, as ops.moe's kernel
            gate = acc.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            out = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
        else:
            out = acc.to(dtype)
        c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c, out, mask=m_ok[:, None] & n_ok[None, :])


def _grouped_fp8_mm(a8, a_scale, a_rows, w8, w_scale, plan, cfg, silu_mul: bool, out_dtype) -> torch.Tensor:
    # a8: [*, K] e4m3 with a_scale [*, KBa]; row r reads a8[a_rows[r]] (a8[r] without); w8: [E, N(x2), K] e4m3 with
    # w_scale [E, N(x2), KBw] -> [P, N] in out_dtype, sorted rows
    num_experts, n_full, k = w8.shape
    n = n_full // 2 if silu_mul else n_full
    c = torch.empty((plan.order.numel(), n), device=a8.device, dtype=out_dtype)
    if c.shape[0] == 0:
        return c
    if GROUP_K % cfg.bk or a8.stride(1) != 1 or w8.stride(2) != 1:
        raise ValueError(f"grouped FP8 matmul: BK={cfg.bk} must divide {GROUP_K}, K must be contiguous")
    tile_expert, tile_start, tile_end = tile_table(plan, num_experts, cfg.bm)
    _grouped_fp8_kernel[(tile_expert.numel(), triton.cdiv(n, cfg.bn))](
        a8, a_scale, a_rows if a_rows is not None else tile_start, w8, w_scale, c,
        tile_expert, tile_start, tile_end,
        n, k, num_experts,
        a8.stride(0), a_scale.stride(0), a_scale.stride(1) if a_scale.shape[1] > 1 else 0,
        w8.stride(0), w8.stride(1), w_scale.stride(0), w_scale.stride(1),
        w_scale.stride(2) if w_scale.shape[2] > 1 else 0, c.stride(0),
        GATHER_A=a_rows is not None, SILU_MUL=silu_mul, UPCAST=interpreting(),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_K=GROUP_K, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c


def _wgmma(cfg: MoEConfig) -> MoEConfig:
    return replace(cfg, bm=max(cfg.bm, 64), bk=64)


def _configs(num_pairs: int, num_experts: int, inter: int, hidden: int, dtype) -> tuple[MoEConfig, MoEConfig]:
    # At least 64 rows a tile, so every batch runs wgmma (ops.fp8.fp8_config says why); BK 64 divides GROUP_K.
    return (
        _wgmma(moe_config(num_pairs, num_experts, inter, hidden, dtype)),
        _wgmma(moe_config(num_pairs, num_experts, hidden, inter, dtype)),
    )


def gate_up(x8, xs, w13, s13, plan, cfg: MoEConfig | None, dtype, triton: bool | None = None) -> torch.Tensor:
    """Every routed pair's ``silu(x W_gate) * (x W_up)`` in sorted-row order: ``x8: [n, H]`` e4m3 with ``xs``, the
    quantized tokens; ``w13: [E, 2I', H]`` e4m3 with ``s13`` -> ``[P, I']`` in ``dtype``. ``cfg``: the Triton tile;
    ``triton``: the grouped kernel (default: on CUDA)."""
    if x8.is_cuda if triton is None else triton:
        return _grouped_fp8_mm(x8, xs, plan.tokens, w13, s13, plan, cfg, True, dtype)
    bounds = plan.bounds.tolist()
    act = torch.empty((plan.order.numel(), w13.shape[1] // 2), dtype=dtype)
    for e in range(w13.shape[0]):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            tokens = plan.tokens[start:end]
            act[start:end] = silu_and_mul(
                _fp8_mm_cpu(x8[tokens], xs[tokens], expert_weight(w13, e), s13[e], None, dtype)
            )
    return act


def quantize_act(
    act: torch.Tensor, act_group: int | None, amax_gather=None, columns: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The intermediate activations ``act: [P, I']`` quantized per row (``fp8.quantize_rows``). Under tensor
    parallelism (``amax_gather``: this rank's maxima -> every rank's, or the identity in one process) the scales
    are the whole row's, from ``ops.fp8_tree``'s torch formulas: per token one over all of I; per group, the
    maxima of every ``act_group``-column group of the whole row, which a rank holding columns ``columns = (start,
    I)`` may share with its neighbour (``fp8_tree.group_amax``)."""
    if amax_gather is None:
        return quantize_rows(act, act_group)
    if act_group is None:
        return fp8_tree.activation_scales(act, None, amax_gather(fp8_tree.row_amax(act)))
    start, full = columns or (0, act.shape[1])
    amax = amax_gather(fp8_tree.group_amax(act, act_group, start, full))  # [P, cdiv(I, group)]
    return fp8_tree.activation_scales(act, act_group, amax, start)


def _experts_fp8_triton(x, w13, s13, w2, s2, weights, ids, act_group, config=None, amax_gather=None):
    num_experts, two_i, hidden = w13.shape
    cfg1, cfg2 = (config, config) if config else _configs(ids.numel(), num_experts, two_i // 2, hidden, x.dtype)
    plan = plan_routing(ids, num_experts, cfg1.bm)
    x8, xs = quantize_rows(x, act_group)
    act = gate_up(x8, xs, w13, s13, plan, cfg1, x.dtype, True)  # [P, I], sorted rows
    h8, hs = quantize_act(act, act_group, amax_gather)
    y = _grouped_fp8_mm(h8, hs, None, w2, s2, plan, cfg2, False, x.dtype)  # [P, H]
    return combine(y, weights.float(), plan.rows.view(ids.shape))


def _experts_fp8_cpu(x, w13, s13, w2, s2, weights, ids, act_group, amax_gather=None):
    plan = plan_routing(ids, w13.shape[0])
    bounds = plan.bounds.tolist()
    x8, xs = quantize_rows(x, act_group)
    h8, hs = quantize_act(gate_up(x8, xs, w13, s13, plan, None, x.dtype), act_group, amax_gather)  # row-local
    y = x.new_empty((plan.order.numel(), x.shape[1]))
    for e in range(w13.shape[0]):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            y[start:end] = _fp8_mm_cpu(h8[start:end], hs[start:end], expert_weight(w2, e), s2[e], None, x.dtype)
    return _combine_cpu(y, weights.float(), plan.rows.view(ids.shape))


def experts_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act_group: int | None = GROUP_K,
    amax_gather=None,
) -> torch.Tensor:
    """``ops.moe.experts`` with e4m3 expert weights and their row scales; ``[n, H]`` in x's dtype. Under tensor
    parallelism (a rank's I' of every expert; the caller all-reduces) ``amax_gather`` gives per-token activation
    scales over all of I (``quantize_act``)."""
    if w13.dtype != FP8 or w2.dtype != FP8 or s13.shape[:2] != w13.shape[:2] or s2.shape[:2] != w2.shape[:2]:
        raise ValueError(f"experts_fp8: weights {w13.dtype} {tuple(w13.shape)}, {w2.dtype} {tuple(w2.shape)} with "
                         f"scales {tuple(s13.shape)}, {tuple(s2.shape)}")  # fmt: skip
    if x.is_cuda:
        return _experts_fp8_triton(x, w13, s13, w2, s2, weights, ids, act_group, amax_gather=amax_gather)
    return _experts_fp8_cpu(x, w13, s13, w2, s2, weights, ids, act_group, amax_gather)
