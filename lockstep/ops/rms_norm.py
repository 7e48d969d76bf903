"""Batch-invariant RMSNorm, optionally fused with the residual add: ``rms_norm``, ``rms_norm_with_rstd``.

Rounding follows Hugging Face's ``LlamaRMSNorm``: normalize in fp32, round to the input dtype, then multiply by
the weight and round again. With a residual, ``h = x + residual`` is rounded to the input dtype first (vLLM's
``fused_add_rms_norm``) and normalized.

The contract: a row's sum of squares is combined in an order fixed by N alone. CUDA runs one Triton program per
``rows`` rows with the program shape from ``reduce.row_config(N)``: a row of up to ``MAX_FUSED`` columns is read
once and kept in registers; a longer one is summed chunk by chunk into a fixed-width accumulator, then read again
to normalize. The CPU sums the squares with ``reduce.row_sums``; the rest is elementwise.
"""

import math

import torch
import triton
import triton.language as tl

from lockstep.ops._common import FLOATS, pdl_launch, pdl_wait
from lockstep.ops.reduce import RowConfig, row_config, row_sums


@triton.jit
def _load_h(x_rows, r_rows, offs, mask, HAS_RESIDUAL: tl.constexpr):
    # h = x + residual rounded to x's dtype, returned in fp32 (every value exact in fp32).
    x = tl.load(x_rows + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_rows + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _normalize(h, rstd, w_ptr, cols, col_mask, HAS_WEIGHT: tl.constexpr, DTYPE: tl.constexpr):
    # HF's rounding: (h * rstd) rounded to the input dtype, then times the weight, rounded again.
    y = (h * rstd[:, None]).to(DTYPE)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) * w).to(DTYPE)
    return y


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, w2_ptr, out_ptr, h_ptr, rstd_ptr,
    M, N, heads, split, stride_xt, stride_xm, stride_rm, stride_om, stride_hm,
    n_float, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, TWO_WEIGHTS: tl.constexpr, SINGLE: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = (rows < M)[:, None]
    # Rows past M re-read row M - 1 (no empty rows to special-case); their results are never stored.
    safe_rows = tl.minimum(rows, M - 1).to(tl.int64)[:, None]
    # x: [M // heads, heads, N] with strides (stride_xt, stride_xm, 1): row r is (r // heads, r % heads), so the
    # heads of a strided [tokens, heads, N] view (q and k inside the fused QKV output) need no copy. 2-D: heads 1.
    x_rows = x_ptr + (safe_rows // heads) * stride_xt + (safe_rows % heads) * stride_xm
    # TWO_WEIGHTS: heads from ``split`` on take the second weight (q's and k's heads in one launch).
    w_rows = tl.where((safe_rows % heads) < split, w_ptr, w2_ptr) if TWO_WEIGHTS else w_ptr
    r_rows = r_ptr + safe_rows * stride_rm
    o_rows = out_ptr + safe_rows * stride_om
    h_rows = h_ptr + safe_rows * stride_hm
    dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)[None, :]
    if SINGLE:  # the row fits in registers: one read, one write
        mask = cols < N
        h = _load_h(x_rows, r_rows, cols, mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(h_rows + cols, h.to(dtype), mask=mask & row_ok)
        rstd = tl.rsqrt(tl.div_rn(tl.sum(h * h, axis=1), tl.zeros((ROWS,), tl.float32) + n_float) + eps)
        y = _normalize(h, rstd, w_rows, cols, mask, HAS_WEIGHT, dtype)
        tl.store(o_rows + cols, y, mask=mask & row_ok)
    else:
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for start in range(0, N, BLOCK):
            mask = cols < N - start
            h = _load_h(x_rows, r_rows, start + cols, mask, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                tl.store(h_rows + start + cols, h.to(dtype), mask=mask & row_ok)
            acc += h * h
        rstd = tl.rsqrt(tl.div_rn(tl.sum(acc, axis=1), tl.zeros((ROWS,), tl.float32) + n_float) + eps)
        # Second pass last chunk first: the chunks read most recently are the likeliest still in L2.
        num_chunks = tl.cdiv(N, BLOCK)
        for i in range(0, num_chunks):
            start = (num_chunks - 1 - i) * BLOCK
            mask = cols < N - start
            h = _load_h(x_rows, r_rows, start + cols, mask, HAS_RESIDUAL)  # recomputed: same bits as pass 1
            y = _normalize(h, rstd, w_rows + start, cols, mask, HAS_WEIGHT, dtype)
            tl.store(o_rows + start + cols, y, mask=mask & row_ok)
    tl.store(rstd_ptr + rows, rstd, mask=rows < M)


def _rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    config: RowConfig | None = None,
    second: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # x, residual: [M, N] with unit column stride, or x: [T, H, N] (unit last stride, any other strides) without
    # residual; weight: [N] contiguous -> out like x but contiguous, h: x or [M, N], rstd [M] fp32.
    # second = (weight2, split): heads split.. of a [T, H, N] x take weight2.
    if x.dim() == 3 and residual is not None:
        raise ValueError("a [tokens, heads, N] input takes no residual")
    heads, n = (x.shape[1], x.shape[2]) if x.dim() == 3 else (1, x.shape[1])
    m = x.shape[0] * heads
    stride_xt = x.stride(0)
    stride_xm = x.stride(1) if x.dim() == 3 else x.stride(0)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    h = x if residual is None else torch.empty_like(out)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    if m == 0:
        return out, h, rstd
    cfg = config or row_config(n)
    r = residual if residual is not None else x
    w = weight if weight is not None else x
    w2, split = second if second is not None else (w, heads)
    _rms_norm_kernel[(triton.cdiv(m, cfg.rows),)](
        x, r, w, w2, out, h, rstd,
        m, n, heads, split, stride_xt, stride_xm, r.stride(-2), n, h.stride(-2),
        float(n), float(eps),
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, TWO_WEIGHTS=second is not None,
        SINGLE=n <= cfg.block,
        ROWS=cfg.rows, BLOCK=cfg.block, num_warps=cfg.num_warps, **pdl_launch(x),
    )  # fmt: skip
    return out, h, rstd


def _rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # x, residual: [M, N] -> out [M, N], h [M, N], rstd [M] fp32. Elementwise ops and row_sums only, so
    # a row's bits cannot depend on the batch it runs in.
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        # The same arithmetic without the casts, which are no-ops in fp32 (a decode step makes 61 of these calls).
        h = x if residual is None else x + residual
        rstd = row_sums(h * h).div_(x.shape[1]).add_(eps).rsqrt_()
        y = h * rstd[:, None]
        return (y if weight is None else y.mul_(weight)), h, rstd
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    rstd = torch.rsqrt(row_sums(hf * hf) / x.shape[1] + eps)
    y = (hf * rstd[:, None]).to(x.dtype)
    if weight is not None:
        y = (y.float() * weight.float()).to(x.dtype)
    return y, h, rstd


def _rms_norm_rows(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # x, residual: [..., N] -> out [..., N], h [..., N], rstd [..., 1] fp32
    if x.dtype not in FLOATS or x.dim() == 0:
        raise TypeError(f"expected a float32/bfloat16/float16 tensor of rank >= 1, got {x.dtype}, {x.dim()}-D")
    n = x.shape[-1]
    if weight is not None and (weight.shape != (n,) or weight.device != x.device):
        raise ValueError(f"weight must have shape [{n}] on {x.device}, got {tuple(weight.shape)} on {weight.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device):
        raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(residual.shape)}, "
                         f"{residual.dtype}")  # fmt: skip
    lead = x.shape[:-1]
    if n == 0:
        return x.clone(), x.clone(), torch.full((*lead, 1), torch.nan, device=x.device)
    # x: [*lead, N] -> [num_rows, N] with unit column stride. On CUDA a [tokens, heads, N] view without a residual
    # goes in as it is, however strided (q or k inside the fused QKV output): the kernel reads its heads, no copy.
    heads_view = x.is_cuda and x.dim() == 3 and residual is None and x.stride(2) == 1
    x2 = x if x.dim() == 2 or heads_view else x.reshape(math.prod(lead), n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = residual if residual is None or residual.dim() == 2 else residual.reshape(x2.shape)
    r2 = r2 if r2 is None or r2.stride(1) == 1 else r2.contiguous()
    weight = weight if weight is None or weight.is_contiguous() else weight.contiguous()
    if x.is_cuda:
        out, h, rstd = _rms_norm_triton(x2, weight, eps, r2)
    else:
        out, h, rstd = _rms_norm_cpu(x2, weight, eps, r2)
    if x.dim() == 2:
        return out, h, rstd[:, None]
    return out.reshape(x.shape), h.reshape(x.shape), rstd.reshape(*lead, 1)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of ``x: [..., N]`` with HF's rounding; ``weight: [N]`` or ``None``.

    Returns ``out``; with ``residual`` (same shape and dtype as ``x``) returns ``(rms_norm(h), h)`` where
    ``h = x + residual`` rounded to ``x.dtype``. ``out`` has ``x``'s dtype whatever the weight's.
    """
    out, h, _ = _rms_norm_rows(x, weight, eps, residual)
    return out if residual is None else (out, h)


def rms_norm_qk(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps))`` for the per-head norms of Qwen3's attention,
    ``q: [T, Hq, N]`` and ``k: [T, Hk, N]``. On CUDA, when k's heads follow q's in memory (views of the fused QKV
    output), one launch normalizes both: the same kernel, row by row the same arithmetic, the weight picked by
    the row's head. The outputs are then views of one ``[T, Hq + Hk, N]`` tensor."""
    hq, n = q.shape[1], q.shape[-1]
    adjacent = (
        q.is_cuda
        and q.dim() == k.dim() == 3
        and q.shape[0] == k.shape[0]
        and k.shape[2] == n
        and q.dtype == k.dtype
        and q.stride()[1:] == k.stride()[1:]
        and (q.shape[0] == 1 or q.stride(0) == k.stride(0))  # one token: torch gives each view its own stride(0)
        and q.stride(2) == 1
        and q.stride(1) >= n
        and k.data_ptr() == q.data_ptr() + hq * q.stride(1) * q.element_size()
        and q_weight.shape == k_weight.shape == (n,)
        and q_weight.dtype == k_weight.dtype
        and q_weight.is_contiguous()
        and k_weight.is_contiguous()
    )
    if not adjacent:
        return rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    both = q.as_strided((q.shape[0], hq + k.shape[1], n), q.stride())
    out = _rms_norm_triton(both, q_weight, eps, second=(k_weight, hq))[0]
    return out[:, :hq], out[:, hq:]


def rms_norm_with_rstd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten::_fused_rms_norm(x, [N], weight, eps)``: ``(out, rstd)`` with ``rstd: [..., 1]`` fp32.

    ``eps=None`` means fp32's machine epsilon, as in torch (which takes the eps of the fp32 compute type for
    bf16/fp16 inputs too). Note torch's own kernel rounds once (``x * rstd * weight`` in fp32); this one rounds
    before the weight product, like HF and ``rms_norm``.
    """
    out, _, rstd = _rms_norm_rows(x, weight, torch.finfo(torch.float32).eps if eps is None else eps, None)
    return out, rstd
