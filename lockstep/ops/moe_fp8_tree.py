"""FP8 experts under tensor parallelism: each routed pair's down projection through ``ops.fp8_tree``'s chunk tree
over I, so a pair's output has the same bits at every TP size (``down_roots_fp8``, a rank's subtree roots;
``experts_fp8_tree``, the whole tree in one process).

Every expert is split along I as the bf16 experts are (``ops.moe.down_roots``): a rank holds ``w13: [E, 2I', H]``
(its I' = I / N rows of each gate and up projection, with their row scales) and ``w2: [E, H, I']`` (those columns
of each down projection, with the scales of the K blocks they touch). The gate/up matmul is ``ops.moe_fp8``'s (a
column's bits do not depend on how many columns a rank holds). The activations between the two matmuls are
quantized with the whole row's scales, from the ranks' all-gathered maxima where a rank holds part of them: per
token always (one scale over all of I); per 128-column group where a rank's columns cut a group (Qwen3-30B-A3B's
I = 768: 192 columns a rank at TP 4, 96 at TP 8), both ranks then quantizing with the group's one scale
(``moe_fp8.quantize_act``). The down projection's I' is cut into the rank's ``8 / N`` chunks of the whole I's 8 (the
same chunk width at every N); each chunk's partial is the FP8 block order over its columns, in fp32 (a chunk that
cuts a 128-column scale block, as I = 768 in chunks of 96 does, sums its pieces of one block each in column order,
cut at the whole I's block edges: ``fp8_tree.chunk_pieces``, the same pieces at every N), and the chunks meet in
``tp_linear``'s pairwise tree.
"""

import torch

from lockstep.ops import fp8_tree, tp_linear
from lockstep.ops.moe import combine, expert_weight, plan_routing
from lockstep.ops.moe_fp8 import _configs, _grouped_fp8_mm, gate_up, quantize_act, quantize_rows


def _down_partials(h8, hs, w2, s2, plan, cfg, num_chunks: int, triton: bool, col0: int) -> torch.Tensor:
    # h8: [P, I'] e4m3 (sorted rows) with hs [P, KBa]; w2: [E, H, I'] e4m3 with s2 [E, H, KBw]; I' is columns
    # [col0, col0 + I') of the whole I -> [C, P, H] fp32
    num_pairs, hidden = h8.shape[0], w2.shape[1]
    if not triton:
        partials = torch.zeros((num_chunks, num_pairs, hidden), dtype=torch.float32)
        bounds = plan.bounds.tolist()
        for e in range(w2.shape[0]):
            start, end = bounds[e], bounds[e + 1]
            if end > start:
                partials[:, start:end] = fp8_tree.chunk_partials(
                    h8[start:end], hs[start:end], expert_weight(w2, e), s2[e], num_chunks, col0
                )
        return partials
    # The grouped kernel over each chunk's columns (its pieces, where the chunk cuts scale blocks: chunk_pieces).
    partials = torch.empty((num_chunks, num_pairs, hidden), dtype=torch.float32, device=h8.device)
    blocked = hs.shape[1] > 1 or s2.shape[2] > 1
    for c, chunk in enumerate(fp8_tree.chunk_pieces(h8.shape[1], num_chunks, blocked, col0)):
        for i, (a, b) in enumerate(chunk):
            blocks = fp8_tree.piece_blocks(a, b, col0)
            sa = hs[:, blocks] if hs.shape[1] > 1 else hs
            sw = s2[:, :, blocks] if s2.shape[2] > 1 else s2
            part = _grouped_fp8_mm(h8[:, a:b], sa, None, w2[:, :, a:b], sw, plan, cfg, False, torch.float32)
            partials[c] = part if i == 0 else partials[c] + part
    return partials


def down_roots_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    ids: torch.Tensor,
    act_group: int | None,
    num_chunks: int,
    amax_gather=None,
    triton: bool | None = None,
    columns: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every routed pair's FP8 down projection as the fp32 root of a subtree of the chunk tree over I.

    ``x: [n, H]``; ``w13: [E, 2I', H]``, ``w2: [E, H, I']`` e4m3 with row scales ``s13``, ``s2`` (a rank's I' of
    every expert); ``ids: [n, k]``; ``num_chunks``: ``8 / N`` on each of N ranks -> ``(roots fp32 [P, H] in
    sorted-row order, rows int64 [n, k])`` as ``ops.moe.down_roots``. ``columns = (start, I)``: which of the whole
    I this rank's I' are (default: all of them), its scales ``s2`` those of the K blocks they touch, the first and
    last maybe cut; ``amax_gather`` (N > 1): every rank's activation maxima from this rank's (per token, or per
    group where the rank's columns cut a group); ``triton``: the grouped kernel (default: on CUDA). The ranks'
    roots all-gathered in rank order through ``tp_linear.tree_reduce`` are the one-process roots bit for bit."""
    num_experts, two_i, hidden = w13.shape
    if num_chunks not in (1, 2, 4, 8) or (two_i // 2) % num_chunks:
        raise ValueError(f"I'={two_i // 2} does not split into {num_chunks} chunks")
    cfg1 = _configs(ids.numel(), num_experts, two_i // 2, hidden, x.dtype)[0]
    # The down matmul's tile from the chunk width, the same at every TP size.
    cfg2 = _configs(ids.numel(), num_experts, two_i // 2 // num_chunks, hidden, x.dtype)[1]
    triton = x.is_cuda if triton is None else triton
    plan = plan_routing(ids, num_experts, cfg1.bm if triton else None)
    x8, xs = quantize_rows(x, act_group)
    act = gate_up(x8, xs, w13, s13, plan, cfg1, x.dtype, triton)  # [P, I'], sorted rows
    h8, hs = quantize_act(act, act_group, amax_gather or (lambda amax: amax), columns)
    start = columns[0] if columns else 0
    partials = _down_partials(h8, hs, w2, s2, plan, cfg2, num_chunks, triton, start)
    return tp_linear.tree_reduce(partials), plan.rows.view(ids.shape)


def experts_fp8_tree(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act_group: int | None,
) -> torch.Tensor:
    """``ops.moe_fp8.experts_fp8`` with each pair's down projection through the whole chunk tree, rounded to x's
    dtype, then combined in rank order: the bits N ranks holding I / N of every expert compute. ``[n, H]``."""
    roots, rows = down_roots_fp8(x, w13, s13, w2, s2, ids, act_group, tp_linear.CHUNKS)
    return combine(roots.to(x.dtype), weights.float(), rows)
