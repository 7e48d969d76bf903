"""The routing plan: (token, expert) pairs sorted by expert, and the table of row tiles the grouped matmul walks
(Triton on CUDA up to ``FUSED_PLAN_MAX_PAIRS`` pairs, torch ops otherwise; integer arithmetic, the same on both)."""

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class RoutingPlan:
    """Where each (token, rank) pair goes, built on the device with no host sync.

    Pair ``p = t * k + j`` is token ``t``'s ``j``-th expert. ``order[r]`` is the pair at sorted row ``r`` (pairs
    sorted by expert id, stably: within an expert, in pair order); ``tokens[r] = order[r] // k``; ``rows[p]`` is
    the sorted row of pair ``p`` (the inverse of ``order``). ``bounds[e]:bounds[e + 1]`` are expert ``e``'s rows.
    ``tiles``, when the plan was built for a row-tile height (``tile_rows``), is ``tile_table``'s answer for it.
    """

    order: torch.Tensor  # [P] int64
    tokens: torch.Tensor  # [P] int64
    rows: torch.Tensor  # [P] int64
    bounds: torch.Tensor  # [E + 1] int64
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (expert, start, end) int32
    tile_rows: int = 0


def _num_tile_slots(num_pairs: int, num_experts: int, bm: int) -> int:
    # Each non-empty expert adds at most one partial tile to the ceil(P / bm) full ones.
    return triton.cdiv(num_pairs, bm) + min(num_experts, num_pairs)


def plan_routing_torch(ids: torch.Tensor, num_experts: int) -> RoutingPlan:
    """``plan_routing`` in torch ops (a stable argsort, ``searchsorted``): the CPU path and the tests' reference."""
    num_tokens, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=ids.device)
    bounds = torch.searchsorted(flat[order], torch.arange(num_experts + 1, device=ids.device))
    return RoutingPlan(order=order, tokens=order // k, rows=rows, bounds=bounds)


def tile_table_torch(
    bounds: torch.Tensor, num_pairs: int, num_experts: int, bm: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tile_table`` in torch ops, from the plan's ``bounds``: the CPU path and the tests' reference."""
    counts = bounds[1:] - bounds[:-1]  # [E]
    tiles_per = (counts + bm - 1) // bm
    last = torch.cumsum(tiles_per, 0)  # one past each expert's last tile
    slot = torch.arange(_num_tile_slots(num_pairs, num_experts, bm), device=bounds.device)
    expert = torch.searchsorted(last, slot, right=True)  # [num_slots], num_experts past the end
    e = expert.clamp(max=num_experts - 1)
    start = bounds[e] + (slot - (last[e] - tiles_per[e])) * bm
    return expert.to(torch.int32), start.to(torch.int32), bounds[e + 1].to(torch.int32)


# The fused plan: pairs are taken BLOCK_P at a time, experts all at once (a [BLOCK_P, BLOCK_E] one-hot), tile
# slots BLOCK_S at a time.
_PLAN_BLOCK_P = 64
_PLAN_BLOCK_S = 64


@triton.jit
def _plan_count_kernel(ids_ptr, bounds_ptr, block_base_ptr, P, E, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    # One program: how many pairs each expert gets (bounds, the exclusive prefix sum), and for every block of
    # BLOCK_P pairs how many pairs of each expert came in the blocks before it (block_base[b, e]).
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    seen = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for b in range(0, tl.cdiv(P, BLOCK_P)):
        offs = b * BLOCK_P + tl.arange(0, BLOCK_P)
        e = tl.load(ids_ptr + offs, mask=offs < P, other=-1)  # -1 matches no expert
        tl.store(block_base_ptr + b * E + cols, seen, mask=col_ok)
        seen += tl.sum((e[:, None] == cols[None, :]).to(tl.int32), axis=0)
    tl.store(bounds_ptr + cols, (tl.cumsum(seen, 0) - seen).to(tl.int64), mask=col_ok)
    # bounds[E] = P, through a masked vector store (P may arrive as a constexpr 1, which has no .to()).
    tl.store(bounds_ptr + E + cols, tl.zeros((BLOCK_E,), dtype=tl.int64) + P, mask=cols == 0)


@triton.jit
def _plan_place_kernel(
    ids_ptr, bounds_ptr, block_base_ptr, order_ptr, tokens_ptr, rows_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    P, E, num_place_blocks, num_slots, bm,
    TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # Programs [0, num_place_blocks): BLOCK_P pairs each, placed at their sorted rows. A pair of expert e lands at
    # bounds[e] + (e's pairs in earlier blocks) + (e's pairs before it in this block): a stable counting sort.
    # The programs after them: BLOCK_S slots of the tile table each.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    lo = tl.load(bounds_ptr + cols, mask=col_ok, other=0)  # [BLOCK_E] int64
    if pid < num_place_blocks:
        offs = pid * BLOCK_P + tl.arange(0, BLOCK_P)
        valid = offs < P
        e = tl.load(ids_ptr + offs, mask=valid, other=-1)
        # int32 in the [BLOCK_P, BLOCK_E] arithmetic (rows < P < 2**31), int64 for addresses and the plan.
        hot = (e[:, None] == cols[None, :]).to(tl.int32)  # [BLOCK_P, BLOCK_E]
        rank = tl.cumsum(hot, 0)  # 1 + the pairs of the same expert before this one in the block
        base = (lo + tl.load(block_base_ptr + pid * E + cols, mask=col_ok, other=0)).to(tl.int32)
        row = tl.sum(hot * (base[None, :] + rank - 1), axis=1).to(tl.int64)  # [BLOCK_P]
        pair = offs.to(tl.int64)
        tl.store(order_ptr + row, pair, mask=valid)
        tl.store(tokens_ptr + row, pair // TOP_K, mask=valid)
        tl.store(rows_ptr + offs, row, mask=valid)
    else:
        # Tiles: expert e owns ceil(count_e / bm) consecutive slots ending before last[e]; a slot belongs to the
        # first expert whose last exceeds it (num_experts past the real tiles), as tile_table_torch's searchsorted.
        hi = tl.load(bounds_ptr + 1 + cols, mask=col_ok, other=0)
        tiles_per = (hi - lo + bm - 1) // bm
        last = tl.cumsum(tiles_per, 0)
        slot = (pid - num_place_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)
        expert = tl.sum(((last[None, :] <= slot[:, None]) & col_ok[None, :]).to(tl.int32), axis=1)  # [BLOCK_S]
        pick = cols[None, :] == tl.minimum(expert, E - 1)[:, None]  # [BLOCK_S, BLOCK_E]: the clamped expert
        first = tl.sum(tl.where(pick, last - tiles_per, 0), axis=1)
        start = tl.sum(tl.where(pick, lo, 0), axis=1) + (slot - first) * bm
        end = tl.sum(tl.where(pick, hi, 0), axis=1)
        in_table = slot < num_slots
        tl.store(tile_expert_ptr + slot, expert, mask=in_table)
        tl.store(tile_start_ptr + slot, start.to(tl.int32), mask=in_table)
        tl.store(tile_end_ptr + slot, end.to(tl.int32), mask=in_table)


def _launch_place(ids_flat, bounds, block_base, outs, num_pairs, num_experts, top_k, bm, place: bool) -> None:
    # outs: (order, tokens, rows, tile_expert, tile_start, tile_end); place=False fills only the tile table.
    num_place = triton.cdiv(num_pairs, _PLAN_BLOCK_P) if place else 0
    num_slots = outs[3].numel()
    grid = (num_place + triton.cdiv(num_slots, _PLAN_BLOCK_S),)
    _plan_place_kernel[grid](
        ids_flat, bounds, block_base, *outs, num_pairs, num_experts, num_place, num_slots, bm,
        TOP_K=top_k, BLOCK_P=_PLAN_BLOCK_P, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_S=_PLAN_BLOCK_S,
    )  # fmt: skip


def _tile_outputs(num_pairs: int, num_experts: int, bm: int, device) -> tuple[torch.Tensor, ...]:
    num_slots = _num_tile_slots(num_pairs, num_experts, bm)
    return tuple(torch.empty(num_slots, device=device, dtype=torch.int32) for _ in range(3))


def plan_routing_triton(ids: torch.Tensor, num_experts: int, bm: int) -> RoutingPlan:
    """``plan_routing`` in two Triton launches with grids sized from shapes (no host sync, capturable), the tile
    table for ``bm``-row tiles included. Integer arithmetic: the same plan as ``plan_routing_torch``."""
    num_tokens, top_k = ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        plan = plan_routing_torch(ids, num_experts)
        return replace(plan, tiles=tile_table_torch(plan.bounds, 0, num_experts, bm), tile_rows=bm)
    device = ids.device
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    bounds = torch.empty(num_experts + 1, device=device, dtype=torch.int64)
    block_base = torch.empty((triton.cdiv(num_pairs, _PLAN_BLOCK_P), num_experts), device=device, dtype=torch.int32)
    _plan_count_kernel[(1,)](
        flat, bounds, block_base, num_pairs, num_experts,
        BLOCK_P=_PLAN_BLOCK_P, BLOCK_E=triton.next_power_of_2(num_experts),
    )  # fmt: skip
    order, tokens, rows = (torch.empty(num_pairs, device=device, dtype=torch.int64) for _ in range(3))
    tiles = _tile_outputs(num_pairs, num_experts, bm, device)
    _launch_place(flat, bounds, block_base, (order, tokens, rows, *tiles), num_pairs, num_experts, top_k, bm, True)
    return RoutingPlan(order=order, tokens=tokens, rows=rows, bounds=bounds, tiles=tiles, tile_rows=bm)


# Above this many pairs the fused plan's one counting program (P x E one-hot sums, serially) would cost more than
# the torch plan's fixed ~15 launches, which then matter little next to the matmuls: the torch plan is used there
# (the same plan; only its speed differs). bench/moe.py times both at every size.
FUSED_PLAN_MAX_PAIRS = 16384


def plan_routing(ids: torch.Tensor, num_experts: int, bm: int | None = None) -> RoutingPlan:
    """The sorted layout of ``ids: [num_tokens, k]`` (int64 expert ids in ``[0, num_experts)``), with the tile
    table for ``bm``-row tiles when ``bm`` is given.

    CUDA up to ``FUSED_PLAN_MAX_PAIRS`` pairs: two Triton launches (``plan_routing_triton``); the CPU, and CUDA
    above that size: torch ops (``plan_routing_torch``). The plan is integer arithmetic: the same on every path.
    """
    if ids.is_cuda and ids.numel() <= FUSED_PLAN_MAX_PAIRS:
        return plan_routing_triton(ids, num_experts, bm or 16)
    plan = plan_routing_torch(ids, num_experts)
    if bm is None:
        return plan
    return replace(plan, tiles=tile_table(plan, num_experts, bm), tile_rows=bm)


def tile_table_triton(
    bounds: torch.Tensor, num_pairs: int, num_experts: int, bm: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tile_table`` from the plan's ``bounds`` in one Triton launch (the tile programs of the placing kernel)."""
    tiles = _tile_outputs(num_pairs, num_experts, bm, bounds.device)
    if num_pairs:
        unused = bounds  # no placing program runs: any tensor will do for their arguments
        _launch_place(unused, bounds, unused, (unused, unused, unused, *tiles), num_pairs, num_experts, 1, bm, False)
    return tiles


def tile_table(plan: RoutingPlan, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row tiles of at most ``bm`` rows, none spanning two experts: ``(expert, start, end)`` per tile, int32.

    The table has a length fixed by shapes: ``ceil(P / bm) + min(E, P)`` bounds the number of tiles (each
    non-empty expert adds at most one partial tile). Entries past the last tile have ``expert == num_experts``.
    The plan's own table when it was built for ``bm``; else one Triton launch on CUDA (torch ops on the CPU).
    """
    if plan.tiles is not None and plan.tile_rows == bm:
        return plan.tiles
    if plan.bounds.is_cuda:
        return tile_table_triton(plan.bounds, plan.order.numel(), num_experts, bm)
    return tile_table_torch(plan.bounds, plan.order.numel(), num_experts, bm)
