"""Helpers shared by the op files: the CPU row-tiling scheme, Triton interpreter detection, dependent launches.

CPU libraries (MKL, oneDNN, torch's own reductions) pick their algorithm from the problem shape, so a row's
bits change with the number of rows. Calling them only on fixed-shape tiles of ``ROW_TILE`` rows, zero-padding
the last tile, removes the shape from the decision: every row sees the same call whatever its batch.
"""

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# ATen splits an elementwise op or a lone row's reduction across threads only at this many elements
# (at::internal::GRAIN_SIZE); some transcendental ops (exp) split earlier.
ATEN_GRAIN = 32768

# The dtypes lockstep's kernels compute (fp32 accumulation in every case).
FLOATS = (torch.float32, torch.bfloat16, torch.float16)

# Rows per CPU matmul call. Measured on the 2-core CPU machines with oneDNN and packed weights, SmolLM2-135M's
# 30 layers + LM head (bench/cpu_decode.py's model): one decode step's matmuls took 39 / 51 / 33 / 42 / 64 ms at
# 1 / 2 / 4 / 8 / 16 rows a call (torch's own M=1 F.linear: 48 ms), a 256-row prefill 11.3 / 5.8 / 3.5 / 2.7 /
# 2.4 ms a row (F.linear at M=256: 2.7). 4 keeps decode fastest at a modest prefill cost.
ROW_TILE = 4


@functools.cache
def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``).

    Read once: ``triton.jit`` decides at decoration (import) time whether a kernel is interpreted, so the variable
    cannot change the answer later anyway, and reading ``os.environ`` costs ~3 us a launch on the host.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Host-side integer helpers for launch grids and block sizes. ``triton.cdiv`` and ``triton.next_power_of_2`` are
# constexpr functions in recent Triton, whose host call wraps and unwraps its arguments: ~6 us each on the CPU
# machines, several per launch. These return the same integers.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` for ``n >= 1`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# Programmatic dependent launch (Hopper and newer): a kernel launched with ``launch_pdl=True`` may start while the
# kernel before it in the stream finishes, and waits (``griddepcontrol.wait``) for it to complete and its writes to
# be visible before touching memory: the launch latency and the new grid's set-up overlap the old grid's tail. Launch
# order only, so the bits cannot change. Every kernel that takes part waits first thing, so a kernel also sees the
# writes of every kernel before its predecessor. On where the GPU has it; LOCKSTEP_PDL=0 turns it off (read at each
# launch, so at a CUDA graph's capture). Measured on the H200 (bench/decode_step.py, Qwen3-8B shape, async): batch-1
# decode step 5.05 -> 4.77 ms, batch 128 8.07 -> 7.83, batch 256 12.20 -> 12.01, the same tokens and logprob bits.
PDL_ENV = "LOCKSTEP_PDL"


@functools.cache
def _cuda_properties(index: int):
    return torch.cuda.get_device_properties(index)


def _properties(device: torch.device):
    return _cuda_properties(device.index if device.index is not None else torch.cuda.current_device())


def num_sms(device: torch.device) -> int:
    """The multiprocessors of a CUDA device, the width of a grid that fills it (4 elsewhere: the interpreter's)."""
    return _properties(device).multi_processor_count if device.type == "cuda" else 4


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels working on ``t`` launch as programmatic dependents (see ``PDL_ENV``)."""
    if not t.is_cuda or interpreting() or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return _properties(t.device).major >= 9


def pdl_launch(t: torch.Tensor) -> dict:
    """The launch arguments of a kernel that starts with ``pdl_wait(USE_PDL)``, for work on ``t``."""
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl(t) else {"USE_PDL": False}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """A kernel's first step under ``use_pdl``: wait for the previous grid, then let the next one launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """Run the block on ``n`` intra-op threads (``None``: as it is), then restore the previous count.

    For runs of small calls: each parallel region wakes the OpenMP workers, which costs more than such a call's
    work (tens of microseconds with OMP_WAIT_POLICY=PASSIVE, or once the workers sleep). Only for ops whose bits
    do not depend on the thread count.
    """
    previous = torch.get_num_threads()
    if n is None or n == previous:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def map_row_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """Apply ``fn`` to fixed ``[tile, ...]`` blocks of the rows of ``x`` and concatenate the results.

    ``fn`` must map ``[tile, *rest]`` to ``[tile, *out_rest]`` row by row. The last block is zero-padded to
    ``tile`` rows, so ``fn`` only ever sees one shape and one memory layout.
    """
    # x: [M, *rest]
    m = x.shape[0]
    if m < tile:  # one padded block (a decode step's usual case): the zero rows in one call
        return fn(F.pad(x, (0, 0) * (x.dim() - 1) + (0, tile - m)))[:m]
    x = x.contiguous()
    full = m - m % tile
    parts = [fn(x[i : i + tile]) for i in range(0, full, tile)]
    if m > full:
        pad = x.new_zeros((tile, *x.shape[1:]))
        pad[: m - full] = x[full:]
        parts.append(fn(pad)[: m - full])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def cast_for_reduction(x: torch.Tensor, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.dtype]:
    """torch's ``dtype=`` rule for reductions: cast the input first. Returns the input and the output dtype.

    An fp32 ``dtype`` needs no cast: the kernels accumulate in fp32 whatever they load.
    """
    if dtype is not None and dtype != torch.float32:
        x = x.to(dtype)
    if x.dtype not in FLOATS or (dtype is not None and dtype not in FLOATS):
        raise TypeError(f"expected a float32/bfloat16/float16 tensor, got {x.dtype} (dtype={dtype})")
    return x, dtype or x.dtype
