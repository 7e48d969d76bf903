"""``batch_invariant_mode``: route PyTorch's own aten ops to lockstep's batch-invariant ops.

Inside the mode an unmodified PyTorch model (a Hugging Face ``LlamaForCausalLM``, say) computes every row of
every matmul, softmax, log_softmax, mean and RMSNorm with a reduction order that does not depend on the batch.
The overrides are ``torch.library`` kernels for the CPU and CUDA dispatch keys; leaving the mode destroys the
library, which restores torch's own kernels. Autograd still works: derivative formulas call the same aten ops.

Dtypes the invariant ops don't cover (integers, complex, float64) fall through to torch's ``.out`` kernels,
which the mode leaves alone.
"""

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from lockstep.ops import matmul
from lockstep.ops._common import FLOATS
from lockstep.ops.reduce import mean
from lockstep.ops.rms_norm import rms_norm_with_rstd
from lockstep.ops.softmax import log_softmax, softmax

_lock = threading.Lock()
_library: torch.library.Library | None = None


def _invariant(*tensors: torch.Tensor) -> bool:
    """Whether lockstep's ops handle these operands (else torch's ``.out`` kernel runs)."""
    return all(t.dtype in FLOATS for t in tensors) and tensors[0].device.type in ("cpu", "cuda")


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _invariant(a, b) and a.dtype == b.dtype:
        return matmul.mm(a, b)
    return torch.ops.aten.mm.out(a, b, out=a.new_empty((a.shape[0], b.shape[1]), dtype=torch.result_type(a, b)))


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if _invariant(bias, a, b) and a.dtype == b.dtype == bias.dtype:
        return matmul.addmm(bias, a, b, beta=float(beta), alpha=float(alpha))
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=torch.result_type(a, b))
    return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _invariant(a, b) and a.dtype == b.dtype:
        return matmul.bmm(a, b)
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=torch.result_type(a, b))
    return torch.ops.aten.bmm.out(a, b, out=out)


def _mv(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _mm(a, v[:, None])[:, 0]


def _softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    dtype = torch.float32 if half_to_float else x.dtype
    if _invariant(x):
        return softmax(x, dim, dtype=dtype)
    return torch.ops.aten._softmax.out(x, dim, half_to_float, out=x.new_empty(x.shape, dtype=dtype))


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    dtype = torch.float32 if half_to_float else x.dtype
    if _invariant(x):
        return log_softmax(x, dim, dtype=dtype)
    return torch.ops.aten._log_softmax.out(x, dim, half_to_float, out=x.new_empty(x.shape, dtype=dtype))


def _mean(x: torch.Tensor, dim: list[int] | None, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
    if _invariant(x) and (dtype is None or dtype in FLOATS):
        return mean(x, dim, keepdim=keepdim, dtype=dtype)
    out_dtype = dtype or (x.dtype if x.is_floating_point() or x.is_complex() else torch.float32)
    total = torch.sum(x, dim, keepdim=keepdim, dtype=out_dtype)
    return total / max(1, x.numel() // max(1, total.numel()))


def _fused_rms_norm(x: torch.Tensor, normalized_shape: list[int], weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    if len(normalized_shape) != 1:
        raise NotImplementedError("lockstep's rms_norm normalizes over the last dimension only")
    return rms_norm_with_rstd(x, weight, eps)


def _register() -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    overrides = {
        "mm": _mm,
        "addmm": _addmm,
        "bmm": _bmm,
        "mv": _mv,
        "_softmax": _softmax,
        "_log_softmax": _log_softmax,
        "mean.dim": _mean,
    }
    if hasattr(torch.ops.aten, "_fused_rms_norm"):
        overrides["_fused_rms_norm"] = _fused_rms_norm
    with warnings.catch_warnings():
        # torch warns that each registration overrides its own kernel: that is the point.
        warnings.simplefilter("ignore", UserWarning)
        for name, fn in overrides.items():
            for key in ("CPU", "CUDA"):
                library.impl(name, fn, key)
    return library


def is_batch_invariant_mode_enabled() -> bool:
    """Whether aten ops are currently routed to lockstep's batch-invariant ops."""
    return _library is not None


def _set(enabled: bool) -> None:
    global _library
    with _lock:
        if enabled and _library is None:
            _library = _register()
        elif not enabled and _library is not None:
            _library._destroy()
            _library = None


def enable_batch_invariant_mode() -> None:
    """Route aten matmul/softmax/mean/rms_norm ops to lockstep until ``disable_batch_invariant_mode()``."""
    _set(True)


def disable_batch_invariant_mode() -> None:
    """Restore torch's own kernels."""
    _set(False)


@contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Run the block with the mode ``enabled`` (or disabled), then restore whatever state came before.

    Nests: ``with batch_invariant_mode(): with batch_invariant_mode(False): ...`` turns it off for the inner
    block only. The previous state is restored even when the block raises.
    """
    previous = is_batch_invariant_mode_enabled()
    _set(enabled)
    try:
        yield
    finally:
        _set(previous)
