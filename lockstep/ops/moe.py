"""Batch-invariant mixture-of-experts: routing, the grouped expert matmuls, and the combine.

The contract, as for every op here: a token's output bits depend only on the token and the weights.

- ``route``: softmax of the router logits in fp32, then the top k by probability with ties broken by the lowest
  expert id, made explicit (CUDA: one Triton program per token takes k rounds of "the largest, lowest id among
  equals"; CPU: ``ops.softmax``, then each probability packed with its expert id into one unique int64 key, so
  ``torch.topk`` has no ties to break). The top-k weights are renormalised (when the model asks) by a sum taken
  left to right in rank order.
- ``experts``: the (token, expert) pairs are sorted by expert (a stable sort) and each expert's rows multiplied by
  its weights: ``silu(x W_gate) * (x W_up)``, then ``W_down``. A row's value never depends on how many rows share
  its expert: every output element is accumulated over K from k = 0 upward, BK at a time, in one fp32
  accumulator, with a tile chosen from shapes alone (``moe_config``); rows are independent inside a tile.
- the k expert outputs of a token are combined in fp32 in rank order (``_combine``): never atomics, never the
  order of the sort.
No capacity factor: no token is ever dropped (that would make a token depend on its neighbours).

Under tensor parallelism the experts are split along their intermediate dimension I, and each routed pair's down
projection (a reduction over I) goes through the chunk tree of ``ops.tp_linear``: ``down_roots`` gives a rank's
fp32 subtree roots, one row per routed pair, and ``experts_tree`` is the whole tree in one process. A pair's output
then has the same bits at every TP size; it is rounded to the model dtype where ``experts`` rounds it, before the
combine.

CUDA runs Triton kernels throughout: the routing plan and tile table (two launches, ``plan_routing_triton``; the
torch plan past ``FUSED_PLAN_MAX_PAIRS``), a grouped matmul over tiles of sorted rows (twice; the first fuses
silu-and-mul) and the combine. The launch grids are sized from shapes (an upper bound on the number of row
tiles); programs past the last real tile do nothing, so a decode step can be captured in a CUDA graph. The CPU runs
each expert's rows through ``ops.linear`` (fixed row tiles) and the CPU ``silu_and_mul``, both row-invariant.
"""

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from lockstep.layers.activation import silu_and_mul
from lockstep.ops import tp_linear
from lockstep.ops._common import FLOATS, interpreting
from lockstep.ops.matmul import linear
from lockstep.ops.softmax import softmax

__all__ = [
    "MoEConfig", "RoutingPlan", "combine", "down_roots", "experts", "experts_tree", "moe_config", "plan_routing",
    "plan_routing_torch", "plan_routing_triton", "route", "tile_table", "tile_table_torch", "tile_table_triton",
]  # fmt: skip


# --- routing -------------------------------------------------------------------------------------------------


def _check_logits(logits: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [num_tokens, num_experts], got shape {tuple(logits.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, num_experts={logits.shape[1]}], got {top_k}")
    if logits.dtype not in FLOATS:
        raise TypeError(f"router logits must be float32/bfloat16/float16, got {logits.dtype}")


def top_k_lowest_id(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` largest of each row of ``probs: [n, E]`` (fp32, non-negative), in descending order, equal
    values in ascending expert id. Returns ``(values fp32 [n, k], ids int64 [n, k])``.

    A non-negative fp32 orders like its bit pattern read as an integer, so ``bits << 32 | (E - 1 - id)`` is an
    int64 key with the same order whose ties are broken by the lowest id; keys are unique, so any top-k finds the
    same ones in the same order.
    """
    num_experts = probs.shape[1]
    ids = torch.arange(num_experts, device=probs.device, dtype=torch.int64)
    key = (probs.contiguous().view(torch.int32).to(torch.int64) << 32) | (num_experts - 1 - ids)
    top = torch.topk(key, top_k, dim=1).values  # [n, k], descending
    values = (top >> 32).to(torch.int32).view(torch.float32)
    return values, num_experts - 1 - (top & 0xFFFFFFFF)


def renormalize_in_order(weights: torch.Tensor) -> torch.Tensor:
    """``weights / weights.sum(-1)`` for ``weights: [n, k]`` fp32, the sum taken left to right."""
    total = weights[:, 0]
    for j in range(1, weights.shape[1]):
        total = total + weights[:, j]
    return weights / total[:, None]


@triton.jit
def _route_kernel(
    logits_ptr, w_ptr, ids_ptr, E, stride_l,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    # One token: softmax over its E logits in fp32, k rounds of "largest, lowest id among equals", the weights
    # summed left to right in rank order.
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + t * stride_l + offs, mask=valid, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(valid, p / tl.sum(p, 0), -1.0)  # -1: never chosen
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int64)
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        # The lowest id among the maxima (clamped so that NaN logits still give an id in range).
        idx = tl.minimum(tl.min(tl.where(p == best, offs, BLOCK_E), 0), E - 1)
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, idx.to(tl.int64), ids)
        total += best
        p = tl.where(offs == idx, -1.0, p)
    if RENORMALIZE:
        weights = weights / total
    mask = slots < TOP_K
    tl.store(w_ptr + t * TOP_K + slots, weights, mask=mask)
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=mask)


def _route_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    weights = torch.empty((num_tokens, top_k), device=logits.device, dtype=torch.float32)
    ids = torch.empty((num_tokens, top_k), device=logits.device, dtype=torch.int64)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
            BLOCK_E=triton.next_power_of_2(num_experts),
        )  # fmt: skip
    return weights, ids


def _route_cpu(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = softmax(logits.float(), -1)  # [n, E] fp32
    weights, ids = top_k_lowest_id(probs, top_k)
    return (renormalize_in_order(weights) if renormalize else weights), ids


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``logits: [num_tokens, num_experts]`` -> ``(weights fp32 [n, k], ids int64 [n, k])``.

    Softmax in fp32, the top k by probability (ties to the lowest expert id), optionally renormalised to sum to
    one (left to right in rank order). Row by row: a token's routing never depends on the batch. CUDA runs one
    Triton program per token (one launch); the CPU ``ops.softmax`` and ``top_k_lowest_id``.
    """
    _check_logits(logits, top_k)
    if logits.is_cuda:
        return _route_triton(logits, top_k, renormalize)
    return _route_cpu(logits, top_k, renormalize)


# --- the plan: pairs sorted by expert, cut into row tiles -----------------------------------------------------


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


# --- the grouped matmul (Triton) ------------------------------------------------------------------------------


@triton.jit
def _grouped_mm_kernel(
    a_ptr, a_rows_ptr, b_ptr, c_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    N, K, num_experts,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    GATHER_A: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    # One program: the rows [start, end) of one expert's sorted rows (at most BM) times BN output columns.
    # SILU_MUL: b holds [gate; up] stacked ([2N, K] per expert) and c gets silu(x gate) * (x up), [rows, N].
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < num_experts:  # programs past the last tile do nothing (the grid is sized from shapes)
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_end_ptr + tile)
        offs_m = start + tl.arange(0, BM)
        mask_m = offs_m < end
        if GATHER_A:
            a_rows = tl.load(a_rows_ptr + offs_m, mask=mask_m, other=0)
        else:
            a_rows = offs_m
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BK)
        a_tile = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_tile = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        # The one reduction: k = 0 upward, BK at a time, into one fp32 accumulator per output.
        for k in range(0, K, BK):
            if EVEN_K:
                a = tl.load(a_tile, mask=mask_m[:, None], other=0.0)
                b = tl.load(b_tile, mask=mask_n[None, :], other=0.0)
            else:  # the zero-padded K tail adds exact zeros
                a = tl.load(a_tile, mask=mask_m[:, None] & (offs_k[None, :] < K - k), other=0.0)
                b = tl.load(b_tile, mask=mask_n[None, :] & (offs_k[:, None] < K - k), other=0.0)
            if UPCAST:  # the interpreter's bf16/fp16 dot is wrong; run it in fp32 there
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if SILU_MUL:
                if EVEN_K:
                    b_up = tl.load(b_tile + N * stride_bn, mask=mask_n[None, :], other=0.0)
                else:
                    b_up = tl.load(b_tile + N * stride_bn, mask=mask_n[None, :] & (offs_k[:, None] < K - k), other=0.0)
                if UPCAST:
                    b_up = b_up.to(tl.float32)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
            a_tile += BK * stride_ak
            b_tile += BK * stride_bk
        dtype = c_ptr.dtype.element_ty
        if SILU_MUL:
            # The dense MLP's roundings: gate and up rounded to the model dtype, silu(gate) rounded, then the product.
            gate = acc.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            out = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
        else:
            out = acc.to(dtype)
        c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c, out, mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class MoEConfig:
    bm: int
    bn: int
    bk: int
    num_warps: int = 4
    num_stages: int = 3


# Enough programs for two per SM of a large GPU (an H200 has 132 SMs); a shape constant, not read from the device.
_MIN_PROGRAMS = 256


def moe_config(num_pairs: int, num_experts: int, n: int, k: int, dtype: torch.dtype) -> MoEConfig:
    """The tile for one grouped matmul (``n`` output columns, reduction ``k``), from shapes alone: the dtype and
    the *average* number of rows an expert gets (``num_pairs / num_experts``), never the per-expert counts.

    BK is fixed per dtype, so every config reduces K in the same steps; BM, BN, warps and stages follow the
    average load (bench/moe.py checks that every config here gives the same bits on the GPU).
    """
    if dtype == torch.float32:
        return MoEConfig(bm=16, bn=32, bk=32)
    avg = num_pairs // max(1, num_experts)
    if avg <= 16:
        # Decode: bandwidth-bound, every program streams its experts' weight columns. At most min(E, P) row tiles
        # hold rows, so a few tokens get few programs: split N finer when 64-column tiles would give fewer than
        # _MIN_PROGRAMS (Qwen3-30B-A3B's gate/up at one token: 8 experts x 12 = 96 programs for 132 SMs).
        row_tiles = min(num_experts, num_pairs)
        bn = 64 if row_tiles * triton.cdiv(n, 64) >= _MIN_PROGRAMS else 32
        return MoEConfig(bm=16, bn=bn, bk=64, num_warps=4, num_stages=4)
    if avg <= 64:
        return MoEConfig(bm=64, bn=64, bk=64, num_warps=4, num_stages=4)
    if avg <= 256:
        return MoEConfig(bm=64, bn=128, bk=64, num_warps=4, num_stages=3)
    return MoEConfig(bm=128, bn=128, bk=64, num_warps=8, num_stages=3)


def _grouped_mm(
    a: torch.Tensor,
    a_rows: torch.Tensor | None,
    b: torch.Tensor,
    plan: RoutingPlan,
    cfg: MoEConfig,
    silu_mul: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    # a: [*, K]; row r of the result reads a[a_rows[r]] (a[r] without a_rows); b: [E, N(x2 if silu_mul), K]
    # -> c: [P, N] in out_dtype (default a's; float32 keeps the accumulator unrounded), the rows in sorted order.
    num_experts, n_full, k = b.shape
    n = n_full // 2 if silu_mul else n_full
    num_pairs = plan.order.numel()
    c = torch.empty((num_pairs, n), device=a.device, dtype=out_dtype or a.dtype)
    if num_pairs == 0:
        return c
    tile_expert, tile_start, tile_end = tile_table(plan, num_experts, cfg.bm)
    grid = (tile_expert.numel(), triton.cdiv(n, cfg.bn))
    _grouped_mm_kernel[grid](
        a, a_rows if a_rows is not None else tile_start, b, c,
        tile_expert, tile_start, tile_end,
        n, k, num_experts,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        GATHER_A=a_rows is not None, SILU_MUL=silu_mul, EVEN_K=k % cfg.bk == 0,
        UPCAST=interpreting() and a.dtype != torch.float32,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c


# --- the combine ----------------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(
    y_ptr, w_ptr, rows_ptr, out_ptr, H, stride_y, stride_o, TOP_K: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    # out[t] = sum over j = 0, 1, ..., k - 1 of w[t, j] * y[rows[t, j]], in fp32, in that order.
    t = tl.program_id(0)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    mask = offs < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(rows_ptr + t * TOP_K + j)
        w = tl.load(w_ptr + t * TOP_K + j)
        y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        acc += w * y
    tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _combine_triton(y: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    num_tokens, top_k = weights.shape
    hidden = y.shape[1]
    out = torch.empty((num_tokens, hidden), device=y.device, dtype=y.dtype)
    if num_tokens == 0:
        return out
    bh = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, bh))](
        y, weights.contiguous(), rows.contiguous(), out, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BH=bh
    )
    return out


def _combine_cpu(y: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    # Elementwise products and sums: one correctly rounded operation per element, the same bits on every path.
    acc = weights[:, 0, None] * y[rows[:, 0]].float()
    for j in range(1, weights.shape[1]):
        acc = acc + weights[:, j, None] * y[rows[:, j]].float()
    return acc.to(y.dtype)


def combine(y: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * y[rows[t, j]]`` in fp32, j = 0 to k - 1 in order, rounded to y's dtype.

    ``y: [P, H]`` (expert outputs, sorted rows), ``weights: [n, k]`` fp32, ``rows: [n, k]`` int64.
    """
    if y.is_cuda:
        return _combine_triton(y, weights, rows)
    return _combine_cpu(y, weights, rows)


# --- the whole expert layer -----------------------------------------------------------------------------------


def _check_experts(x, w13, w2, weights, ids) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"expected x [n, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, {tuple(w13.shape)}, "
            f"{tuple(w2.shape)}"
        )
    num_experts, two_i, hidden = w13.shape
    if two_i % 2 or x.shape[1] != hidden or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"expert weights do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(f"weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both be [{x.shape[0]}, k]")
    if x.dtype != w13.dtype or x.dtype != w2.dtype or x.dtype not in FLOATS:
        raise TypeError(f"expected matching float32/bfloat16/float16 tensors, got {x.dtype}, {w13.dtype}, {w2.dtype}")


def _experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    config: MoEConfig | tuple[MoEConfig, MoEConfig] | None = None,
) -> torch.Tensor:
    # config (benches and tests): one tile for both matmuls, or (gate/up's, down's); None: moe_config's.
    num_experts, two_i, hidden = w13.shape
    num_pairs = ids.numel()
    if config is None:
        cfg1 = moe_config(num_pairs, num_experts, two_i // 2, hidden, x.dtype)
        cfg2 = moe_config(num_pairs, num_experts, hidden, two_i // 2, x.dtype)
    else:
        cfg1, cfg2 = config if isinstance(config, tuple) else (config, config)
    # The fused plan (the torch one past FUSED_PLAN_MAX_PAIRS); cfg2 shares the tile table when its BM is the same.
    if num_pairs <= FUSED_PLAN_MAX_PAIRS:
        plan = plan_routing_triton(ids, num_experts, cfg1.bm)
    else:
        plan = plan_routing(ids, num_experts, cfg1.bm)
    act = _grouped_mm(x, plan.tokens, w13, plan, cfg1, silu_mul=True)  # [P, I], sorted rows
    y = _grouped_mm(act, None, w2, plan, cfg2, silu_mul=False)  # [P, H], sorted rows
    return combine(y, weights.float(), plan.rows.view(ids.shape))


_VIEWS_ATTR = "_lockstep_expert_views"


def expert_weight(w: torch.Tensor, e: int) -> torch.Tensor:
    """``w[e]``, the same view object every call, so the CPU matmul's packed copy of it (``_cpu_weight``) is kept."""
    key = (w.data_ptr(), tuple(w.shape), w.dtype)
    cached = getattr(w, _VIEWS_ATTR, None)
    if cached is None or cached[0] != key:
        cached = (key, [w.detach()[i] for i in range(w.shape[0])])
        try:
            setattr(w, _VIEWS_ATTR, cached)
        except (AttributeError, RuntimeError):  # a tensor that takes no attributes: a fresh view each call
            return w.detach()[e]
    return cached[1][e]


def _experts_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    num_experts = w13.shape[0]
    plan = plan_routing(ids, num_experts)
    bounds = plan.bounds.tolist()
    y = x.new_empty((plan.order.numel(), x.shape[1]))
    for e in range(num_experts):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            rows = x[plan.tokens[start:end]]  # [n_e, H]
            act = silu_and_mul(linear(rows, expert_weight(w13, e)))
            y[start:end] = linear(act, expert_weight(w2, e))
    return _combine_cpu(y, weights.float(), plan.rows.view(ids.shape))


def experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The routed expert MLPs, batch-invariant: ``x: [n, H]``, ``w13: [E, 2I, H]`` (each expert's gate and up
    projections stacked), ``w2: [E, H, I]``, ``weights: [n, k]`` and ``ids: [n, k]`` from ``route`` ->
    ``sum_j weights[:, j] * down_j(silu(gate_j(x)) * up_j(x))``: ``[n, H]`` in x's dtype."""
    _check_experts(x, w13, w2, weights, ids)
    if x.is_cuda:
        return _experts_triton(x, w13, w2, weights, ids)
    return _experts_cpu(x, w13, w2, weights, ids)


def experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``experts`` in plain torch ops, differentiable, with no invariance contract: each expert's rows through
    ``F.linear`` (whose reduction follows the number of rows), the k outputs summed by ``torch.sum``. Reads the
    per-expert counts on the host. The ``torch`` kernel set's experts, and the recomputation behind the trainer's
    backward (deterministic run to run: every index it scatters through is a permutation, no atomics add up)."""
    num_tokens, top_k = ids.shape
    hidden = x.shape[1]
    plan = plan_routing(ids, w13.shape[0])
    bounds = plan.bounds.tolist()
    # x once per pair ([n, k, H] -> [P, H]: its gradient sums over k), then in sorted order (a permutation).
    sorted_x = x[:, None, :].expand(num_tokens, top_k, hidden).reshape(-1, hidden)[plan.order]
    outs = []
    for e in range(w13.shape[0]):
        if bounds[e + 1] > bounds[e]:
            gate, up = torch.nn.functional.linear(sorted_x[bounds[e] : bounds[e + 1]], w13[e]).chunk(2, dim=-1)
            outs.append(torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e]))
    y = torch.cat(outs) if outs else x.new_zeros((0, hidden))  # [P, H], sorted rows
    y = y[plan.rows].view(num_tokens, top_k, hidden)  # back in pair order (a permutation)
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for a float64 reference
    return (y.to(acc) * weights.to(acc)[:, :, None]).sum(1).to(x.dtype)


# --- the chunk tree over I (tensor parallelism) ---------------------------------------------------------------


def _down_partials_cpu(x, w13, w2, plan: RoutingPlan, num_chunks: int) -> torch.Tensor:
    bounds = plan.bounds.tolist()
    partials = x.new_zeros((num_chunks, plan.order.numel(), x.shape[1]), dtype=torch.float32)
    for e in range(w13.shape[0]):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            act = silu_and_mul(linear(x[plan.tokens[start:end]], expert_weight(w13, e)))  # [n_e, I_local]
            partials[:, start:end] = tp_linear.chunk_partials(act, expert_weight(w2, e), num_chunks)
    return partials


def _down_partials_triton(x, w13, w2, plan: RoutingPlan, num_chunks: int) -> torch.Tensor:
    num_experts, two_i, hidden = w13.shape
    num_pairs = plan.order.numel()
    act = _grouped_mm(x, plan.tokens, w13, plan, moe_config(num_pairs, num_experts, two_i // 2, hidden, x.dtype), True)
    width = -(-act.shape[1] // num_chunks)
    pad = width * num_chunks - act.shape[1]
    if pad:  # zero columns of act and of w2: each chunk's sum gains exact zeros at its end
        act = torch.nn.functional.pad(act, (0, pad))
        w2 = torch.nn.functional.pad(w2, (0, pad))
    # Every chunk is `width` wide at every TP size, so the tile (and its K steps) is the same at every TP size.
    cfg = moe_config(num_pairs, num_experts, hidden, width, x.dtype)
    partials = act.new_empty((num_chunks, num_pairs, hidden), dtype=torch.float32)
    for c in range(num_chunks):
        cols = slice(c * width, (c + 1) * width)
        partials[c] = _grouped_mm(act[:, cols], None, w2[:, :, cols], plan, cfg, False, out_dtype=torch.float32)
    return partials


def down_roots(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, num_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every routed pair's down projection as the fp32 root of a subtree of the chunk tree over I.

    ``x: [n, H]``, ``w13: [E, 2I', H]`` and ``w2: [E, H, I']`` (a rank's I' = I / N columns of every expert, or
    all of them), ``ids: [n, k]`` -> ``(roots fp32 [P, H] in sorted-row order, rows int64 [n, k])``, ``rows`` as
    ``combine`` takes them. I' is cut into ``num_chunks`` chunks (``8 / N`` on each of N ranks; 8 in one process,
    zero-padded when 8 does not divide I), each accumulated in fp32 and the chunks summed by ``tp_linear``'s
    pairwise tree. The ranks' roots, all-gathered in rank order and passed through ``tp_linear.tree_reduce``,
    are the one-process roots bit for bit.
    """
    _check_experts(x, w13, w2, ids, ids)
    if num_chunks not in (1, 2, 4, 8):
        raise ValueError(f"num_chunks must be 1, 2, 4 or 8, got {num_chunks}")
    plan = plan_routing(ids, w13.shape[0])
    if x.is_cuda:
        partials = _down_partials_triton(x, w13, w2, plan, num_chunks)
    else:
        partials = _down_partials_cpu(x, w13, w2, plan, num_chunks)
    return tp_linear.tree_reduce(partials), plan.rows.view(ids.shape)


def experts_tree(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``experts`` with each pair's down projection reduced through the whole chunk tree (``down_roots`` over 8
    chunks), rounded to x's dtype, then combined in rank order: the bits N ranks holding I / N each compute."""
    _check_experts(x, w13, w2, weights, ids)
    roots, rows = down_roots(x, w13, w2, ids, tp_linear.CHUNKS)
    return combine(roots.to(x.dtype), weights.float(), rows)
