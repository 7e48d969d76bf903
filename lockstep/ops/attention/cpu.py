"""``paged_attention`` on the CPU: the plan that cuts a batch into work entries (once a step, shared by every
layer) and the batched-matmul path that follows the GPU's tile/split reduction order."""

import math
from dataclasses import dataclass

import torch

from lockstep.ops._common import intra_op_threads
from lockstep.ops.attention.kv_cache import FP8_KV, _bytes
from lockstep.ops.attention.tiling import SPLIT, TILE

# Query tokens per CPU work entry. Entries of several sequences are batched into one bmm of fixed per-entry
# shape [ROWS * group, head_dim] x [head_dim, TILE]; small enough that a decode row wastes little.
_CPU_ROWS = 4


# The same structure: TILE-position tiles in order, an online softmax per SPLIT, splits merged in order. Work
# is cut into entries of _CPU_ROWS consecutive query tokens of one sequence; an item is (entry, tile). Every
# item's scores come from one bmm entry of the fixed shape [ROWS * group, D] x [D, TILE] and its P@V from one of
# [ROWS * group, TILE] x [TILE, D]. The CPU BLAS picks its algorithm from the call's shape, but the per-entry
# result of aten.bmm does not depend on the number of entries or an entry's slot in the batch (tests check
# this alongside the whole path); the rest is elementwise, exact (max, cummax, where) or a per-row sum over a
# fixed TILE. So the items of many entries and tiles go through each op together, and only the rescaled sums
# (den, acc) walk the tiles one by one, every split at once; the splits are then merged in order. An entry
# shorter than its chunk's longest gets tiles past its end that see nothing: they leave den exact and can
# only flip the sign of an exact zero in acc (see the package docstring). torch.exp, not exp2: CPU exp2 rounds
# a tensor's scalar tail differently from its vector body. Unlike the GPU, P stays fp32 for P@V (the CPU
# computes in fp32 anyway), so CPU and GPU bits differ, as docs/design.md ("What is not invariant") allows.
#
# Which items exist, the cache rows they read and their causal masks are the same for every layer of a step:
# ``cpu_attention_plan`` works them out once, and each layer's call takes the plan.

# Bytes of K one chunk of entries gathers (V as much again): bounds the memory of a long prefill.
_CPU_CHUNK_BYTES = 32 << 20
# Below this many (item, kv head) bmm entries a step runs on one thread: a decode step's attention is a few dozen
# small calls, and waking the OpenMP workers for each made it 2-3x slower with OMP_WAIT_POLICY=PASSIVE on the
# 2-core machines; with spinning workers two threads only won from ~100 entries. The bits do not depend on the
# thread count (per-entry bmm results and elementwise ops; tested).
_CPU_SERIAL_ENTRIES = 96


@dataclass(frozen=True)
class _CpuChunk:
    """Entries ``[first, first + num_entries)`` of one height of a plan, as a grid of ``num_entries x num_tiles``
    items, each ``n_rows`` matmul rows per KV head."""

    first: int
    num_entries: int
    num_tiles: int  # tiles of the chunk's longest entry
    n_rows: int  # R: matmul rows of an entry per KV head
    q_rows: torch.Tensor  # [E * T * H_kv * R] rows of q viewed as [tokens * H_q, D] (padding rows read token 0)
    kv_rows: torch.Tensor  # [E * T * H_kv * TILE] rows of the cache viewed as [slots * H_kv, D]
    v_zero: torch.Tensor | None  # indices into kv_rows past a sequence's end (unused slots may hold NaN)
    masked: torch.Tensor  # [E, T, 1, R, TILE] bool: True where a score is -inf


@dataclass(frozen=True)
class CpuAttentionPlan:
    """How the CPU path cuts one batch into work, for caches with ``key = (page_size, num_kv_heads, head_dim,
    group)``. Entries of ``rows_per_entry`` query tokens of one sequence, ``rows_per_entry * group`` matmul rows per
    KV head, (token, head of the group) token-major; a sequence of one query token (a decode row) gets an entry of
    its own, ``group`` rows padded to a multiple of 4, where ``_short_entries_ok`` allows it. Each height's entries
    are ordered longest first."""

    key: tuple[int, int, int, int]
    rows_per_entry: int
    chunks: tuple[_CpuChunk, ...]
    out_rows: torch.Tensor  # [tokens * H_q]: where each (token, query head) sits in the chunks' outputs, flattened

    @property
    def bmm_entries(self) -> int:
        """(item, kv head) pairs: the entries of each of the step's two bmm passes."""
        return sum(c.num_entries * c.num_tiles for c in self.chunks) * self.key[1]


# Decode rows in entries of their own. A decode token is one token of its sequence, so in an entry of _CPU_ROWS
# tokens 3 of every 4 rows are padding: at batch 32 (SmolLM2, group 3) the attention took ~3x what one-token entries
# took. Those entries are shorter ([ceil(group / 4) * 4, D] x [D, TILE]), so they keep the contract only if the bmm
# gives a row the same bits at both heights, from any token slot of the taller entry: MKL did on the 2-core machines
# (every height from 4 to 48 equal, 1 to 3 not), which nothing promises elsewhere. So a probe on random rows checks
# it once per (heights, group, head_dim, thread count), at one thread and at all of them; without it decode rows
# take the tall entries, as prefill rows always do.
_short_ok: dict[tuple, bool] = {}


def _short_entries_ok(short: int, tall: int, group: int, head_dim: int) -> bool:
    """Whether a bmm entry of ``short`` rows gives each of its first ``group`` rows the bits of that row in an entry
    of ``tall`` rows, at every token slot of the tall one, for both of the CPU path's matmuls."""
    key = (short, tall, group, head_dim, torch.get_num_threads())
    ok = _short_ok.get(key)
    if ok is None:
        g = torch.Generator().manual_seed(tall * 1000 + short)
        n = 8
        q, q_pad = torch.randn(n, tall, head_dim, generator=g), torch.randn(n, short, head_dim, generator=g)
        k = torch.randn(n, TILE, head_dim, generator=g).transpose(1, 2)  # the layout _attend_chunk multiplies
        p, p_pad = torch.rand(n, tall, TILE, generator=g), torch.rand(n, short, TILE, generator=g)
        v = torch.randn(n, TILE, head_dim, generator=g)
        ok = True
        for threads in (1, None):
            with intra_op_threads(threads):
                s_tall, o_tall = _bmm(q, k), _bmm(p, v)
                for r0 in range(0, tall, group):
                    rows = slice(r0, r0 + group)
                    qs, ps = q_pad.clone(), p_pad.clone()
                    qs[:, :group], ps[:, :group] = q[:, rows], p[:, rows]
                    ok &= torch.equal(_bmm(qs, k)[:, :group], s_tall[:, rows])
                    ok &= torch.equal(_bmm(ps, v)[:, :group], o_tall[:, rows])
        _short_ok[key] = ok
    return ok


def cpu_attention_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_shape: tuple[int, ...],
    num_q_heads: int,
    *,
    rows_per_entry: int = _CPU_ROWS,
) -> CpuAttentionPlan:
    """The CPU path's plan for one batch (``paged_attention``'s arguments; ``cache_shape`` is the K cache's)."""
    _, page_size, num_kv_heads, head_dim = cache_shape
    group = num_q_heads // num_kv_heads
    tall = rows_per_entry * group
    short = -(-group // 4) * 4
    if short >= tall or not _short_entries_ok(short, tall, group, head_dim):
        short = 0
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    by_height: dict[int, tuple[list, list, list]] = {}  # matmul rows -> the entries' tokens, positions, sequences
    for i in range(len(lens)):
        q_len = starts[i + 1] - starts[i]
        if q_len == 0:
            continue
        per = 1 if q_len == 1 and short else rows_per_entry
        toks, poss, seqs = by_height.setdefault(short if per == 1 else tall, ([], [], []))
        padded = -(-q_len // per) * per
        j = torch.arange(padded)
        toks.append(torch.where(j < q_len, starts[i] + j, -1).view(-1, per))
        poss.append(torch.where(j < q_len, lens[i] - q_len + j, -1).view(-1, per))
        seqs.append(torch.full((padded // per,), i))

    num_out = starts[-1] * num_q_heads
    out_rows = torch.empty(num_out, dtype=torch.int64)
    chunks: list[_CpuChunk] = []
    offset = 0  # rows of the chunks' outputs before this height's
    for n_rows in sorted(by_height, reverse=True):
        toks, poss, seqs = by_height[n_rows]
        tok, pos, seq = torch.cat(toks), torch.cat(poss), torch.cat(seqs)
        per = tok.shape[1]
        n_tiles = pos.amax(1) // TILE + 1
        # Longest first, so that a chunk's entries need about as many tiles each (the order is only a slot in a bmm).
        order = torch.argsort(n_tiles, descending=True, stable=True)
        tok, pos, seq, n_tiles = tok[order], pos[order], seq[order], n_tiles[order].tolist()
        num_entries = tok.shape[0]

        # Matmul row (entry e, kv head h, row r * group + g) is query token tok[e, r], head h * group + g; rows past
        # per * group (a short entry's padding) read q row 0 and see no position.
        heads = torch.arange(num_kv_heads).view(1, -1, 1, 1) * group + torch.arange(group).view(1, 1, 1, -1)
        q_rows = (tok.clamp(min=0).view(num_entries, 1, per, 1) * num_q_heads + heads).flatten(2)  # [E, H, per * g]
        live = (tok >= 0).view(num_entries, 1, per, 1).expand(-1, num_kv_heads, -1, group).flatten(2)
        row_pos = pos.repeat_interleave(group, dim=1)  # [E, per * group]
        pad = n_rows - per * group
        if pad:
            q_rows = torch.nn.functional.pad(q_rows, (0, pad))
            live = torch.nn.functional.pad(live, (0, pad))
            row_pos = torch.nn.functional.pad(row_pos, (0, pad), value=-1)
        live = live.flatten()
        out_rows[q_rows.flatten()[live]] = live.nonzero().squeeze(1) + offset
        offset += live.numel()
        q_rows = q_rows.view(num_entries, 1, num_kv_heads, n_rows)
        chunks += _height_chunks(q_rows, row_pos, seq, n_tiles, seq_lens, block_tables, page_size, head_dim)
    return CpuAttentionPlan((page_size, num_kv_heads, head_dim, group), rows_per_entry, tuple(chunks), out_rows)


def _height_chunks(q_rows, row_pos, seq, n_tiles, seq_lens, block_tables, page_size, head_dim) -> list[_CpuChunk]:
    # One height's entries (q_rows [E, 1, H_kv, R], row_pos [E, R], seq [E], n_tiles: E ints, longest first) cut into
    # chunks of at most _CPU_CHUNK_BYTES of K each.
    num_entries, _, num_kv_heads, n_rows = q_rows.shape
    lens_t, tables = seq_lens.long(), block_tables.long()
    kv_heads = torch.arange(num_kv_heads)[:, None]
    item_bytes = num_kv_heads * TILE * head_dim * 4
    chunks = []
    first = 0
    while first < num_entries:
        num_tiles = n_tiles[first]
        count = max(1, min(num_entries - first, _CPU_CHUNK_BYTES // (num_tiles * item_bytes)))
        entries = slice(first, first + count)
        offs = torch.arange(num_tiles * TILE)
        kv_ok = offs < lens_t[seq[entries], None]  # [E, T * TILE]
        blocks = tables[seq[entries]].gather(1, (offs // page_size).clamp(max=tables.shape[1] - 1).expand(count, -1))
        slots = torch.where(kv_ok, blocks * page_size + offs % page_size, 0).view(count, num_tiles, 1, TILE)
        v_zero = (~kv_ok).view(count, num_tiles, 1, TILE).expand(-1, -1, num_kv_heads, -1).flatten().nonzero()
        chunks.append(
            _CpuChunk(
                first, count, num_tiles, n_rows,
                q_rows=q_rows[entries].expand(-1, num_tiles, -1, -1).flatten(),
                kv_rows=(slots * num_kv_heads + kv_heads).flatten(),
                v_zero=v_zero.squeeze(1) if v_zero.numel() else None,
                masked=offs.view(1, num_tiles, 1, 1, TILE) > row_pos[entries, None, None, :, None],
            )
        )  # fmt: skip
        first += count
    return chunks


def _merge_cpu(run, part):
    # run, part: (m [E, H, R], den [E, H, R], acc [E, H, R, D]) -> part folded into run.
    m_run, den_run, acc_run = run
    m, den, acc = part
    m_new = torch.maximum(m_run, m)
    base = torch.where(m_new == float("-inf"), 0.0, m_new)
    alpha = torch.where(m_run == m_new, 1.0, torch.exp(m_run - base))
    beta = torch.where(m == m_new, 1.0, torch.exp(m - base))
    seen = m > float("-inf")
    den_out = torch.where(seen, den_run * alpha + den * beta, den_run)
    acc_out = torch.where(seen[..., None], acc_run * alpha[..., None] + acc * beta[..., None], acc_run)
    return torch.where(seen, m_new, m_run), den_out, acc_out


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # aten.bmm.out, not torch.bmm: inside batch_invariant_mode torch.bmm would come back to lockstep.
    return torch.ops.aten.bmm.out(a, b, out=a.new_empty((a.shape[0], a.shape[1], b.shape[2])))


def _cache_floats(rows: torch.Tensor) -> torch.Tensor:
    # Gathered cache rows as fp32 (an e4m3 cache's arrive as bytes: ``_bytes``), exactly.
    return rows.view(FP8_KV).float() if rows.dtype == torch.uint8 else rows.float()


def _attend_chunk(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, c: _CpuChunk, tiles_per_split: int
) -> torch.Tensor:
    # q, k_rows, v_rows: [rows, D] views of q and the caches -> [E, H_kv, R, D] fp32 for the chunk's entries
    head_dim = k_rows.shape[1]
    e, t, n_rows = c.num_entries, c.num_tiles, c.n_rows
    num_kv_heads = c.kv_rows.shape[0] // (e * t * TILE)
    q_items = q.index_select(0, c.q_rows).view(-1, n_rows, head_dim)
    k = _cache_floats(k_rows.index_select(0, c.kv_rows)).view(-1, TILE, head_dim)
    v = _cache_floats(v_rows.index_select(0, c.kv_rows))
    if c.v_zero is not None:
        v.index_fill_(0, c.v_zero, 0.0)
    s = _bmm(q_items, k.transpose(1, 2)).view(e, t, num_kv_heads, n_rows, TILE)
    s.masked_fill_(c.masked, float("-inf"))

    # m: the running max up to each tile, from the first tile of its split; base: m with -inf (a row that has seen
    # nothing) read as 0. alpha rescales the sums of the tiles before, whose max is m_prev (-inf at a split's first
    # tile, where nothing comes before). Where m_prev == m, alpha = exp(0) = 1; where both are -inf, alpha = 0
    # multiplies sums that are still exactly zero: either way the bits of "alpha = 1 where m did not move".
    m = s.amax(-1)  # [E, T, H, R]
    if t > 1:
        m_prev = torch.full_like(m, float("-inf"))
        for lo in range(0, t, tiles_per_split):
            hi = min(lo + tiles_per_split, t)
            m[:, lo:hi] = torch.cummax(m[:, lo:hi], dim=1).values
            m_prev[:, lo + 1 : hi] = m[:, lo : hi - 1]
    base = torch.nan_to_num(m, nan=math.nan, posinf=math.inf, neginf=0.0)
    p = s.sub_(base[..., None]).exp_()
    den = p.sum(-1)  # [E, T, H, R]
    acc = _bmm(p.view(-1, n_rows, TILE), v.view(-1, TILE, head_dim)).view(e, t, num_kv_heads, n_rows, head_dim)
    # Every real row sees its own position: den >= 1. Padding rows (den = 0) come out NaN and are never read.
    if t == 1:
        return acc[:, 0] / den[:, 0, ..., None]
    alpha = torch.exp(m_prev - base)

    # den and acc rescaled tile by tile within each split, all splits at once: [E, splits, tiles, ...]. Tiles
    # past the end pad the last split with alpha = 1 and zero sums, which leave den and acc as they are.
    num_splits = -(-t // tiles_per_split)
    width = t if num_splits == 1 else tiles_per_split
    pad = num_splits * width - t
    if pad:
        alpha = torch.cat([alpha, alpha.new_ones((e, pad, *alpha.shape[2:]))], 1)
        den = torch.cat([den, den.new_zeros((e, pad, *den.shape[2:]))], 1)
        acc = torch.cat([acc, acc.new_zeros((e, pad, *acc.shape[2:]))], 1)
    alpha = alpha.view(e, num_splits, width, num_kv_heads, n_rows)
    den = den.view(e, num_splits, width, num_kv_heads, n_rows)
    acc = acc.view(e, num_splits, width, num_kv_heads, n_rows, head_dim)
    # A split's first tile starts from den = acc = 0: 0 * alpha + x is x (up to the sign of a zero).
    den_s, acc_s = den[:, :, 0], acc[:, :, 0]
    for j in range(1, width):
        den_s = den_s * alpha[:, :, j] + den[:, :, j]
        acc_s = acc_s * alpha[:, :, j, ..., None] + acc[:, :, j]

    # Merge the splits in order; from the empty state the first merge would give split 0 itself.
    den_run, acc_run = den_s[:, 0], acc_s[:, 0]
    if num_splits > 1:
        last = torch.tensor([min(lo + tiles_per_split, t) - 1 for lo in range(0, t, tiles_per_split)])
        m_s = m.index_select(1, last)  # [E, splits, H, R]: each split's max
        run = m_s[:, 0], den_run, acc_run
        for i in range(1, num_splits):
            run = _merge_cpu(run, (m_s[:, i], den_s[:, i], acc_s[:, i]))
        _, den_run, acc_run = run
    return acc_run / den_run[..., None]


def _paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    split: int = SPLIT,
    rows_per_entry: int = _CPU_ROWS,
    plan: CpuAttentionPlan | None = None,
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if num_tokens == 0:
        return torch.empty_like(q)
    if plan is None:
        plan = cpu_attention_plan(
            block_tables, seq_lens, query_start_loc, k_cache.shape, num_q_heads, rows_per_entry=rows_per_entry
        )
    elif plan.key != (k_cache.shape[1], num_kv_heads, head_dim, group) or plan.rows_per_entry != rows_per_entry:
        raise ValueError(f"the plan was made for other caches or heads: {plan.key}")
    q_rows = (q.float() * scale).view(-1, head_dim)  # row token * H_q + head, pre-scaled
    k_rows = _bytes(k_cache).view(-1, head_dim)  # row slot * H_kv + kv head
    v_rows = _bytes(v_cache).view(-1, head_dim)
    with intra_op_threads(1 if plan.bmm_entries < _CPU_SERIAL_ENTRIES else None):
        outs = [_attend_chunk(q_rows, k_rows, v_rows, c, split // TILE).reshape(-1, head_dim) for c in plan.chunks]
    o = outs[0] if len(outs) == 1 else torch.cat(outs)  # [sum of E * H_kv * R, D]
    out = o.index_select(0, plan.out_rows).view(q.shape)
    return out.add_(0.0).to(q.dtype)  # + 0.0 turns -0.0 into +0.0 (see the package docstring)
