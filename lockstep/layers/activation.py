"""SiLU-and-mul, the gated MLP's activation: ``silu(gate) * up`` on ``gate_up: [num_tokens, 2 * intermediate]``.

An elementwise op, yet not automatically batch-invariant on the CPU: ATen's vectorized loops compute the last
few elements of each chunk they are handed with the scalar ``std::exp``, the rest with the SIMD ``exp``, and the
two differ in the last bit of fp32 ``silu`` for some inputs. Chunk boundaries follow the tensor's size and the
thread split, so an element's bits would follow the batch. ``silu_and_mul`` therefore only ever calls ATen on
contiguous tiles of at most ``rows`` rows whose width is padded to a SIMD multiple and whose size stays under the
threading grain, so that every element takes the SIMD path (see ``_cpu_tile``). On CUDA each element runs the
same instruction sequence wherever it sits: one Triton pass (``ops.gated``) with torch's bits.
"""

import torch
import torch.nn.functional as F

from lockstep.ops import gated
from lockstep.ops._common import ATEN_GRAIN

# A multiple of every SIMD step (2 vectors of up to 16 fp32 lanes), so a whole row never leaves a scalar tail.
_SIMD_STEP = 64


def _cpu_tile(width: int) -> tuple[int, int]:
    """(most rows, padded width) of the tiles the CPU path calls ATen on. Any number of rows up to the most gives a
    tile of a whole number of SIMD steps, under the grain: one thread, no scalar tail."""
    padded = -(-width // _SIMD_STEP) * _SIMD_STEP
    rows = ATEN_GRAIN // padded
    if rows == 0:
        # One row is already split across threads; every call then has the same shape, hence the same split,
        # relative to the row, so a row's bits still cannot depend on its neighbours.
        return 1, width
    return rows, padded


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Batch-invariant ``silu(gate) * up``: ``gate_up: [num_tokens, 2 * I]`` -> ``[num_tokens, I]``."""
    if gate_up.is_cuda:
        return gated.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    # gate: [num_tokens, I] -> [n <= rows, padded] tiles, zero-padded columns; silu(0) = 0 is harmless and cut off.
    num_tokens, width = gate.shape
    rows, padded = _cpu_tile(width)
    out = torch.empty_like(gate)
    for start in range(0, num_tokens, rows):
        n = min(rows, num_tokens - start)
        if padded == width:
            tile = gate[start : start + n].contiguous()
        else:
            tile = gate.new_zeros((n, padded))
            tile[:, :width] = gate[start : start + n]
        out[start : start + n] = F.silu(tile)[:, :width]
    # The product is one correctly rounded multiply per element: the same bits on every code path.
    return out.mul_(up)
