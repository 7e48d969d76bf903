"""A linear whose bits do not depend on how many ranks share its reduction: the chunk tree over K.

A row-parallel layer (o_proj, down_proj under tensor parallelism) splits K across ranks, and the usual all-reduce
of the ranks' partial sums adds them in an order that follows the rank count and the message size. Here the order
is fixed by K alone:

- K is cut into ``CHUNKS = 8`` equal chunks (8 is the largest TP size supported). A K that 8 does not divide is
  zero-padded to ``8 * ceil(K / 8)``: the padding is zero columns of x and of the weight, so a chunk's partial is
  a sum with exact zeros appended, and the padding is part of the numerics whatever the TP size.
- Each chunk's partial ``x[:, chunk] @ weight[:, chunk].T`` is the batch-invariant matmul's sequential-K loop,
  kept in fp32 (``ops.matmul``'s ``out_dtype=torch.float32``: the accumulator itself, unrounded).
- The 8 partials meet in one pairwise tree, level by level: ``((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))``.
- The bias is added to the fp32 total and the result rounded to the model dtype once.

Rank r of N (N in 1, 2, 4, 8) owns chunks ``[r * 8 / N, (r + 1) * 8 / N)``, a whole subtree: ``subtree`` reduces
it, the ranks all-gather their fp32 subtree roots, and ``tree_reduce`` over the N roots performs the tree's upper
levels, the same additions in the same order. ``tree_linear`` is the single-process form (all 8 chunks).

Nothing here communicates: the caller (``layers.linear.RowParallelLinear``) does the all-gather.

On CUDA the tree, the bias and the rounding are one kernel (``tree_finish``): a decode step's tree linear is then
two launches (the chunk partials, the tree) instead of five.
"""

import torch
import triton
import triton.language as tl

from lockstep.ops._common import FLOATS
from lockstep.ops.matmul import _bmm_triton, _mm_cpu

# The number of K chunks of every tree reduction: a numerics constant (changing it changes the bits), and the
# largest tensor-parallel size the tree supports.
CHUNKS = 8


def chunk_width(k: int) -> int:
    """Columns per chunk for a reduction of length ``k`` (the last chunks are zero-padded when 8 does not divide
    ``k``)."""
    return -(-k // CHUNKS)


def subtree(x: torch.Tensor, weight: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """The fp32 root of the subtree over ``num_chunks`` consecutive K chunks: ``x: [M, K]``, ``weight: [N, K]``
    -> ``[M, N]`` fp32, where the chunks are ``K / num_chunks`` wide (K zero-padded to a multiple of
    ``num_chunks`` when needed). ``num_chunks`` is 8 in one process, ``8 / N`` on each of N ranks."""
    return tree_reduce(chunk_partials(x, weight, num_chunks))


def chunk_partials(x: torch.Tensor, weight: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """The fp32 partial of each chunk, unreduced: ``[num_chunks, M, N]``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x: [M, K] and weight: [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in FLOATS:
        raise TypeError(f"expected matching float32/bfloat16/float16 operands, got {x.dtype} and {weight.dtype}")
    if num_chunks not in (1, 2, 4, 8):
        raise ValueError(f"num_chunks must be 1, 2, 4 or 8, got {num_chunks}")
    (m, k), n = x.shape, weight.shape[0]
    width = -(-k // num_chunks)
    if width * num_chunks != k:
        # Zero columns: each chunk's sum gains exact zeros at its end.
        x = torch.nn.functional.pad(x, (0, width * num_chunks - k))
        weight = torch.nn.functional.pad(weight, (0, width * num_chunks - k))
    # x: [M, C * w] -> [C, M, w]; weight: [N, C * w] -> [C, w, N]
    x_chunks = x.view(m, num_chunks, width).transpose(0, 1)
    w_chunks = weight.view(n, num_chunks, width).permute(1, 2, 0)
    if x.is_cuda:
        return _bmm_triton(x_chunks, w_chunks, out_dtype=torch.float32)
    out = torch.empty((num_chunks, m, n), dtype=torch.float32, device=x.device)
    for c in range(num_chunks):
        # The CPU matmul sees one canonical weight layout (a contiguous fp32 [N, w]) on every rank count, so
        # the weight's row stride (K or K / N) cannot steer its algorithm.
        w = w_chunks[c].t().contiguous().float()
        out[c] = _mm_cpu(x_chunks[c], w, None, 1.0, 1.0, out_dtype=torch.float32)
    return out


def tree_reduce(partials: torch.Tensor) -> torch.Tensor:
    """Pairwise sum of ``[L, M, N]`` fp32 partials (L 1, 2, 4 or 8), level by level: ``p[2i] + p[2i + 1]``
    until one is left. Applied to a rank's chunks and then to the ranks' roots, it is one tree over all chunks."""
    return tree_finish(partials, None, torch.float32)


def finish(total: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The tree's fp32 root ``[M, N]`` plus ``bias: [N]`` (in fp32), rounded once to ``dtype``."""
    if bias is not None:
        total = total + bias.float()
    return total.to(dtype)


def tree_finish(partials: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``finish(tree_reduce(partials), bias, dtype)``: ``[L, M, N]`` fp32 -> ``[M, N]`` in ``dtype``. On CUDA one
    kernel doing the same additions in the same order, then the same rounding."""
    if partials.dtype != torch.float32:
        raise TypeError(f"tree partials must be float32, got {partials.dtype}")
    length = partials.shape[0]
    if length not in (1, 2, 4, 8):
        raise ValueError(f"the tree takes 1, 2, 4 or 8 partials, got {length}")
    if partials.is_cuda:
        return _tree_finish_triton(partials, bias, dtype)
    while partials.shape[0] > 1:
        partials = partials[0::2] + partials[1::2]
    return finish(partials[0], bias, dtype)


@triton.jit
def _tree_finish_kernel(
    p_ptr, bias_ptr, out_ptr, numel, n, L: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    # Elementwise over the M x N root: the L partials of an element meet in the pairwise tree, then the bias.
    # Partial i starts i * numel elements in, reached by adding numel to the pointer (never an i * numel product,
    # which could pass 2^31).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    ptrs = p_ptr + offs
    total = tl.load(ptrs, mask=mask, other=0.0)
    if L >= 2:
        ptrs += numel
        total = total + tl.load(ptrs, mask=mask, other=0.0)
    if L >= 4:
        p2 = tl.load(ptrs + numel, mask=mask, other=0.0)
        p3 = tl.load(ptrs + numel + numel, mask=mask, other=0.0)
        ptrs += numel + numel
        total = total + (p2 + p3)
    if L >= 8:
        p4 = tl.load(ptrs + numel, mask=mask, other=0.0)
        p5 = tl.load(ptrs + numel + numel, mask=mask, other=0.0)
        ptrs += numel + numel
        p6 = tl.load(ptrs + numel, mask=mask, other=0.0)
        p7 = tl.load(ptrs + numel + numel, mask=mask, other=0.0)
        total = total + ((p4 + p5) + (p6 + p7))
    if HAS_BIAS:
        total = total + tl.load(bias_ptr + offs % n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def _tree_finish_triton(partials: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    partials = partials.contiguous()
    length, m, n = partials.shape
    out = torch.empty((m, n), device=partials.device, dtype=dtype)
    numel = m * n
    if numel == 0:
        return out
    block = 1024
    _tree_finish_kernel[(triton.cdiv(numel, block),)](
        partials, bias if bias is not None else partials, out, numel, n,
        L=length, HAS_BIAS=bias is not None, BLOCK=block,
    )  # fmt: skip
    return out


def tree_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with the chunk-tree reduction, in one process: ``x: [..., K]``, ``weight: [N, K]``,
    ``bias: [N]`` -> ``[..., N]`` in x's dtype. Bit for bit what N ranks holding 8 / N chunks each compute."""
    lead = x.shape[:-1]
    partials = chunk_partials(x.reshape(-1, x.shape[-1]), weight, CHUNKS)
    return tree_finish(partials, bias, x.dtype).reshape(*lead, weight.shape[0])
