"""Batch-invariant LayerNorm: ``layer_norm``, the vision towers' norm (Qwen3-VL's blocks and patch merger).

Rounding follows torch's ``F.layer_norm`` (Hugging Face's ``nn.LayerNorm``): the mean, the variance and
``(x - mean) * rstd * weight + bias`` all in fp32, rounded to the input dtype once at the end. The variance is the
mean of the centered squares (two passes over the row, not Welford's running update, whose order is the same but
whose bits are not torch's either).

The contract: a row's two sums are combined in an order fixed by N alone. CUDA runs one Triton program per
``rows`` rows with the program shape from ``reduce.row_config(N)`` (rms_norm's layout): a row of up to
``MAX_FUSED`` columns is read once and kept in registers; a longer one is walked chunk by chunk into a fixed-width
accumulator, once for the sum, once for the centered squares and once to normalize. The CPU sums with
``reduce.row_sums``; the rest is elementwise IEEE arithmetic, the same bits in any lane.
"""

import math

import torch
import triton
import triton.language as tl

from lockstep.ops._common import FLOATS, cdiv, pdl_launch, pdl_wait
from lockstep.ops.reduce import RowConfig, row_config, row_sums


@triton.jit
def _layer_norm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, stride_xm, stride_om,
    n_float, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, SINGLE: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = (rows < M)[:, None]
    # Rows past M re-read row M - 1 (no empty rows to special-case); their results are never stored.
    safe_rows = tl.minimum(rows, M - 1).to(tl.int64)[:, None]
    x_rows = x_ptr + safe_rows * stride_xm
    o_rows = out_ptr + safe_rows * stride_om
    cols = tl.arange(0, BLOCK)[None, :]
    n_vec = tl.zeros((ROWS,), tl.float32) + n_float
    if SINGLE:  # the row fits in registers: one read, one write
        mask = cols < N
        x = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.div_rn(tl.sum(x, axis=1), n_vec)
        d = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.div_rn(tl.sum(d * d, axis=1), n_vec) + eps)
        y = d * rstd[:, None]
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_rows + cols, y.to(out_ptr.dtype.element_ty), mask=mask & row_ok)
    else:
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for start in range(0, N, BLOCK):
            acc += tl.load(x_rows + start + cols, mask=cols < N - start, other=0.0).to(tl.float32)
        mean = tl.div_rn(tl.sum(acc, axis=1), n_vec)
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for start in range(0, N, BLOCK):
            mask = cols < N - start
            x = tl.load(x_rows + start + cols, mask=mask, other=0.0).to(tl.float32)
            d = tl.where(mask, x - mean[:, None], 0.0)
            acc += d * d
        rstd = tl.rsqrt(tl.div_rn(tl.sum(acc, axis=1), n_vec) + eps)
        for start in range(0, N, BLOCK):
            mask = cols < N - start
            x = tl.load(x_rows + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean[:, None]) * rstd[:, None]
            if HAS_WEIGHT:
                y = y * tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y = y + tl.load(b_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(o_rows + start + cols, y.to(out_ptr.dtype.element_ty), mask=mask & row_ok)


def _layer_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    config: RowConfig | None = None,
) -> torch.Tensor:
    # x: [M, N] with unit column stride; weight, bias: [N] contiguous or None -> [M, N] contiguous, x's dtype
    m, n = x.shape
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    cfg = config or row_config(n)
    _layer_norm_kernel[(cdiv(m, cfg.rows),)](
        x, weight if weight is not None else x, bias if bias is not None else x, out,
        m, n, x.stride(0), out.stride(0),
        float(n), float(eps),
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, SINGLE=n <= cfg.block,
        ROWS=cfg.rows, BLOCK=cfg.block, num_warps=cfg.num_warps, **pdl_launch(x),
    )  # fmt: skip
    return out


def _layer_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    # x: [M, N] -> [M, N] in x's dtype. Elementwise ops and row_sums only, so a row's bits cannot depend on the
    # batch it runs in.
    xf = x.float()
    n = x.shape[1]
    d = xf - row_sums(xf).div_(n)[:, None]
    rstd = row_sums(d * d).div_(n).add_(eps).rsqrt_()
    y = d.mul_(rstd[:, None])
    if weight is not None:
        y.mul_(weight.float())
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of ``x: [..., N]``: ``(x - mean) / sqrt(var + eps) * weight + bias`` in fp32,
    rounded to ``x``'s dtype once; ``weight, bias: [N]`` or None (any float dtype). Batch-invariant: a row's bits
    never depend on the other rows."""
    if x.dtype not in FLOATS or x.dim() == 0:
        raise TypeError(f"expected a float32/bfloat16/float16 tensor of rank >= 1, got {x.dtype}, {x.dim()}-D")
    n = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.shape != (n,) or t.device != x.device):
            raise ValueError(f"{name} must have shape [{n}] on {x.device}, got {tuple(t.shape)} on {t.device}")
    if n == 0:
        return x.clone()
    lead = x.shape[:-1]
    # x: [*lead, N] -> [num_rows, N] with unit column stride
    x2 = x.reshape(math.prod(lead), n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if x.is_cuda:
        weight = weight if weight is None or weight.is_contiguous() else weight.contiguous()
        bias = bias if bias is None or bias.is_contiguous() else bias.contiguous()
        out = _layer_norm_triton(x2, weight, bias, eps)
    else:
        out = _layer_norm_cpu(x2, weight, bias, eps)
    return out.reshape(x.shape)
