"""The gradient of RMSNorm, ``y = h * rsqrt(mean(h^2) + eps) * w`` over the last dim, on CUDA in Triton:
``rms_norm_backward``.

The trainer's backward (``ops.autograd.rms_norm``) needs deterministic, accurate bits, not invariant ones. torch's
formula makes a pass over [rows, N] in fp32 for each of a dozen operations (session 11's profile: 36 ms of a 4-layer,
16k-token step); this reads h, the output's gradient (and the returned h's) once and writes dh once. Per row, in
fp32: ``rstd``, ``normed = h * rstd``, ``gn = g * w``, ``dh = rstd * (gn - normed * mean(gn * normed)) (+ g_h)``.
The weight's gradient ``sum over rows of g * normed`` is reduced without atomics: a program sums its ``ROWS`` rows
in order into an fp32 partial, and the partials are summed in program order (``torch.sum`` over a fixed shape: the
number of programs follows the row count alone), so the bits repeat run to run.
"""

import torch
import triton
import triton.language as tl

from lockstep.ops._common import next_power_of_2

ROWS = 16  # rows per program (and per partial of the weight's gradient)
MAX_N = 16384  # widest row held in registers; wider rows take torch's formula (ops.autograd)


@triton.jit
def _rms_norm_backward_kernel(
    h_ptr, g_ptr, gh_ptr, w_ptr, dh_ptr, dw_ptr, rows, n, eps,
    HAS_WEIGHT: tl.constexpr, HAS_GH: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # h, g, gh, dh: [rows, n] contiguous; w: [n]; dw: [programs, n] fp32 partials.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32) if HAS_WEIGHT else tl.full([BLOCK], 1.0, tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        if row < rows:
            offs = row.to(tl.int64) * n + cols
            h = tl.load(h_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / n + eps)
            normed = h * rstd
            gn = g * w
            dh = rstd * (gn - normed * (tl.sum(gn * normed, 0) / n))
            if HAS_GH:
                dh += tl.load(gh_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(dh_ptr + offs, dh.to(dh_ptr.dtype.element_ty), mask=ok)
            dw += g * normed
    if HAS_WEIGHT:
        tl.store(dw_ptr + pid.to(tl.int64) * n + cols, dw, mask=ok)


def rms_norm_backward(
    h: torch.Tensor, weight: torch.Tensor | None, eps: float, grad_out: torch.Tensor, grad_h: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dh, dw)`` of ``rms_norm(h, weight, eps)`` for ``grad_out`` (and ``grad_h`` flowing into ``h`` itself),
    ``h: [..., N]`` with ``N <= MAX_N``; ``dh`` in ``h``'s dtype, ``dw`` in the weight's (None without one)."""
    n = h.shape[-1]
    if n > MAX_N:
        raise ValueError(f"rms_norm_backward holds rows of at most {MAX_N} elements, got {n}")
    h2 = h.reshape(-1, n).contiguous()
    g2 = grad_out.reshape(-1, n).contiguous()
    gh2 = None if grad_h is None else grad_h.reshape(-1, n).contiguous()
    rows = h2.shape[0]
    programs = triton.cdiv(rows, ROWS)
    dh = torch.empty_like(h2)
    dw = torch.empty((programs, n), device=h.device, dtype=torch.float32) if weight is not None else None
    if rows:
        block = max(16, next_power_of_2(n))
        _rms_norm_backward_kernel[(programs,)](
            h2, g2, gh2 if gh2 is not None else g2, weight if weight is not None else h2, dh,
            dw if dw is not None else dh, rows, n, eps,
            HAS_WEIGHT=weight is not None, HAS_GH=gh2 is not None, ROWS=ROWS, BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )  # fmt: skip
    grad_w = None if weight is None else dw.sum(0).to(weight.dtype)
    return dh.view(h.shape), grad_w
