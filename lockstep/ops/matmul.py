"""Batch-invariant matrix multiplication: ``mm``, ``addmm``, ``bmm``, ``linear``.

The contract: every output element is accumulated over K in one sequential loop from k = 0 upward, in fp32,
so its bits depend only on its own row and column and on K. No split-K, stream-K or atomics.

CUDA runs a persistent-tile Triton kernel. The tile shape comes from a fixed table keyed by (dtype, N, K) and an
M bucket: on the H200 the tile shape did not change the bits (docs/design.md, "Matmul"), and bench/ops.py re-checks
every M.
The CPU runs oneDNN's fp32 matmul on row tiles of fixed heights: ``ROW_TILE`` rows (``_common.map_row_tiles``), and
taller ones for many rows where a probe found them to give the 4-row tiles' bits (``_tall_tile_ok``); bf16/fp16
are upcast to fp32 there and rounded once at the end. A weight that ``linear`` sees again is kept in oneDNN's
blocked layout (``_cpu_weight``): packing reads and writes the whole weight, which at decode sizes costs more than
the multiply.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lockstep.ops._common import (
    FLOATS,
    ROW_TILE,
    cdiv,
    interpreting,
    intra_op_threads,
    map_row_tiles,
    num_sms,
    pdl_launch,
    pdl_wait,
)


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped order: consecutive tiles share B columns, which keeps them in L2."""
    tiles_per_group = GROUP_M * num_n
    first_m = (tile // tiles_per_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    return first_m + (tile % tiles_per_group) % group_m, (tile % tiles_per_group) // group_m


@triton.jit
def _store_tile(acc, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, alpha, beta,
                HAS_BIAS: tl.constexpr, SCALED: tl.constexpr):  # fmt: skip
    if SCALED:
        acc = acc * alpha
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc += beta * bias[None, :]
    c = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _mm_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr,
    M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    alpha, beta, num_programs,
    HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, FLAT: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # Persistent: program p computes tiles p, p + num_programs, ... of batch entry program_id(1). Which program
    # owns a tile never changes how the tile is computed.
    pdl_wait(USE_PDL)
    batch = tl.program_id(1)
    a_ptr += batch * stride_ab
    b_ptr += batch * stride_bb
    c_ptr += batch * stride_cb
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    offs_k = tl.arange(0, BK)
    if FLAT:
        # The same tiles and k = 0 upward loop, written as one loop over this program's (tile, k step) pairs: the
        # software pipeline keeps loading across a tile boundary instead of draining and refilling at each tile,
        # which matters when a program owns several tiles of few k steps (decode-sized M). Each tile's
        # accumulator still starts from zero and takes the same dots in the same order: the same bits.
        k_steps = tl.cdiv(K, BK)
        my_tiles = tl.cdiv(num_m * num_n - tl.program_id(0), num_programs)
        tile = tl.program_id(0) - num_programs
        ki = k_steps - 1
        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, my_tiles * k_steps):
            ki = tl.where(ki == k_steps - 1, 0, ki + 1)
            if ki == 0:
                tile += num_programs
                pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
                offs_m = pid_m * BM + tl.arange(0, BM)
                offs_n = pid_n * BN + tl.arange(0, BN)
            k_left = K - ki * BK
            # Zero-padding the rows past M, the columns past N and the tail of K adds exact zeros.
            a = tl.load(
                a_ptr + offs_m[:, None] * stride_am + (ki * BK + offs_k)[None, :] * stride_ak,
                mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left),
                other=0.0,
            )
            b = tl.load(
                b_ptr + (ki * BK + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                mask=(offs_n[None, :] < N) & (offs_k[:, None] < k_left),
                other=0.0,
            )
            acc = _mma_step(a, b, acc, UPCAST, PRECISION)
            if ki == k_steps - 1:
                _store_tile(acc, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, alpha, beta,
                            HAS_BIAS, SCALED)  # fmt: skip
                acc = tl.zeros((BM, BN), dtype=tl.float32)
    else:
        for tile in range(tl.program_id(0), num_m * num_n, num_programs):
            pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
            offs_m = pid_m * BM + tl.arange(0, BM)
            offs_n = pid_n * BN + tl.arange(0, BN)
            a_tile = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
            b_tile = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
            mask_m = offs_m[:, None] < M
            mask_n = offs_n[None, :] < N
            # The one reduction: k = 0 upward, BK at a time, into one fp32 accumulator.
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(0, K, BK):
                if EVEN_K:
                    a = tl.load(a_tile, mask=mask_m, other=0.0)
                    b = tl.load(b_tile, mask=mask_n, other=0.0)
                else:
                    # Zero-padding the tail of K adds exact zeros: the sum's bits do not change.
                    a = tl.load(a_tile, mask=mask_m & (offs_k[None, :] < K - k), other=0.0)
                    b = tl.load(b_tile, mask=mask_n & (offs_k[:, None] < K - k), other=0.0)
                acc = _mma_step(a, b, acc, UPCAST, PRECISION)
                a_tile += BK * stride_ak
                b_tile += BK * stride_bk
            _store_tile(acc, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, alpha, beta, HAS_BIAS,
                        SCALED)  # fmt: skip


@triton.jit
def _mma_step(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:  # the interpreter's bf16/fp16 dot is wrong; run it in fp32 there
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _mm_tma_kernel(
    a_desc, b_desc, c_desc, bias_ptr,
    M, N, K, alpha, beta, num_programs,
    HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, B_IS_NK: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # The same tiles and the same k = 0 upward loop as _mm_kernel, with operands brought in by the tensor
    # memory accelerator (Hopper): out-of-bounds rows and the K tail arrive as zeros.
    pdl_wait(USE_PDL)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    for tile in range(tl.program_id(0), num_m * num_n, num_programs):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([off_m, k])
            b = b_desc.load([off_n, k]).T if B_IS_NK else b_desc.load([k, off_n])
            acc = _mma_step(a, b, acc, UPCAST, PRECISION)
        if SCALED:
            acc = acc * alpha
        if HAS_BIAS:
            offs_n = off_n + tl.arange(0, BN)
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc += beta * bias[None, :]
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


@dataclass(frozen=True)
class MatmulConfig:
    bm: int
    bn: int
    bk: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False  # load operands with the tensor memory accelerator (Hopper, aligned 2-D operands)
    flat: bool = False  # one pipelined loop over a program's (tile, k step) pairs (_mm_kernel's FLAT); not with tma


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments; ~10 us of host time a launch uncached
def matmul_config(m: int, n: int, k: int, dtype: torch.dtype) -> MatmulConfig:
    """The tile for one problem, from (dtype, N) and a bucket of M; the reduction order never depends on it.

    Chosen by bench/ops.py --sweep on the H200 (Qwen3-8B shapes, bf16); every candidate, with and without TMA,
    gave the same bits. Small M is bandwidth-bound: enough tiles to cover the SMs and a deep pipeline over long
    K slices. Larger M is compute-bound: big tiles fed by the tensor memory accelerator.
    """
    C = MatmulConfig
    if dtype == torch.float32:
        return C(bm=32 if m <= 32 else 64, bn=64, bk=32, num_warps=4, num_stages=3)
    wide = n > 8192
    # 2026-12-01 sweep (M = 1, 16, 32, 64): the flat loop wins wherever a program owns several tiles, by 2-7% at
    # M <= 16 and by up to 30% at M 32 (fused QKV 17.1 vs 24.5 us, gate-up 50.2 vs 57.4, lm_head 294 vs 339). A
    # 36-layer decode step at batch 32 took 5.20 ms against 6.45 with the previous tiles; batch 1 did not move.
    # 2026-12-04 sweep (narrow products, N <= 2048: Qwen3-30B-A3B's o_proj, TP shards; docs/perf.md, session 18; K
    # 4096 x N 2048): 16-column tiles in the flat loop, 8.1 vs 10.3 us at M 1 (cuBLAS 9.7), 8.9 vs 10.4 at M 32,
    # 9.8 vs 10.8 at M 64; 64 x 32 tiles 11.2 vs 12.9 at M 96-128 (cuBLAS 9.6), but 6.4 vs 5.1 for N 128-512.
    narrow = n <= 2048
    if m <= 16:
        if narrow:
            return C(16, 16, 512, num_stages=4, flat=True)
        return C(16, 64 if wide else 32, 256, num_stages=5, flat=True)
    if m <= 32:
        if narrow:
            return C(32, 16, 256, num_stages=4, flat=True)
        return C(32, 32 if n <= 4096 else 64, 256, num_stages=4, flat=True)
    if m <= 64:
        if narrow:
            return C(64, 16, 256, num_stages=4, flat=True)
        return C(64, 32, 256, num_stages=4) if n <= 4096 else C(64, 64, 128, num_stages=4, flat=True)
    if m <= 128 and 1024 <= n <= 2048:
        return C(64, 32, 256, num_stages=4, flat=True)
    large = C(128, 256, 64, num_warps=8, num_stages=3, tma=True)
    mid = C(128, 128, 64, num_warps=8, num_stages=4, tma=True)
    # 2026-11-30 sweep (M = 128 and 256): mid for the gate-up projection (N = 24576) at M 256, 97 vs 102 us; the
    # fused QKV (N = 6144) 25 vs 27 us at M 128 and 29 vs 45 us at M 256.
    if wide:
        return mid if 128 < m <= 256 and n <= 65536 else large
    if n > 4096 and m <= 256:
        return C(128, 64, 64, num_stages=4, tma=True) if m <= 128 else mid
    if m <= 128 or (m <= 512 and n <= 2048):
        return C(64, 64, 128, num_stages=4, tma=True)
    if m <= 256:
        return C(64, 128, 64, num_stages=4, tma=True)
    if m <= 512 or (n <= 2048 and m <= 2048):
        return mid
    return large


def _aligned(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def _weight_descriptor(weight: torch.Tensor, block: list[int]) -> TensorDescriptor | None:
    """The TMA descriptor of a row-major ``weight: [N, K]`` (B as [N, K]), kept on the tensor: a layer's weight is
    described the same way at every call, and building a descriptor costs ~7 us of host time. The memo is keyed by
    what the descriptor encodes (address, shape, strides, dtype, block), never by the contents, so an in-place
    update needs no rebuild and a swapped storage gets a new one. It holds a detached alias, not the Parameter
    itself, so no reference cycle keeps a dropped model's weights alive. None when the layout does not allow TMA.
    """
    key = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, tuple(block))
    memo = getattr(weight, "_lockstep_tma", None)
    if memo is not None and memo[0] == key:
        return memo[1]
    if not _aligned(weight):
        return None
    desc = TensorDescriptor.from_tensor(weight.detach(), list(block))
    try:
        weight._lockstep_tma = (key, desc)
    except (AttributeError, RuntimeError):  # a tensor that takes no attributes: describe it at every call
        pass
    return desc


def _tma_descriptors(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, cfg: MatmulConfig, weight: torch.Tensor | None = None
):
    """Tensor descriptors for a 1-batch problem, or None when the layout does not allow them.

    TMA needs a unit-stride last dimension and 16-byte aligned rows and base addresses. B is described as
    [N, K] when it is a transposed row-major weight (F.linear's case), else as [K, N]. ``weight``: the ``[N, K]``
    tensor ``b[0]`` is the transpose of (``linear``'s), whose descriptor is kept between calls.
    """
    a2, b2, c2 = a[0], b[0], c[0]
    if not (_aligned(a2) and _aligned(c2)):
        return None
    b_is_nk = b2.stride(0) == 1 and b2.stride(1) != 1
    b_block = [cfg.bn, cfg.bk] if b_is_nk else [cfg.bk, cfg.bn]
    if b_is_nk and weight is not None:
        b_desc = _weight_descriptor(weight, b_block)
    else:
        b_major = b2.t() if b_is_nk else b2
        b_desc = TensorDescriptor.from_tensor(b_major, b_block) if _aligned(b_major) else None
    if b_desc is None:
        return None
    return (
        TensorDescriptor.from_tensor(a2, [cfg.bm, cfg.bk]),
        b_desc,
        TensorDescriptor.from_tensor(c2, [cfg.bm, cfg.bn]),
        b_is_nk,
    )


def _bmm_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    config: MatmulConfig | None = None,
    out_dtype: torch.dtype | None = None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    # a: [B, M, K], b: [B, K, N] (any strides), bias: [N] -> c: [B, M, N] in out_dtype (default a's dtype).
    # out_dtype=float32 stores the fp32 accumulator itself, unrounded. weight: linear's [N, K] with b[0] = weight.t()
    # (its TMA descriptor is kept; see _weight_descriptor).
    batch, m, k = a.shape
    n = b.shape[2]
    c = torch.empty((batch, m, n), device=a.device, dtype=out_dtype or a.dtype)
    if m == 0 or n == 0 or batch == 0:
        return c
    cfg = config or matmul_config(m, n, k, a.dtype)
    programs = max(1, min(cdiv(m, cfg.bm) * cdiv(n, cfg.bn), num_sms(a.device)))  # persistent
    common = dict(
        HAS_BIAS=bias is not None, SCALED=alpha != 1.0,
        UPCAST=interpreting() and a.dtype != torch.float32,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(a),
    )  # fmt: skip
    descriptors = _tma_descriptors(a, b, c, cfg, weight) if cfg.tma and batch == 1 else None
    if descriptors is not None:
        a_desc, b_desc, c_desc, b_is_nk = descriptors
        _mm_tma_kernel[(programs,)](
            a_desc, b_desc, c_desc, bias if bias is not None else c,
            m, n, k, alpha, beta, programs, B_IS_NK=b_is_nk, **common,
        )  # fmt: skip
        return c
    _mm_kernel[(programs, batch)](
        a, b, bias if bias is not None else c, c,
        m, n, k,
        a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        alpha, beta, programs, EVEN_K=k % cfg.bk == 0, FLAT=cfg.flat, **common,
    )  # fmt: skip
    return c


# The CPU matmul: ``_linear_pointwise(x, w)`` is ``x @ w.T`` for ``x: [ROW_TILE, K]``, ``w: [N, K]`` (any strides,
# or packed by ``_reorder_linear_weight``). A packed and a plain weight give the same bits (tests check it): oneDNN
# packs a plain weight itself on each call. Builds without oneDNN fall back to the BLAS behind aten.mm.
_ONEDNN = torch.backends.mkldnn.is_available()
# A call of one row tile on a weight this small (a decode step's projections) runs on one thread. It is over in
# about 0.1 ms, reading a weight from memory, and a second thread adds little bandwidth but a fork/join per call:
# 5 us with spinning OpenMP workers on an idle machine, tens of us with OMP_WAIT_POLICY=PASSIVE, and whole
# scheduler slices when other processes share the cores. Threads never change the bits (tested).
_CPU_SERIAL_WEIGHT_BYTES = 16 << 20
# Taller row tiles for calls of many rows (ROW_TILE times a power of two). A 4-row tile reads the whole weight for
# every 4 rows: at batch 32 a decode step's matmuls read each weight 8 times and took ~2.5x torch's one call. On
# the 2-core machines (AMD EPYC, AVX-512, oneDNN 3.12 in torch 2.13) oneDNN's rows did not depend on the call's
# height from 2 rows up (every M of 2..69, 96, 127..129, 200, 255..257 and 512 tried on SmolLM2's five weight shapes
# and two odd ones, packed and plain, 1 and 2 threads); only the 1-row call (a gemv) differs. Nothing promises that
# on another CPU or library, so a height is used for a (weight shape and layout, thread count) only once a probe has
# found it bitwise equal to ROW_TILE-row calls there (``_tall_tile_ok``); otherwise those rows go 4 at a time.
_TALL_TILES = (256, 128, 64, 32, 16, 8)
_tall_ok: dict[tuple, bool] = {}


def _onednn_mm(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, w, None, "none", [], "")


def _cpu_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight: [N, K]`` as the CPU path multiplies it: fp32, packed for ``ROW_TILE``-row calls when possible.

    The packed copy is kept on the tensor and rebuilt whenever its version counter, storage or layout changes, so
    an in-place update (``copy_`` on the tensor or a ``detach()``-ed view of it) is never served stale. Writes
    through ``.data`` bypass the version counter: lockstep makes none. An inference tensor has no version counter,
    so nothing shows it unchanged: it is converted on every call. Nor is a weight that requires grad (a trainer's):
    a fused optimizer (``torch.optim.AdamW(fused=True)``, transformers' Trainer default) updates it in place without
    bumping the version counter, so a kept copy would go stale: it is packed afresh on every call (once, not once
    per row tile as a plain weight would be).
    """
    if not _ONEDNN or weight.numel() == 0:
        return weight.detach().float()
    if weight.requires_grad:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float(), ROW_TILE)
    try:
        key = (weight._version, weight.data_ptr(), weight.dtype, tuple(weight.shape), weight.stride())
    except RuntimeError:  # "Inference tensors do not track version counter"
        return weight.detach().float()
    memo = getattr(weight, "_lockstep_packed", None)
    if memo is None or memo[0] != key:
        memo = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach().float(), ROW_TILE))
        weight._lockstep_packed = memo
    return memo[1]


def _mm_cpu(
    a: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    alpha: float,
    beta: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    # a: [M, K] any float dtype, w: [N, K] fp32 (plain or from _cpu_weight), bias: [N] -> [M, N] in out_dtype
    # (default a's dtype; float32 keeps the fp32 result)

    def tile_mm(rows: torch.Tensor) -> torch.Tensor:
        if _ONEDNN:
            return _onednn_mm(rows, w)
        # aten.mm.out, not torch.mm: inside batch_invariant_mode torch.mm would come back here.
        return torch.ops.aten.mm.out(rows, w.t(), out=rows.new_empty((rows.shape[0], w.shape[0])))

    serial = a.shape[0] <= ROW_TILE and w.shape[0] * w.shape[1] * 4 < _CPU_SERIAL_WEIGHT_BYTES
    with intra_op_threads(1 if serial else None):
        c = _map_tall_tiles(tile_mm, a.float(), w)
    if alpha != 1.0:
        c = c * alpha
    if bias is not None:
        c = c + beta * bias.float()
    return c.to(out_dtype or a.dtype)


def _tall_tile_ok(tile_mm: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor, tile: int) -> bool:
    """Whether ``tile``-row calls of ``tile_mm`` on weights like ``w`` give ROW_TILE-row calls' bits, row for row.

    Probed once per (tile, weight shape and layout, dtype, thread count) on random rows through ``w`` itself: a
    library that picks another algorithm for the taller call sums in another order, which shows in the bits of
    random fp32 rows (the tests check that a probe sees it)."""
    layout = "packed" if w.is_mkldnn else w.stride()
    key = (tile, tuple(w.shape), layout, w.dtype, torch.get_num_threads(), _ONEDNN)
    ok = _tall_ok.get(key)
    if ok is None:
        x = torch.randn((tile, w.shape[1]), generator=torch.Generator().manual_seed(tile))
        ok = _tall_ok[key] = torch.equal(tile_mm(x), map_row_tiles(tile_mm, x))
    return ok


def _map_tall_tiles(tile_mm: Callable[[torch.Tensor], torch.Tensor], a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # a: [M, K] fp32 -> [M, N]: the tallest tiles that fit (and passed their probe) first, the rest 4 rows a call.
    m = a.shape[0]
    if m < _TALL_TILES[-1]:
        return map_row_tiles(tile_mm, a)
    a = a.contiguous()
    parts, done = [], 0
    for tile in _TALL_TILES:
        if m - done >= tile and _tall_tile_ok(tile_mm, w, tile):
            while m - done >= tile:
                parts.append(tile_mm(a[done : done + tile]))
                done += tile
    if done < m:
        parts.append(map_row_tiles(tile_mm, a[done:]))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _check(a: torch.Tensor, b: torch.Tensor, batched: bool) -> None:
    rank = 3 if batched else 2
    if a.dim() != rank or b.dim() != rank:
        raise ValueError(f"expected {rank}-D operands, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-2] or (batched and a.shape[0] != b.shape[0]):
        raise ValueError(f"shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    if a.dtype != b.dtype or a.dtype not in FLOATS:
        raise TypeError(f"expected matching float32/bfloat16/float16 operands, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"operands are on different devices: {a.device} and {b.device}")


def _check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"bias must have shape [{n}], got {tuple(bias.shape)}")


def _addmm(
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    alpha: float,
    beta: float,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    # weight: linear's [N, K], b = weight.t() (for _bmm_triton's kept descriptor)
    _check(a, b, batched=False)
    _check_bias(bias, b.shape[1])
    if a.is_cuda:
        return _bmm_triton(a[None], b[None], bias, alpha, beta, weight=weight)[0]
    return _mm_cpu(a, b.t().float(), bias, alpha, beta)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D ``a: [M, K]``, ``b: [K, N]``, batch-invariant."""
    return _addmm(None, a, b, 1.0, 1.0)


def addmm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1.0, alpha: float = 1.0
) -> torch.Tensor:
    """``beta * bias + alpha * (a @ b)``, computed in fp32 and rounded once.

    ``bias`` may be ``[N]`` (fused into the kernel) or anything broadcastable to ``[M, N]`` (added after).
    """
    if bias.dim() == 1 and bias.shape[0] == b.shape[-1]:
        return _addmm(bias, a, b, alpha, beta)
    prod = _addmm(None, a, b, alpha, 1.0)
    return (beta * bias.float() + prod.float()).to(prod.dtype) if beta != 0 else prod


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 3-D ``a: [B, M, K]``, ``b: [B, K, N]``; each batch entry is reduced like ``mm``."""
    _check(a, b, batched=True)
    if a.is_cuda:
        return _bmm_triton(a, b)
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
    for i in range(a.shape[0]):
        out[i] = _mm_cpu(a[i], b[i].t().float(), None, 1.0, 1.0)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``: ``x: [..., K]``, ``weight: [N, K]``, ``bias: [N]`` -> ``[..., N]``."""
    # x: [*lead, K] -> [num_rows, K]
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x.is_cuda or weight.device != x.device:
        out = _addmm(bias, x2, weight.t(), 1.0, 1.0, weight if x.is_cuda else None)
    else:  # the CPU keeps a packed copy of the weight (_cpu_weight)
        _check(x2, weight.t(), batched=False)
        _check_bias(bias, weight.shape[0])
        out = _mm_cpu(x2, _cpu_weight(weight), bias, 1.0, 1.0)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weight.shape[0])
