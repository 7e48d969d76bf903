"""Batch-invariant FP8 (e4m3) linear layers: activation quantization and the scaled matmul (DeepGEMM's scheme).

A weight is stored as e4m3 values ``w8: [N, K]`` and fp32 scales ``w_scale: [N, KBw]``, one per output row and per
``GROUP_K``-column block of K (KBw = cdiv(K, GROUP_K): a checkpoint's 128 x 128 block scales, expanded to rows), or
one per row (KBw = 1: per-channel scales; a per-tensor scale is one repeated on every row). The activations are
quantized when they arrive, per token (``group=None``: one scale for the row) or per token and ``GROUP_K`` columns
(``group=GROUP_K``): ``scale = max(amax, tiny) / 448``, ``x8 = e4m3(clamp(x / scale, -448, 448))``, rounded to
nearest even. A row's scales and values depend on that row alone (a max is exact in any order).

The matmul: for each K block g = 0, 1, ... in order, ``part = sum_k x8[m, k] * w8[n, k]`` over the block (e4m3
MMA, fp32 accumulation), then ``acc += part * (x_scale[m, g] * w_scale[n, g])``, the block scales applied as the
block ends; finally bias, and one rounding to the output dtype. So one output element's terms are combined in an
order fixed by K alone: never by M, the tile shape or the batch (DESIGN.md's rule; bench/fp8_check.py re-checks the
bits on the GPU for every M bucket and tile of the table). Promoting to fp32 once a block also bounds the error of
Hopper's FP8 tensor cores, whose own accumulator keeps fewer bits than fp32.

CUDA runs a persistent-tile Triton kernel (tile from ``fp8_config``: a fixed table keyed by N and a bucket of M).
The kernel can also take the unquantized activations (``_fp8_linear_triton``, per-(token, GROUP_K) scales only):
each K block's A tile is quantized where it is loaded, with the quantization kernel's formulas and operations (the
same e4m3 values and scales, so the same output bits). It was slower on the H200 than the two kernels, so
``fp8_linear`` does not take it; ``bench/fp8_check.py --sweep`` times both.
The CPU (the interpreter has no FP8 MMA) runs the same blocks: each block's ``part`` is an fp32 oneDNN matmul of the
exactly converted e4m3 values on fixed row tiles (``_common.map_row_tiles``), then the same scale-and-add in the
same block order. CPU and GPU bits differ (the order inside a block's dot, and the GPU fuses the multiply-add);
each is batch-invariant.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lockstep.ops._common import ROW_TILE, interpreting, next_power_of_2, num_sms, pdl_launch, pdl_wait
from lockstep.ops.matmul import _aligned, _mm_cpu, _tile_coords, _weight_descriptor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
GROUP_K = 128  # K columns per scale block (weights and per-group activations), as DeepGEMM and Qwen3-FP8
# The smallest amax a scale is taken from: an all-zero row gets a finite scale and quantizes to zeros.
_AMAX_FLOOR = 1e-12
_QUANT_GROUP = 128  # the columns of one row of a per-token quantization program's tile


# --------------------------------------------------------------------------------------- quantization


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
    GROUP: tl.constexpr, GROUPS: tl.constexpr, PER_TOKEN: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # Program (row, j): the row's groups j * GROUPS ... of GROUP columns, loaded as one [GROUPS, GROUP] tile, their
    # scales and e4m3 values; PER_TOKEN: one program holds the whole row (GROUPS * GROUP >= K) and one scale. Every
    # step is elementwise or a max, so the tiling never shows in the bits. One load a program: a loop over the row's
    # groups, each waiting on its load, took 12.4 us for one 4096-column row on the H200 (session 15).
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)  # [GROUPS]
    if PER_TOKEN:
        scale = tl.maximum(tl.max(amax, 0), 1e-12) / 448.0
        tl.store(s_ptr + row * stride_sm, scale)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    else:
        scale = tl.maximum(amax, 1e-12) / 448.0
        tl.store(s_ptr + row * stride_sm + groups, scale, mask=groups * GROUP < K)
        q = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


def _quantize_torch(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [M, K] -> (x8 [M, K] e4m3, scale [M, KB] fp32), the kernel's formulas in torch ops
    m, k = x.shape
    xf = x.float()
    if group is None:
        scale = xf.abs().amax(1, keepdim=True).clamp(min=_AMAX_FLOOR) / FP8_MAX  # [M, 1]
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    blocks = -(-k // group)
    padded = torch.nn.functional.pad(xf, (0, blocks * group - k)).view(m, blocks, group)
    scale = padded.abs().amax(2).clamp(min=_AMAX_FLOOR) / FP8_MAX  # [M, KB]
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, blocks * group)[:, :k], scale


def quantize_rows(x: torch.Tensor, group: int | None = GROUP_K) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [M, K]`` (any float dtype) -> ``(x8: [M, K] e4m3, scale: [M, KB] fp32)`` with ``x ~= x8 * scale``.

    ``group=None``: one scale per row (KB = 1); else one per row and ``group`` columns (KB = cdiv(K, group)).
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes [M, K], got shape {tuple(x.shape)}")
    if group is not None and (group <= 0 or group & (group - 1)):
        raise ValueError(f"group must be a power of two or None, got {group}")
    return _quantize_triton(x, group) if x.is_cuda else _quantize_torch(x, group)


def _quantize_triton(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    # The interpreter's fp32 -> e4m3 cast rounds wrongly where the mantissa carries into the exponent (124.3 -> 64,
    # Triton 3.9): there the kernel stores the clamped fp32 values and torch casts them.
    q = torch.empty((m, k), device=x.device, dtype=torch.float32 if interpreting() else FP8)
    scale = torch.empty((m, 1 if group is None else triton.cdiv(k, group)), device=x.device, dtype=torch.float32)
    if m:
        if group is None:  # the whole row in one program
            width, groups = _QUANT_GROUP, next_power_of_2(triton.cdiv(k, _QUANT_GROUP))
        else:  # 1024 columns a program, or one group if it is wider
            width, groups = group, max(1, 1024 // group)
        _quantize_kernel[(m, triton.cdiv(k, groups * width))](
            x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0),
            GROUP=width, GROUPS=groups, PER_TOKEN=group is None,
            num_warps=4 if groups * width <= 2048 else 8 if groups * width <= 8192 else 16, **pdl_launch(x),
        )  # fmt: skip
    return q.to(FP8), scale


def quantize_weight(w: torch.Tensor, block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w: [N, K]`` -> ``(w8: [N, K] e4m3, scale)``: per output channel (``block=None``, scale ``[N, 1]``) or per
    ``block = (bn, bk)`` tile (scale ``[cdiv(N, bn), cdiv(K, bk)]``, a checkpoint's ``weight_scale_inv``). The
    scales come from the weights alone (amax / 448), so quantizing a checkpoint is a pure function of it."""
    if block is None:
        return _quantize_torch(w, None)
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    wf = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
    scale = wf.abs().amax((1, 3)).clamp(min=_AMAX_FLOOR) / FP8_MAX  # [NB, KB]
    q = (wf / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale


def expand_block_scale(scale: torch.Tensor, rows: int, block_n: int) -> torch.Tensor:
    """Block scales ``[cdiv(rows, block_n), KB]`` -> one row of scales per weight row, ``[rows, KB]`` fp32."""
    return scale.float().repeat_interleave(block_n, dim=0)[:rows]


def quantize_with_scales(w: torch.Tensor, scale: torch.Tensor, start: int = 0) -> torch.Tensor:
    """``w: [N, K]`` -> e4m3 ``[N, K]`` with the given row scales ``[N, KB]`` (KB 1 or the ``GROUP_K``-column
    blocks K touches), not scales of its own: ``e4m3(clamp(w / scale, -448, 448))``, saturating where ``w`` outgrew
    them. What a trainer's forward and ``LLM.load_weights`` of full-precision weights into a checkpoint's FP8
    layers both do. ``start``: the first of the whole row's columns K is (a rank's slice may start mid-block)."""
    k = w.shape[1]
    off = start % GROUP_K
    s = scale.float().repeat_interleave(GROUP_K, dim=1)[:, off : off + k] if scale.shape[1] > 1 else scale.float()
    return (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``w8: [N, K]`` e4m3 and row scales ``[N, KB]`` (KB 1 or cdiv(K, GROUP_K)) -> ``w8 * scale`` in ``dtype``."""
    n, k = w8.shape
    s = scale.float().repeat_interleave(GROUP_K, dim=1)[:, :k] if scale.shape[1] > 1 else scale.float()
    return (w8.float() * s).to(dtype)


# ------------------------------------------------------------------------------------------------ matmul


@triton.jit
def _e4m3_values(q):
    # q: fp32 in [-448, 448] -> the nearest-even e4m3 value, in fp32; for the interpreter, whose fp32 -> e4m3 cast
    # rounds wrongly. Adding 1.5 * 2^(u + 23), u the exponent of q's e4m3 step (3 mantissa bits, 2^-9 at least:
    # the subnormals), rounds q to a multiple of 2^u in one fp32 add (nearest even); subtracting it is exact.
    e = (q.to(tl.int32, bitcast=True) >> 23) & 0xFF  # q's biased fp32 exponent
    step = tl.maximum(e - 3, 127 - 9)  # the biased exponent of 2^u
    c = (((step + 23) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    return (q + c) - c


@triton.jit
def _quantize_tile(x, scale, UPCAST: tl.constexpr, BM: tl.constexpr, ROWS: tl.constexpr):
    # x: [ROWS, BK] fp32, scale: [ROWS] -> [BM, BK] e4m3 (the interpreter: its values in fp32) by _quantize_kernel's
    # formulas; ROWS 1: one row, repeated BM times. One return (Triton's code generator goes on past a return in an
    # if).
    q = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
    if UPCAST:
        out = _e4m3_values(q)
    else:
        if ROWS == 1:
            # An identity the compiler may not duplicate (not pure): without it Triton 3.9 moves the division into
            # the repeated rows' layout and computes it once per copy (sm_90 PTX; Triton 3.6 does not).
            q = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [q], dtype=tl.float32, is_pure=False, pack=1)
        out = q.to(tl.float8e4nv)
    if ROWS != BM:
        out = tl.broadcast_to(out, (BM, x.shape[1]))
    return out


@triton.jit
def _block_part(
    a_rows, a_rows_t, q_rows, q_ok, as_ptr, b_ptr, bs_ptr, g, offs_m, offs_n, offs_k, m_ok, n_ok, K,
    stride_ak, stride_asm, stride_asg, stride_bk, stride_bn, stride_bsn, stride_bsg,
    UPCAST: tl.constexpr, IMPRECISE_ACC: tl.constexpr, QUANTIZE_A: tl.constexpr, A_ROWS: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, GROUP_K: tl.constexpr, SWAP: tl.constexpr,
):  # fmt: skip
    # K block g of one tile: (its e4m3 products summed in fp32 from zero [BM, BN], the scales sa[:, None] *
    # sb[None, :]); SWAP: the same products with the operands' roles swapped (the weights' rows as the MMA's M, the
    # tokens as its N), both transposed, [BN, BM].
    # A block past K loads zeros: its part is +0 and the scales those of the last block (never -0 or inf: an
    # accumulator that starts at +0 is never -0, so adding +0 * scale leaves it unchanged).
    gs = tl.minimum(g, tl.cdiv(K, GROUP_K) - 1)  # the scales' block
    sb = tl.load(bs_ptr + offs_n * stride_bsn + gs * stride_bsg, mask=n_ok, other=0.0)
    if QUANTIZE_A:  # the block's scale per row: max |x| over its GROUP_K columns (exact in any order)
        if BK == GROUP_K:
            k = g * GROUP_K + offs_k
            x = tl.load(q_rows + k[None, :] * stride_ak, mask=q_ok[:, None] & (k < K)[None, :], other=0.0)
            x = x.to(tl.float32)
            sq = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / 448.0
        else:
            amax = tl.zeros((A_ROWS,), dtype=tl.float32)
            for kk in tl.static_range(0, GROUP_K, BK):
                k = g * GROUP_K + kk + offs_k
                x = tl.load(q_rows + k[None, :] * stride_ak, mask=q_ok[:, None] & (k < K)[None, :], other=0.0)
                amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), 1))
            sq = tl.maximum(amax, 1e-12) / 448.0
        sa = sq if A_ROWS == BM else tl.broadcast_to(sq, (BM,))
    else:
        sa = tl.load(as_ptr + offs_m * stride_asm + gs * stride_asg, mask=m_ok, other=0.0)
    if SWAP:
        part = tl.zeros((offs_n.shape[0], BM), dtype=tl.float32)
        for kk in tl.static_range(0, GROUP_K, BK):
            k = g * GROUP_K + kk + offs_k
            k_ok = k < K
            w = tl.load(b_ptr + offs_n[:, None] * stride_bn + k[None, :] * stride_bk,
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            x_t = tl.load(a_rows_t + k[:, None] * stride_ak, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            if UPCAST:
                part = tl.dot(w.to(tl.float32), x_t.to(tl.float32), part, input_precision="ieee")
            else:
                part = tl.dot(w, x_t, part, max_num_imprecise_acc=IMPRECISE_ACC)
        scale = sb[:, None] * sa[None, :]
    else:
        part = tl.zeros((BM, offs_n.shape[0]), dtype=tl.float32)
        for kk in tl.static_range(0, GROUP_K, BK):
            k = g * GROUP_K + kk + offs_k
            k_ok = k < K  # the tail of K (and of a block) loads zeros: exact
            if QUANTIZE_A:
                if BK != GROUP_K:  # the slice again (from cache), now that the block's scale is known
                    x = tl.load(q_rows + k[None, :] * stride_ak, mask=q_ok[:, None] & k_ok[None, :], other=0.0)
                    x = x.to(tl.float32)
                a = _quantize_tile(x, sq, UPCAST, BM, A_ROWS)
            else:
                a = tl.load(a_rows + k[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(
                b_ptr + k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                mask=n_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            if UPCAST:  # the interpreter has no e4m3 dot: the same values in fp32 (exact)
                part = tl.dot(a.to(tl.float32), b.to(tl.float32), part, input_precision="ieee")
            else:
                part = tl.dot(a, b, part, max_num_imprecise_acc=IMPRECISE_ACC)
        scale = sa[:, None] * sb[None, :]
    return part, scale


@triton.jit
def _fp8_mm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_asm, stride_asg,
    stride_bk, stride_bn, stride_bsn, stride_bsg,
    stride_cm, stride_cn, num_programs,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
    QUANTIZE_A: tl.constexpr, A_ROWS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCKS: tl.constexpr, SWAP: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # SWAP: the MMA computes C's transpose (the weights' rows as its M, BN a multiple of 64, and the tokens as its N,
    # BM from 8): a decode-sized M fills no 64 zero rows of A. The same products, summed by the MMA as the other
    # way round only if the hardware's order is symmetric, which bench/fp8_decode_tiles.py checks on the GPU.
    # Persistent: program p computes tiles p, p + num_programs, ...; which program owns a tile never changes it.
    # BLOCKS (1, 2 or 4): the K blocks a loop step computes, each added in block order to the accumulator: the
    # software pipeline then waits once for that many blocks' loads, not once a block. The same operations on every
    # element whatever BLOCKS, so the same bits.
    # QUANTIZE_A: A is the unquantized activations (any float dtype) and each K block's A tile is quantized where it
    # is loaded, per row and block, with _quantize_kernel's formulas (as_ptr unused): the same e4m3 values and
    # scales as quantize_rows(a, GROUP_K), so the same bits as the two kernels. A_ROWS: the rows of a tile that are
    # quantized, BM, or 1 where M = 1: the tile's other rows are then copies of row 0, whose outputs are past M and
    # never stored (a decode step quantizes its one row, not BM). Fewer rows than BM but more than 1 do not help:
    # Triton 3.6 computes them in the repeated layout (sm_90 PTX read on the CPU).
    pdl_wait(USE_PDL)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    offs_k = tl.arange(0, BK)
    for tile in range(tl.program_id(0), num_m * num_n, num_programs):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        m_ok = offs_m < M
        n_ok = offs_n < N
        a_rows = a_ptr + offs_m[:, None] * stride_am
        a_rows_t = a_ptr + offs_m[None, :] * stride_am
        offs_q = pid_m * BM + tl.arange(0, A_ROWS)  # the rows quantized (QUANTIZE_A)
        q_rows = a_ptr + offs_q[:, None] * stride_am
        q_ok = offs_q < M
        if SWAP:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for g in range(0, tl.cdiv(K, GROUP_K), BLOCKS):
            # K blocks g, g + 1, ...: each one's e4m3 products summed in fp32 from zero, then scaled and added in
            # block order, each in one fused multiply-add (spelled out: a compiler's own contraction may differ
            # between builds, as the attention merge's did).
            for j in tl.static_range(BLOCKS):
                part, scale = _block_part(
                    a_rows, a_rows_t, q_rows, q_ok, as_ptr, b_ptr, bs_ptr, g + j, offs_m, offs_n, offs_k, m_ok, n_ok,
                    K, stride_ak, stride_asm, stride_asg, stride_bk, stride_bn, stride_bsn, stride_bsg,
                    UPCAST, IMPRECISE_ACC, QUANTIZE_A, A_ROWS, BM, BK, GROUP_K, SWAP,
                )  # fmt: skip
                acc = tl.fma(part, scale, acc)
        if SWAP:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            c = c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None] * stride_cn
            tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            c = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
            tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_mm_tma_kernel(
    a_desc, as_ptr, b_desc, bs_ptr, bias_ptr, c_desc,
    M, N, K, stride_asm, stride_asg, stride_bsn, stride_bsg, num_programs,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCKS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # _fp8_mm_kernel's unswapped tiles with the operands brought in by the tensor memory accelerator (Hopper): A as
    # [BM, BK] and the weights as [BN, BK] tiles of [N, K], out-of-bounds rows and the K tail arriving as zeros, as
    # the pointer kernel's masked loads give them. The same products in the same order, so the same bits.
    pdl_wait(USE_PDL)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    last = tl.cdiv(K, GROUP_K) - 1
    for tile in range(tl.program_id(0), num_m * num_n, num_programs):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        offs_m = off_m + tl.arange(0, BM)
        offs_n = off_n + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for g in range(0, last + 1, BLOCKS):
            for j in tl.static_range(BLOCKS):
                part = tl.zeros((BM, BN), dtype=tl.float32)
                for kk in tl.static_range(0, GROUP_K, BK):
                    a = a_desc.load([off_m, (g + j) * GROUP_K + kk])
                    b = b_desc.load([off_n, (g + j) * GROUP_K + kk]).T
                    if UPCAST:
                        part = tl.dot(a.to(tl.float32), b.to(tl.float32), part, input_precision="ieee")
                    else:
                        part = tl.dot(a, b, part, max_num_imprecise_acc=IMPRECISE_ACC)
                gs = tl.minimum(g + j, last)  # a block past K: part +0, the last block's scales (_block_part)
                sa = tl.load(as_ptr + offs_m * stride_asm + gs * stride_asg, mask=offs_m < M, other=0.0)
                sb = tl.load(bs_ptr + offs_n * stride_bsn + gs * stride_bsg, mask=offs_n < N, other=0.0)
                acc = tl.fma(part, sa[:, None] * sb[None, :], acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


@dataclass(frozen=True)
class Fp8Config:
    bm: int
    bn: int
    bk: int = GROUP_K  # divides GROUP_K
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    # tl.dot's max_num_imprecise_acc: None is Triton's default (on sm_90 a block's wgmma chain accumulates in the
    # tensor core's reduced-precision accumulator until the block's fp32 add); 0 asks for a precise dot, which
    # Triton 3.9 compiles to mma.sync instead of wgmma (seen in the PTX). Not part of the tile: it can change the
    # bits, so every entry of the table must use one value (precise tiles are not in the sweep since session 14).
    imprecise_acc: int | None = None
    blocks: int = 1  # K blocks a loop step computes (1, 2 or 4; _fp8_mm_kernel's BLOCKS)
    swap: bool = False  # the MMA computes C's transpose (_fp8_mm_kernel's SWAP); not with the fused quantization
    tma: bool = False  # _fp8_mm_tma_kernel where the tile is unswapped and unfused and rows 16-byte aligned
    # Persistent programs per SM: 2 or more lets one SM run another tile's MMAs while a tile waits on its block's
    # (where registers and shared memory hold them). Which program computes a tile never changes its bits.
    per_sm: int = 1


def fp8_config(m: int, n: int, k: int) -> Fp8Config:
    """The tile for one problem, from N and a bucket of M; the reduction order never depends on it.

    Every tile gives the MMA at least 64 rows (BM, or BN in a swapped tile): on sm_90 Triton runs a 16-row e4m3 dot
    as ``mma.sync`` and a 64-row one as ``wgmma`` (seen in the PTX; tests/ops/test_fp8_compile.py keeps the table on
    wgmma), and nothing has shown the two to accumulate e4m3 products alike, as bf16's did on the H200 (docs/design.md,
    "Matmul"). Up to M = 16 the tile is swapped: the weights' rows fill the MMA's 64 rows and the tokens its 16
    columns (wgmma m64n16k32), instead of 63 zero rows of A beside one token; on the H200 it gave the unswapped
    tiles' bits at every M and shape swept, so the hardware sums a product pair alike either way round. M <= 64 was
    swept on the H200 with ``bench/fp8_decode_tiles.py``, M >= 64 with ``bench/fp8_check.py --sweep`` (which times the
    candidates and says whether their bits match).
    """
    C = Fp8Config
    if m <= 64:
        # Unfused everywhere. A fused tile at M = 1 quantizes its one row (_fp8_mm_kernel's A_ROWS), but on the H200
        # it took 36.2 us against 24.0 for the quantize kernel + GEMM (K 4096, N 4096, block scales; bench/fp8_check.py,
        # session 14), and above M = 1 every tile quantizes all its BM rows again for each of the N / BN tiles.
        # Session 15 (H200, block scales, M 1 / 16 / 64, us): N 4096 at BN 32 with 4 blocks a step, 10.7 / 11.5 / 12.1
        # (K 4096) and 26.9 / 29.1 / 31.1 (K 12288) against 12.4-13.4 and 33.3-36.9 one block a step; N 6144 at
        # BN 64, 16.7-17.5 (more blocks a step were slower there); N 24576 at BN 128, 47.0 / 47.2 at M <= 16, BN 64
        # at M 64 (52.3). Every one of them gave the table's bits.
        # The swapped tile at M 1 / 16 (session 15): 10.6 / 12.2 (N 6144), 9.4 / 10.6 (N 4096), 30.9 / 35.1
        # (N 24576), 23.3 / 27.3 (K 12288); at M 64 it re-reads the weights once per 16 tokens and loses.
        if m <= 16:
            return C(16, 64, num_stages=3, blocks=4, swap=True)
        return C(64, 32, blocks=4) if n <= 4096 else C(64, 64, tma=True, per_sm=3)
    # From M = 64 (session 17, H200, block scales; us, and x torch._scaled_mm with per-token activation and
    # per-channel weight scales): the TMA kernel, and 2-4 programs an SM so that one tile's MMAs run while another's
    # wait for their block to end. M 64, N > 4096: 64 x 64, 3 a SM, 16.5 (1.18x, N 6144) and 35.7 (0.88x, N 24576)
    # against 17.7 and 53.5 for the pointer tile. M 128: 64 x 64, 4 a SM, 16.3 / 45.1 (1.18x / 1.40x; N 4096 at K
    # 4096 / 12288) against 29.7 / 88.4 for 64 x 128 (too few tiles for the SMs), and 64 x 128, 2 a SM, at wider N
    # (1.50x at N 6144, 1.67x at N 24576). From M 256, 64 x 128 3 stages 2 a SM: 1.6-2.25x, against 2.1-4.0x for
    # the pointer tiles; 128 x 128 or 64 x 256 with 8 warps (2.3-2.9x), 3 programs an SM, and Triton's warp
    # specialization (2.9-3.0x) were slower. The gap left is the wait at each K block's end (a block's products are
    # summed from zero to take their scales), which DeepGEMM hides with two consumer warpgroups in turn.
    if m <= 128:
        return C(64, 64, tma=True, per_sm=4) if n <= 4096 else C(64, 128, tma=True, per_sm=2)
    return C(64, 128, num_stages=3, tma=True, per_sm=2)


# Every tile the table can pick, for the bit checks (bench/fp8_check.py, tests).
FP8_CONFIGS = tuple(dict.fromkeys(fp8_config(m, n, 4096) for m in (1, 32, 64, 128, 512) for n in (4096, 6144, 24576)))


def _fp8_mm_triton(
    a8: torch.Tensor,
    a_scale: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: Fp8Config | None = None,
) -> torch.Tensor:
    # a8: [M, K] e4m3, a_scale: [M, KBa], w8: [N, K] e4m3, w_scale: [N, KBw] (KB* = 1: one scale for the row)
    return _launch(a8, a_scale, w8, w_scale, bias, out_dtype, config, quantize_a=False)


def _fp8_linear_triton(
    x: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: Fp8Config | None = None,
) -> torch.Tensor:
    """``_fp8_mm_triton(*quantize_rows(x, GROUP_K), ...)`` in one kernel: ``x: [M, K]`` (any float dtype) is
    quantized per row and ``GROUP_K`` columns where the matmul loads it, with the quantization kernel's formulas, so
    the output has the same bits and neither the e4m3 activations nor their scales are written. The fused form has
    no swapped tile: where the table swaps (small M) it takes the 64 x 64 one."""
    config = config or fp8_config(x.shape[0], w8.shape[0], x.shape[1])
    return _launch(x, x, w8, w_scale, bias, out_dtype, Fp8Config(64, 64) if config.swap else config, quantize_a=True)


def _launch(a, a_scale, w8, w_scale, bias, out_dtype, config, quantize_a: bool) -> torch.Tensor:
    m, k = a.shape
    n = w8.shape[0]
    c = torch.empty((m, n), device=a.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return c
    cfg = config or fp8_config(m, n, k)
    if GROUP_K % cfg.bk:
        raise ValueError(f"BK={cfg.bk} must divide the scale block {GROUP_K}")
    if cfg.swap and quantize_a:
        raise ValueError("a swapped tile does not take the fused quantization")
    if cfg.blocks not in (1, 2, 4):
        raise ValueError(f"blocks={cfg.blocks}: a loop step computes 1, 2 or 4 K blocks")
    programs = max(1, min(triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn), cfg.per_sm * num_sms(a.device)))
    # A scale matrix of one column (a scale for the row) is read at every block: stride 0 across blocks.
    a_scale_strides = (0, 0) if quantize_a else (a_scale.stride(0), a_scale.stride(1) if a_scale.shape[1] > 1 else 0)
    w_scale_strides = (w_scale.stride(0), w_scale.stride(1) if w_scale.shape[1] > 1 else 0)
    common = dict(
        HAS_BIAS=bias is not None, UPCAST=interpreting(), IMPRECISE_ACC=cfg.imprecise_acc,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_K=GROUP_K, GROUP_M=cfg.group_m, BLOCKS=cfg.blocks,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(a),
    )  # fmt: skip
    bias_arg = bias if bias is not None else c
    b_desc = None
    if cfg.tma and not quantize_a and not cfg.swap and _aligned(a) and _aligned(c):
        b_desc = _weight_descriptor(w8, [cfg.bn, cfg.bk])
    if b_desc is not None:
        _fp8_mm_tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(a, [cfg.bm, cfg.bk]), a_scale, b_desc, w_scale, bias_arg,
            TensorDescriptor.from_tensor(c, [cfg.bm, cfg.bn]),
            m, n, k, *a_scale_strides, *w_scale_strides, programs, **common,
        )  # fmt: skip
        return c
    a_rows = 1 if quantize_a and m == 1 else cfg.bm  # the rows a fused tile quantizes (_fp8_mm_kernel)
    _fp8_mm_kernel[(programs,)](
        a, a_scale, w8, w_scale, bias_arg, c,
        m, n, k,
        a.stride(0), a.stride(1), *a_scale_strides,
        w8.stride(1), w8.stride(0), *w_scale_strides,
        c.stride(0), c.stride(1), programs,
        QUANTIZE_A=quantize_a, A_ROWS=a_rows, SWAP=cfg.swap, **common,
    )  # fmt: skip
    return c


def _cpu_blocks(w8: torch.Tensor) -> list[torch.Tensor]:
    """``w8: [N, K]`` e4m3 as fp32 K blocks ``[N, GROUP_K]`` (the last one shorter), packed for oneDNN's
    ``ROW_TILE``-row calls where possible; kept on the tensor while its version, storage and layout stay."""
    try:
        key = (w8._version, w8.data_ptr(), tuple(w8.shape), w8.stride())
    except RuntimeError:  # an inference tensor: no version counter, nothing shows it unchanged
        key = None
    memo = getattr(w8, "_lockstep_fp8_blocks", None)
    if key is not None and memo is not None and memo[0] == key:
        return memo[1]
    wf = w8.detach().float()
    blocks = []
    for k0 in range(0, wf.shape[1], GROUP_K):
        block = wf[:, k0 : k0 + GROUP_K].contiguous()
        if torch.backends.mkldnn.is_available() and block.numel():
            block = torch.ops.mkldnn._reorder_linear_weight(block, ROW_TILE)
        blocks.append(block)
    if key is not None:
        w8._lockstep_fp8_blocks = (key, blocks)
    return blocks


def _fp8_mm_cpu(
    a8: torch.Tensor,
    a_scale: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    # The kernel's blocks in the kernel's order; each block's dot is the fixed-row-tile fp32 matmul.
    m, k = a8.shape
    a = a8.float()
    ws = w_scale.float()
    acc = torch.zeros((m, w8.shape[0]), dtype=torch.float32)
    for g, block in enumerate(_cpu_blocks(w8)):
        part = _mm_cpu(a[:, g * GROUP_K : (g + 1) * GROUP_K], block, None, 1.0, 1.0, out_dtype=torch.float32)
        sa = a_scale[:, g if a_scale.shape[1] > 1 else 0]
        sb = ws[:, g if ws.shape[1] > 1 else 0]
        acc += part * (sa[:, None] * sb[None, :])
    if bias is not None:
        acc += bias.float()
    return acc.to(out_dtype)


def scaled_mm(
    a8: torch.Tensor,
    a_scale: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The scaled matmul of already quantized activations ``a8: [M, K]`` (``a_scale: [M, KBa]``) and ``w8: [N, K]``
    (``w_scale: [N, KBw]``) -> ``[M, N]`` in ``out_dtype``: the kernel on CUDA, the CPU path elsewhere."""
    if a8.is_cuda:
        return _fp8_mm_triton(a8, a_scale, w8, w_scale, bias, out_dtype)
    return _fp8_mm_cpu(a8, a_scale, w8, w_scale, bias, out_dtype)


def fp8_linear(
    x: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_group: int | None = GROUP_K,
) -> torch.Tensor:
    """``x @ dequantize(w8, w_scale).T + bias`` through e4m3 activations, batch-invariant; ``[..., K]`` ->
    ``[..., N]`` in x's dtype.

    ``w8: [N, K]`` e4m3; ``w_scale: [N, KB]`` fp32 with KB = 1 (one scale per row) or cdiv(K, GROUP_K) (per row and
    K block); ``act_group``: the activations' scale block, GROUP_K or None (one per token).
    """
    if w8.dtype != FP8 or w8.dim() != 2 or w8.shape[1] != x.shape[-1]:
        raise ValueError(f"fp8_linear: weight {tuple(w8.shape)} {w8.dtype} does not fit x {tuple(x.shape)}")
    kb = triton.cdiv(w8.shape[1], GROUP_K)
    if w_scale.dim() != 2 or w_scale.shape[0] != w8.shape[0] or w_scale.shape[1] not in (1, kb):
        raise ValueError(f"fp8_linear: weight scale {tuple(w_scale.shape)} for a weight {tuple(w8.shape)}")
    if act_group not in (None, GROUP_K):
        raise ValueError(f"act_group must be {GROUP_K} or None, got {act_group}")
    x2 = x.reshape(-1, x.shape[-1])
    # Two kernels: the fused one (_fp8_linear_triton, the same bits) was slower on the H200 (fp8_config says).
    a8, a_scale = quantize_rows(x2, act_group)
    out = scaled_mm(a8, a_scale, w8, w_scale, bias, x.dtype)
    return out.reshape(*x.shape[:-1], w8.shape[0])
