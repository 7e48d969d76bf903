"""The chunk tree over an FP8 linear: a row-parallel FP8 layer (o_proj, down_proj) whose bits do not depend on the
number of ranks that share its K.

``ops.tp_linear`` fixes the order of a row-parallel bf16 sum by cutting K into ``CHUNKS = 8`` chunks that meet in
one pairwise tree; here the same tree runs over FP8 partials:

- Each chunk's partial is ``ops.fp8``'s scaled matmul over the chunk's columns alone, kept in fp32: its K blocks of
  ``GROUP_K`` columns summed from zero, each scaled by ``x_scale * w_scale`` as it ends, in block order. Block
  scales (a checkpoint's 128 x 128 tiles, activations per 128-column group) need every chunk to be whole blocks,
  ``K / 8`` a multiple of ``GROUP_K``: ``check_tree`` refuses the others, naming the layer, rather than let a
  block's scale straddle two ranks. Per-channel or per-tensor weight scales with per-token activations have no
  such bound (a chunk's blocks then start at the chunk, whatever its width); K must still be a multiple of 8.
- The activations' scales are those of the whole row: per 128-column group they are local to a chunk already;
  per token (one scale over all of K) each rank takes the max of its columns' ``|x|`` and the ranks' maxima meet in
  an all-gather (``activation_scales``; a max is exact in any order), so every rank quantizes with the scale one
  process would use.
- The 8 roots meet in ``tp_linear.tree_reduce``'s tree, the bias is added in fp32, and the total is rounded once.

Rank r of N owns chunks ``[8r / N, 8(r + 1) / N)``; ``subtree`` reduces them, the caller all-gathers the fp32
roots and finishes the tree (``layers.linear.RowParallelLinear``). ``tree_linear`` is the single-process form.
Nothing here communicates but ``activation_scales``, which takes the gathered maxima from its caller.
"""

import torch

from lockstep.ops import fp8
from lockstep.ops.tp_linear import CHUNKS, tree_finish, tree_reduce


def check_tree(name: str, k: int, blocked: bool) -> None:
    """Raise ValueError unless a row-parallel FP8 layer ``name`` with a full input size ``k`` can run the chunk
    tree: ``k`` a multiple of 8, and of ``8 * GROUP_K`` when its scales come in ``GROUP_K``-column blocks."""
    if k % CHUNKS:
        raise ValueError(f"{name}: an FP8 chunk tree needs an input size that is a multiple of {CHUNKS}, got {k}")
    if blocked and (k // CHUNKS) % fp8.GROUP_K:
        raise ValueError(
            f"{name}: the FP8 chunk tree cuts K={k} into {CHUNKS} chunks of {k // CHUNKS} columns, which is not a "
            f"whole number of the {fp8.GROUP_K}-column scale blocks (block-scaled weights or per-{fp8.GROUP_K} "
            f"activations need K to be a multiple of {CHUNKS * fp8.GROUP_K}); use tp_invariant=False or a "
            "per-channel FP8 layout"
        )


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """``x: [M, K]`` -> ``[M, 1]`` fp32, the max of ``|x|`` over the row (this rank's columns)."""
    return x.abs().amax(1, keepdim=True).float() if x.shape[1] else x.new_zeros((x.shape[0], 1), dtype=torch.float32)


def group_amax(x: torch.Tensor, group: int, start: int = 0, full: int | None = None) -> torch.Tensor:
    """``x: [M, K']``, columns ``[start, start + K')`` of rows ``full`` wide -> ``[M, cdiv(full, group)]`` fp32, the
    max of ``|x|`` over this rank's columns of each ``group``-column group of the whole row (0 where it holds none).
    A rank whose columns cut a group (Qwen3-30B-A3B's I = 768 at TP 4 and 8) holds part of its max; the ranks'
    maxima meet in an all-gather and a max, exact in any order."""
    m, k = x.shape
    full = start + k if full is None else full
    blocks = -(-full // group)
    padded = x.new_zeros((m, blocks * group), dtype=torch.float32)
    padded[:, start : start + k] = x.float().abs()
    return padded.view(m, blocks, group).amax(2)


def activation_scales(
    x: torch.Tensor, group: int | None, amax: torch.Tensor | None = None, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [M, K]`` -> ``(x8, scale)`` as ``fp8.quantize_rows``, from the whole row's maxima ``amax``: per token
    (``group=None``) ``[M, 1]``, the max of ``|x|`` over every rank's columns (default: ``row_amax(x)``); per group
    ``[M, cdiv(full, group)]`` (``group_amax`` gathered), where ``x`` holds columns ``[start, start + K)`` of the row
    and gets the scales ``[M, KB']`` of the groups it touches (default, no ``amax``: ``fp8.quantize_rows``). The
    same formulas on every device, so one process and N ranks quantize a row to the same bits."""
    if group is not None:
        if amax is None:
            return fp8.quantize_rows(x, group)
        k = x.shape[1]
        first = start // group
        scale = amax[:, first : -(-(start + k) // group)].clamp(min=fp8._AMAX_FLOOR) / fp8.FP8_MAX  # [M, KB']
        cols = scale.repeat_interleave(group, dim=1)[:, start % group : start % group + k]  # [M, K]
        return (x.float() / cols).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8), scale
    amax = row_amax(x) if amax is None else amax
    scale = amax.clamp(min=fp8._AMAX_FLOOR) / fp8.FP8_MAX  # [M, 1]
    return (x.float() / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8), scale


def chunk_pieces(k: int, num_chunks: int, blocked: bool, start: int = 0) -> list[list[tuple[int, int]]]:
    """The column ranges ``(start, stop)`` each of ``num_chunks`` equal chunks of K is computed in: the chunk
    itself, unless its scales come in ``GROUP_K``-column blocks that the chunk cuts (``K / num_chunks`` not a
    multiple of ``GROUP_K``: the FP8 experts' I = 768 of Qwen3-30B-A3B in chunks of 96); then one range per block
    the chunk touches. The K columns are a rank's, columns ``[start, start + K)`` of the whole row: the pieces are
    cut at the whole row's block edges, so every TP size computes the same pieces; the ranges are this rank's."""
    width = k // num_chunks
    if not blocked or (width % fp8.GROUP_K == 0 and start % fp8.GROUP_K == 0):
        return [[(c * width, (c + 1) * width)] for c in range(num_chunks)]
    out = []
    for c in range(num_chunks):
        lo, hi, pieces = start + c * width, start + (c + 1) * width, []
        while lo < hi:
            stop = min(hi, (lo // fp8.GROUP_K + 1) * fp8.GROUP_K)
            pieces.append((lo - start, stop - start))
            lo = stop
        out.append(pieces)
    return out


def piece_blocks(a: int, b: int, start: int = 0) -> slice:
    """The scale blocks ``[KB']`` of a rank holding columns ``[start, ...)`` that its columns ``[a, b)`` read."""
    first = start // fp8.GROUP_K
    return slice((start + a) // fp8.GROUP_K - first, -(-(start + b) // fp8.GROUP_K) - first)


def _column_weights(w8: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> list[torch.Tensor]:
    # Each range's columns. CUDA: strided views (the kernel takes strides; no copy of the weight). CPU: their own
    # contiguous e4m3 tensors, kept on w8 while it is unchanged, so the CPU path's packed blocks (fp8._cpu_blocks)
    # are memoized per range and every rank count sees one layout.
    if w8.is_cuda:
        return [w8[:, a:b] for a, b in ranges]
    try:
        key = (w8._version, w8.data_ptr(), tuple(w8.shape), ranges)
    except RuntimeError:  # an inference tensor: no version counter
        key = None
    memo = getattr(w8, "_lockstep_fp8_chunks", None)
    if key is not None and memo is not None and memo[0] == key:
        return memo[1]
    with torch.inference_mode(False):  # ordinary tensors, which carry a version counter for fp8._cpu_blocks' memo
        chunks = [w8[:, a:b].contiguous() for a, b in ranges]
    if key is not None:
        w8._lockstep_fp8_chunks = (key, chunks)
    return chunks


def chunk_partials(
    a8: torch.Tensor, a_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, num_chunks: int, start: int = 0
) -> torch.Tensor:
    """The fp32 partial of each of ``num_chunks`` equal K chunks, unreduced: ``a8: [M, K]`` e4m3 with
    ``a_scale: [M, KB]``, ``w8: [N, K]`` e4m3 with ``w_scale: [N, KB]`` (KB 1, or cdiv(K, GROUP_K)) -> ``[C, M, N]``.
    A chunk that cuts scale blocks (``chunk_pieces``) is the sum, in column order, of its pieces' partials, each
    one block's scaled matmul. ``start``: the first of the whole row's columns these K are (a rank's, whose scales
    ``[., KB']`` are those of the blocks its columns touch, the first maybe cut)."""
    m, k = a8.shape
    n = w8.shape[0]
    if k % num_chunks:
        raise ValueError(f"K={k} does not split into {num_chunks} chunks")
    blocked = a_scale.shape[1] > 1 or w_scale.shape[1] > 1
    pieces = chunk_pieces(k, num_chunks, blocked, start)
    weights = iter(_column_weights(w8, tuple(r for chunk in pieces for r in chunk)))
    out = torch.empty((num_chunks, m, n), dtype=torch.float32, device=a8.device)
    for c, chunk in enumerate(pieces):
        for i, (a, b) in enumerate(chunk):
            blocks = piece_blocks(a, b, start)
            sa = a_scale[:, blocks] if a_scale.shape[1] > 1 else a_scale
            sw = w_scale[:, blocks] if w_scale.shape[1] > 1 else w_scale
            part = fp8.scaled_mm(a8[:, a:b], sa, next(weights), sw, None, torch.float32)
            out[c] = part if i == 0 else out[c] + part
    return out


def subtree(a8: torch.Tensor, a_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, num_chunks: int):
    """The fp32 root ``[M, N]`` of the subtree over this rank's ``num_chunks`` chunks (8 / N on each of N ranks)."""
    return tree_reduce(chunk_partials(a8, a_scale, w8, w_scale, num_chunks))


def tree_linear(
    x: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_group: int | None = fp8.GROUP_K,
) -> torch.Tensor:
    """``fp8.fp8_linear`` with the chunk-tree reduction, in one process: ``x: [..., K]`` -> ``[..., N]`` in x's
    dtype, bit for bit what N ranks holding 8 / N chunks each compute."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    a8, a_scale = activation_scales(x2, act_group)
    partials = chunk_partials(a8, a_scale, w8, w_scale, CHUNKS)
    return tree_finish(partials, bias, x.dtype).reshape(*lead, w8.shape[0])
