"""Paged attention: values against an fp64 reference, and bitwise invariance of a query row to how it arrives
(one-shot prefill, chunks, decode steps, prefix hit, batch neighbours, physical block ids), on the CPU path and
on the Triton kernel under the interpreter (fp32, small)."""

import functools

import pytest
import torch

from lockstep.ops import paged_attention, write_kv
from lockstep.ops.attention import TILE
from lockstep.ops.attention import cpu as attention_cpu
from lockstep.ops.attention.cpu import _CPU_ROWS, _bmm, _paged_attention_cpu, cpu_attention_plan
from lockstep.ops.attention.kv_cache import _write_kv_triton
from lockstep.ops.attention.launch import (
    _PART_CAP_BYTES,
    _col_groups,
    _ids_ahead,
    _inline_splits,
    _merge_heads,
    _paged_attention_triton,
    _skip_empty,
    _split_grid,
    _use_split_programs,
)

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bits, -0.0 != +0.0 and NaN == NaN of the same payload."""
    assert a.shape == b.shape and a.dtype == b.dtype
    ia, ib = a.view(_INT_VIEW[a.dtype]), b.view(_INT_VIEW[b.dtype])
    if not torch.equal(ia, ib):
        bad = (ia != ib).nonzero()
        raise AssertionError(f"{len(bad)} elements differ in bits, first at {bad[0].tolist()}")


class Seq:
    """One sequence's q/k/v at every position, fixed by its seed."""

    def __init__(self, length: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.q = torch.randn(length, hq, d, generator=g).to(dtype)
        self.k = torch.randn(length, hkv, d, generator=g).to(dtype)
        self.v = torch.randn(length, hkv, d, generator=g).to(dtype)


class Paged:
    """A paged KV cache with blocks handed out in a shuffled order; unused slots hold NaN."""

    def __init__(self, hkv: int, d: int, dtype: torch.dtype, page: int = 16, num_blocks: int = 96, seed: int = 0):
        self.page = page
        self.k = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=dtype)
        self.v = torch.full_like(self.k, float("nan"))
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[str, list[int]] = {}

    def write(self, name: str, seq: Seq, start: int, end: int, shared: list[int] = (), writer=write_kv) -> None:
        table = self.tables.setdefault(name, list(shared))
        while len(table) * self.page < end:
            table.append(self.free.pop())
        pos = torch.arange(start, end)
        slots = torch.tensor(table)[pos // self.page] * self.page + pos % self.page
        writer(seq.k[start:end], seq.v[start:end], self.k, self.v, slots)

    def attend(self, fn, items: list[tuple[str, Seq, int, int]], scale: float = 0.17) -> list[torch.Tensor]:
        """items: (name, seq, start, end) = the queries at positions [start, end) of a sequence whose cache
        holds positions [0, end). Returns each item's output."""
        width = max(len(self.tables[name]) for name, *_ in items) + 1
        tables = torch.full((len(items), width), -1, dtype=torch.int32)
        for i, (name, *_) in enumerate(items):
            tables[i, : len(self.tables[name])] = torch.tensor(self.tables[name])
        q = torch.cat([seq.q[start:end] for _, seq, start, end in items])
        seq_lens = torch.tensor([end for *_, end in items], dtype=torch.int32)
        counts = torch.tensor([0] + [end - start for *_, start, end in items])
        query_start_loc = counts.cumsum(0).to(torch.int32)
        out = fn(q, self.k, self.v, tables, seq_lens, query_start_loc, scale)
        return list(out.split(counts[1:].tolist()))


def reference(seq: Seq, start: int, end: int, scale: float = 0.17) -> torch.Tensor:
    """fp64 causal attention of positions [start, end) over contiguous K/V [0, end)."""
    q = seq.q[start:end].double()
    group = q.shape[1] // seq.k.shape[1]
    k = seq.k[:end].double().repeat_interleave(group, 1)
    v = seq.v[:end].double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = s.masked_fill(torch.arange(end) > torch.arange(start, end)[:, None], float("-inf"))
    p = (s - s.amax(-1, keepdim=True)).exp()
    return torch.einsum("hqk,khd->qhd", p / p.sum(-1, keepdim=True), v)


def cpu(split: int | None = None):
    return functools.partial(_paged_attention_cpu, split=split) if split else paged_attention


def triton_(split: int = 128, **launch):
    return functools.partial(_paged_attention_triton, split=split, **launch)


# ---------------------------------------------------------------------------------------------- values

LENGTHS = [1, 3, 17, 127, 300]


def _check_reference(fn, lengths, q_lens, hq, hkv, d, page, dtype, atol):
    paged = Paged(hkv, d, dtype, page=page, num_blocks=sum(-(-n // page) for n in lengths) + 4)
    seqs = [Seq(n, hq, hkv, d, dtype, seed=i) for i, n in enumerate(lengths)]
    for i, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
        paged.write(f"s{i}", seq, 0, n)
    items = [(f"s{i}", seq, n - ql, n) for i, (seq, n, ql) in enumerate(zip(seqs, lengths, q_lens, strict=True))]
    for out, (_, seq, start, end) in zip(paged.attend(fn, items), items, strict=True):
        torch.testing.assert_close(out.double(), reference(seq, start, end), atol=atol, rtol=0)


# split None: the public API (SPLIT); 128 puts 300 positions over 3 splits. Page 7 does not divide the tile.
@pytest.mark.parametrize(
    "d,hq,hkv,page,split",
    [
        (64, 9, 3, 16, None),
        (64, 3, 3, 7, 128),
        (32, 9, 3, 7, None),
        (32, 3, 3, 16, 128),
        (64, 9, 3, 7, 128),
        (16, 10, 2, 5, 128),
    ],  # group 5: decode rows in short entries of 8 rows (tall: 20)
)
def test_cpu_matches_fp64_reference(d, hq, hkv, page, split):
    # prefill, a chunk after context, decode, prefill, decode
    _check_reference(cpu(split), LENGTHS, [1, 3, 5, 127, 1], hq, hkv, d, page, torch.float32, 2e-6)
    _check_reference(cpu(split), LENGTHS, [1, 1, 17, 16, 300], hq, hkv, d, page, torch.float32, 2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_precision_matches_fp64_reference(dtype):
    _check_reference(cpu(128), LENGTHS, [1, 3, 5, 127, 300], 9, 3, 64, 16, dtype, 2e-2)


@pytest.mark.parametrize("split_programs", [False, True])
@pytest.mark.parametrize("hq,hkv,d,page", [(3, 1, 32, 16), (4, 2, 64, 5)])
def test_triton_matches_fp64_reference(split_programs, hq, hkv, d, page):
    fn = triton_(split_programs=split_programs)
    _check_reference(fn, [1, 3, 17, 150], [1, 3, 5, 150], hq, hkv, d, page, torch.float32, 2e-6)


def test_triton_bf16_matches_fp64_reference():
    # P is rounded to bf16 before the P@V dot, as on the GPU (the interpreter upcasts the dot's operands).
    _check_reference(triton_(), [3, 17, 150], [3, 1, 150], 4, 2, 32, 16, torch.bfloat16, 2e-2)


def test_empty_batch_and_empty_sequence():
    paged = Paged(1, 32, torch.float32)
    seq = Seq(20, 2, 1, 32, torch.float32, seed=0)
    paged.write("a", seq, 0, 20)
    paged.write("b", seq, 0, 20)
    for fn in (cpu(), triton_()):
        out = paged.attend(fn, [("a", seq, 20, 20), ("b", seq, 10, 20)])
        assert out[0].shape == (0, 2, 32)
        torch.testing.assert_close(out[1].double(), reference(seq, 10, 20), atol=2e-6, rtol=0)


# ------------------------------------------------------------------------------------------ invariance


def _paths(fn, hq, hkv, d, n, chunks, decode_positions=None, page=16):
    """Every way the queries of one sequence of length n can arrive; returns {path: outputs [n, hq, d]} with
    the cold one-shot prefill first. decode_positions=None decodes every position token by token."""
    dtype = torch.float32
    target = Seq(n, hq, hkv, d, dtype, seed=1)
    others = [Seq(m, hq, hkv, d, dtype, seed=10 + i) for i, m in enumerate([130, 17, 64, 5])]
    paged = Paged(hkv, d, dtype, page=page, num_blocks=4 * n // page + 64, seed=0)
    for i, s in enumerate(others):
        paged.write(f"o{i}", s, 0, s.q.shape[0])
    paged.write("t", target, 0, n)
    results = {"prefill": paged.attend(fn, [("t", target, 0, n)])[0]}

    # Chunked prefill and decode: the cache is filled as the queries arrive (later slots still hold NaN).
    for chunk in chunks:
        fresh = Paged(hkv, d, dtype, page=page, num_blocks=n // page + 2, seed=chunk)
        outs = []
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            fresh.write("t", target, start, end)
            outs += fresh.attend(fn, [("t", target, start, end)])
        results[f"chunks of {chunk}"] = torch.cat(outs)

    # Decode steps of chosen positions, each inside a batch with prefill, chunk and decode neighbours.
    positions = range(n) if decode_positions is None else decode_positions
    outs = torch.full_like(results["prefill"], float("nan"))
    for j, p in enumerate(positions):
        neighbours = [("o0", others[0], 100, 130), ("o1", others[1], 16, 17), ("o2", others[2], 0, 64)]
        items = neighbours[: j % 4] + [("t", target, p, p + 1)] + neighbours[j % 4 :]
        outs[p] = paged.attend(fn, items)[j % 4][0]
    results["decode in a batch"] = torch.where(torch.isnan(outs), results["prefill"], outs)

    # The whole prefill between neighbours, and a prefix hit: a second sequence shares the first blocks
    # (block-aligned) of the target's cache and only the rest is computed.
    batch = [("o3", others[3], 2, 5), ("t", target, 0, n), ("o0", others[0], 0, 130)]
    results["prefill in a batch"] = paged.attend(fn, batch)[1]
    hit = (n // 2) // page * page
    paged.write("hit", target, hit, n, shared=paged.tables["t"][: hit // page])
    suffix = paged.attend(fn, [("o1", others[1], 0, 17), ("hit", target, hit, n)])[1]
    results["prefix hit"] = torch.cat([results["prefill"][:hit], suffix])

    # Different physical blocks, a different page size.
    moved = Paged(hkv, d, dtype, page=page, num_blocks=n // page + 40, seed=123)
    moved.write("t", target, 0, n)
    results["shuffled blocks"] = moved.attend(fn, [("t", target, 0, n)])[0]
    return results


def _assert_all_equal(results):
    (_, first), *rest = results.items()
    for name, out in rest:
        try:
            assert_bitwise(out, first)
        except AssertionError as e:
            raise AssertionError(f"{name} != one-shot prefill: {e}") from None


BOUNDARIES = [0, 1, 62, 63, 64, 127, 128, 129, 200, 255, 256, 299]


def test_cpu_invariance():
    # 300 positions over 3 splits of 128: every path crosses tile and split boundaries.
    _assert_all_equal(_paths(cpu(128), 9, 3, 64, 300, chunks=[1, 5, 16], decode_positions=BOUNDARIES))


def test_cpu_invariance_mha_small_head():
    _assert_all_equal(_paths(cpu(128), 2, 2, 32, 300, chunks=[7], decode_positions=BOUNDARIES, page=5))


def test_cpu_invariance_public_api():
    # The default split (one split here), page size not dividing the tile.
    _assert_all_equal(_paths(cpu(), 9, 3, 64, 140, chunks=[5], decode_positions=[0, 63, 64, 139], page=7))


def test_triton_invariance():
    fn = triton_(split=128, block_m=64)
    results = _paths(fn, 3, 1, 32, 150, chunks=[16, 45], decode_positions=[0, 63, 64, 128, 149])
    # Launch shapes must not matter either: split programs + merge kernel vs in-register merge, and the
    # number of query rows per program (a weak check here: on the GPU this is the MMA shape; see the kernel).
    target = Paged(1, 32, torch.float32)
    seq = Seq(150, 3, 1, 32, torch.float32, seed=1)
    target.write("t", seq, 0, 150)
    launches = [dict(split_programs=True, block_m=16, num_stages=4), dict(split_programs=False, block_m=32)]
    launches += [dict(split_programs=sp, heads_inner=False) for sp in (False, True)]
    launches += [dict(split_programs=sp, ids_ahead=True) for sp in (False, True)]  # block ids loaded a tile ahead
    for launch in launches:
        results[str(launch)] = target.attend(triton_(split=128, **launch), [("t", seq, 0, 150)])[0]
    _assert_all_equal(results)


@pytest.mark.parametrize("fn", [cpu(128), triton_(split=128)], ids=["cpu", "triton"])
def test_page_size_does_not_change_bits(fn):
    # The engine's block_size only enters address arithmetic: the same K/V in pages of 16, 5 (not dividing the
    # tile), 64 and 128 positions give the same bits, for decode rows and a chunk of a prefill.
    seqs = [Seq(n, 4, 2, 32, torch.float32, seed=n) for n in (150, 70, 1)]
    outputs = []
    for page in (16, 5, 64, 128):
        paged = Paged(2, 32, torch.float32, page=page, num_blocks=sum(-(-n // page) for n in (150, 70, 1)) + 2)
        for i, seq in enumerate(seqs):
            paged.write(f"s{i}", seq, 0, seq.q.shape[0])
        decode = paged.attend(fn, [(f"s{i}", seq, seq.q.shape[0] - 1, seq.q.shape[0]) for i, seq in enumerate(seqs)])
        chunk = paged.attend(fn, [("s0", seqs[0], 100, 150), ("s1", seqs[1], 69, 70)])
        outputs.append(torch.cat(decode + chunk))
    for out in outputs[1:]:
        assert_bitwise(out, outputs[0])


def test_split_programs_per_row_do_not_change_bits():
    # Decode rows over a block table far wider than their contexts (a CUDA graph's, max_model_len wide): however
    # many programs share a row's splits (the grid's third dimension, each taking every P-th split), the bits are
    # those of one program per split and of the in-register walk; and the default grid stays small.
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, page, split = 4, 2, 32, 16, 128
    lens = [5, 300, 129, 700]
    width = 96  # blocks per row: 1536 positions, 12 splits of 128
    k_cache = torch.randn(len(lens) * width, page, hkv, d, generator=g)
    v_cache = torch.randn(len(lens) * width, page, hkv, d, generator=g)
    tables = torch.randperm(len(lens) * width, generator=g).view(len(lens), width).int()
    q = torch.randn(len(lens), hq, d, generator=g)
    args = (q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32))
    args += (torch.arange(len(lens) + 1, dtype=torch.int32), 0.2)
    reference = _paged_attention_triton(*args, split=split, split_programs=False)
    for grid in (1, 2, 3, 12, 16):
        assert_bitwise(_paged_attention_triton(*args, split=split, split_programs=True, split_grid=grid), reference)
    # The merge kernel's shape: query heads per program, splits loaded before they are merged (past a row's last
    # split the loads are masked off; 6 splits in chunks of 4 ends on two of them, in chunks of 8 on six).
    for heads in (1, 2, 4):
        for chunk in (1, 4, 8):
            launch = dict(split_programs=True, inline_splits=0, merge_heads=heads, merge_chunk=chunk)
            assert_bitwise(_paged_attention_triton(*args, split=split, **launch), reference)
    assert [_merge_heads(t, 32, num_sms=132) for t in (1, 8, 16, 64, 256)] == [1, 1, 1, 4, 16]
    # Rows of at most ``inline_splits`` splits (these have 1, 3, 2 and 6) walked in registers by split programs.
    for inline in (1, 2, 6, 100):
        out = _paged_attention_triton(*args, split=split, split_programs=True, split_grid=2, inline_splits=inline)
        assert_bitwise(out, reference)
    # The grid numbered with a tile's KV heads side by side (the default) or apart: launch order only. Output
    # columns cut into groups of 16 (2 here) across programs: a column's sum is the same whoever computes it. Block
    # ids loaded a tile ahead: addresses only. Split programs with no split of their row leaving early: which programs
    # run, not what they compute.
    for split_programs in (False, True):
        for launch in (dict(heads_inner=False), dict(col_groups=2), dict(col_groups=2, heads_inner=False),
                       dict(ids_ahead=True), dict(skip_empty=True), dict(skip_empty=False)):  # fmt: skip
            out = _paged_attention_triton(*args, split=split, split_programs=split_programs, **launch)
            assert_bitwise(out, reference)
    with pytest.raises(ValueError, match="col_groups"):
        _paged_attention_triton(*args, split=split, col_groups=4)  # 8 columns: too few for a dot
    # A decode step maps tile s to sequence s directly; with a two-token sequence added, the tiles are found by the
    # search instead: the decode rows keep their bits.
    q5 = torch.cat([q, torch.randn(2, hq, d, generator=g)])
    lens5 = torch.tensor(lens + [40], dtype=torch.int32)
    tables5 = torch.cat([tables, tables[:1]])
    starts5 = torch.tensor([0, 1, 2, 3, 4, 6], dtype=torch.int32)
    mixed = _paged_attention_triton(q5, k_cache, v_cache, tables5, lens5, starts5, 0.2, split=split)
    assert_bitwise(mixed[: len(lens)], reference)
    assert _split_grid(max_splits=80, programs=160 * 8, num_sms=132) == 4  # batch 128, 40k max_model_len
    assert _split_grid(max_splits=8, programs=80 * 8, num_sms=132) == 8  # batch 64, 4k: as measured
    assert _split_grid(max_splits=80, programs=8, num_sms=132) == 64  # batch 1


def test_cpu_bmm_entry_is_independent_of_the_batch():
    # The CPU path relies on this: aten.bmm's result for one entry of its fixed per-entry shape does not depend
    # on how many entries the call has or where the entry sits (true of MKL here; re-check on a new CPU BLAS).
    g = torch.Generator().manual_seed(0)
    rows = _CPU_ROWS * 3
    a = torch.randn(40, rows, 64, generator=g)
    b = torch.randn(40, TILE, 64, generator=g).transpose(1, 2)  # the layout the CPU path uses
    whole = _bmm(a, b)
    for lo, hi in [(0, 1), (7, 8), (3, 9), (0, 17), (21, 40)]:
        assert_bitwise(_bmm(a[lo:hi], b[lo:hi]), whole[lo:hi])


def test_cpu_plan_and_chunks_do_not_change_bits(monkeypatch):
    # The engine builds one plan per step and hands it to every layer; a long batch is cut into chunks of
    # entries. Neither may change a bit. (A chunk budget of 1 byte puts every entry in a chunk of its own.)
    seqs = [Seq(n, 9, 3, 64, torch.float32, seed=i) for i, n in enumerate([300, 70, 5, 129])]
    paged = Paged(3, 64, torch.float32)
    items = [("a", seqs[0], 0, 300), ("b", seqs[1], 69, 70), ("c", seqs[2], 0, 5), ("d", seqs[3], 100, 129)]
    for name, seq, _, end in items:
        paged.write(name, seq, 0, end)
    whole = paged.attend(cpu(128), items)

    def with_plan(q, k_cache, v_cache, tables, seq_lens, query_start_loc, scale):
        plan = cpu_attention_plan(tables, seq_lens, query_start_loc, k_cache.shape, q.shape[1])
        assert len(plan.chunks) == expected_chunks
        return _paged_attention_cpu(q, k_cache, v_cache, tables, seq_lens, query_start_loc, scale, split=128, plan=plan)

    expected_chunks = 2  # one per entry height: b's decode row has a short entry of its own (_short_entries_ok)
    for out, ref in zip(paged.attend(with_plan, items), whole, strict=True):
        assert_bitwise(out, ref)
    monkeypatch.setattr(attention_cpu, "_CPU_CHUNK_BYTES", 1)
    expected_chunks = 75 + 1 + 2 + 8  # one per entry of _CPU_ROWS query tokens (b's of one)
    for out, ref in zip(paged.attend(with_plan, items), whole, strict=True):
        assert_bitwise(out, ref)


def test_cpu_decode_rows_take_short_entries_only_where_the_probe_allows(monkeypatch):
    # A decode row gets an entry of its own (group rows padded to 4, not _CPU_ROWS tokens' worth) only where a probe
    # found the bmm's rows equal at both heights (attention_cpu._short_entries_ok). Negative control: a BLAS whose
    # short calls sum in another order (here fp64 below the tall height). Taken without the probe, the decode row's
    # bits move off the prefill's, which the harness sees; with the probe the short entries are refused.
    seq = Seq(150, 9, 3, 64, torch.float32, seed=1)
    paged = Paged(3, 64, torch.float32)
    paged.write("t", seq, 0, 150)
    prefill = paged.attend(cpu(128), [("t", seq, 0, 150)])[0]
    tables, lens, starts = (
        torch.tensor([paged.tables["t"]], dtype=torch.int32),
        torch.tensor([150]),
        torch.tensor([0, 1]),
    )
    plan = cpu_attention_plan(tables, lens.int(), starts.int(), paged.k.shape, 9)
    assert [c.n_rows for c in plan.chunks] == [4]  # as on the 2-core machines: the probe passed
    real = attention_cpu._bmm

    def other_order(a, b):
        return real(a, b) if a.shape[1] >= _CPU_ROWS * 3 else (a.double() @ b.double()).float()

    monkeypatch.setattr(attention_cpu, "_bmm", other_order)
    monkeypatch.setattr(attention_cpu, "_short_ok", {})
    decode = [("t", seq, p, p + 1) for p in (0, 63, 64, 149)]
    for _, _, p, _ in decode:
        assert_bitwise(paged.attend(cpu(128), [("t", seq, p, p + 1)])[0], prefill[p : p + 1])
    assert attention_cpu._short_ok and not any(attention_cpu._short_ok.values())
    monkeypatch.setattr(attention_cpu, "_short_entries_ok", lambda *args: True)
    outs = [paged.attend(cpu(128), [item])[0] for item in decode]
    assert any(not torch.equal(o, prefill[p : p + 1]) for o, (_, _, p, _) in zip(outs, decode, strict=True))


def test_cpu_bits_do_not_depend_on_the_thread_count():
    # Small steps run on one thread (_CPU_SERIAL_ENTRIES), large ones on all: the same bits either way.
    seq = Seq(300, 9, 3, 64, torch.float32, seed=1)
    paged = Paged(3, 64, torch.float32)
    paged.write("t", seq, 0, 300)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged.attend(cpu(128), [("t", seq, 0, 300)])[0]
        torch.set_num_threads(max(2, threads))
        assert_bitwise(paged.attend(cpu(128), [("t", seq, 0, 300)])[0], one)
        assert torch.get_num_threads() == max(2, threads)  # restored after the step
    finally:
        torch.set_num_threads(threads)


def test_cpu_plan_for_other_caches_is_refused():
    seq = Seq(20, 4, 2, 32, torch.float32, seed=0)
    paged = Paged(2, 32, torch.float32)
    paged.write("t", seq, 0, 20)

    def wrong_plan(q, k_cache, v_cache, tables, seq_lens, query_start_loc, scale):
        plan = cpu_attention_plan(tables, seq_lens, query_start_loc, k_cache.shape, 2 * q.shape[1])
        return paged_attention(q, k_cache, v_cache, tables, seq_lens, query_start_loc, scale, plan=plan)

    with pytest.raises(ValueError, match="plan was made for other"):
        paged.attend(wrong_plan, [("t", seq, 0, 20)])


def test_cpu_same_bits_inside_batch_invariant_mode():
    # The model runs under batch_invariant_mode; the CPU path must not route through (or recurse into) its
    # overrides, and must give the same bits either way.
    from lockstep.ops.mode import batch_invariant_mode

    seq = Seq(200, 9, 3, 64, torch.float32, seed=1)
    paged = Paged(3, 64, torch.float32)
    paged.write("t", seq, 0, 200)
    outside = paged.attend(cpu(128), [("t", seq, 0, 200)])[0]
    with batch_invariant_mode():
        inside = paged.attend(cpu(128), [("t", seq, 0, 200)])[0]
    assert_bitwise(inside, outside)


# --------------------------------------------------------------------------------- large caches, launch


def test_block_ids_past_2_31_cache_elements():
    # A cache of more than 2^31 elements (64 sequences x 32k positions x 8 KV heads x head_dim 128 is exactly
    # 2^31) needs int64 offsets: block * stride_kb wraps in int32. torch.empty only reserves address space, and
    # only the pages written get memory; a guard of 2^31 elements in front of the cache is where a wrapped
    # offset would land, so that bug reads zeros and fails here instead of crashing. K and V share the one big
    # cache (K = V) to halve the reservation. Top block ids must give the bits of the same data in a small cache.
    page, hkv, d, hq, n = 16, 1, 16, 2, 150
    per_block = page * hkv * d
    num_blocks = (1 << 31) // per_block + 8
    try:
        buffer = torch.empty((1 << 31) + num_blocks * per_block, dtype=torch.float16)
    except RuntimeError as e:
        pytest.skip(f"cannot reserve 8 GiB of address space: {e}")
    big = buffer[1 << 31 :].view(num_blocks, page, hkv, d)
    small = torch.full((10, page, hkv, d), float("nan"), dtype=torch.float16)
    seq = Seq(n, hq, hkv, d, torch.float16, seed=3)
    top = [num_blocks - 1, num_blocks - 7, 5, num_blocks - 2, num_blocks - 3, 0, num_blocks - 8, 2, 9, 1]
    pos = torch.arange(n)
    outs = {}
    for name, cache, table, writer in [
        ("small", small, list(range(10)), write_kv),
        ("big", big, top, _write_kv_triton),
    ]:
        slots = (torch.tensor(table)[pos // page] * page + pos % page).to(torch.int32)  # int32 like block ids
        writer(seq.k, seq.k, cache, cache, slots)
        assert torch.equal(cache.view(-1, hkv, d)[slots], seq.k)
        args = (seq.q, cache, cache, torch.tensor([table], dtype=torch.int32))
        args += (torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), 0.17)
        for launch in [dict(split_programs=True), dict(split_programs=False)]:
            outs[name, str(launch)] = _paged_attention_triton(*args, split=128, **launch)
        outs[name, "cpu"] = paged_attention(*args)
    for (name, path), out in outs.items():
        if name == "big":
            assert_bitwise(out, outs["small", path])


def test_default_launch_path():
    # H200 decode shapes (32 q / 8 kv heads, head_dim 128, split 512, 132 SMs): split programs whenever the
    # partials fit, the in-register walk above the cap; prefill splits only when its grid cannot fill the GPU.
    def choose(num_tokens, context, decode, programs):
        max_splits = -(-context // 512)
        part_bytes = num_tokens * max_splits * 32 * 130 * 4
        return _use_split_programs(decode, max_splits, programs, part_bytes, num_sms=132)

    for batch, context in [(1, 4096), (8, 4096), (64, 4096), (64, 32768), (200, 32768)]:
        assert choose(batch, context, True, programs=(batch // 4 + batch) * 8), (batch, context)
    assert choose(256, 40960, True, programs=256 * 8)  # 340 MB of partials: a graph under Qwen3's max_model_len
    assert not choose(256, 65536, True, programs=320 * 8)  # 545 MB
    assert 256 * 128 * 32 * 130 * 4 > _PART_CAP_BYTES
    assert not choose(1, 512, True, programs=8)  # one split: nothing to merge
    assert not choose(4096, 4096, False, programs=257 * 8)  # a long prefill fills the GPU by itself
    assert choose(100, 4096, False, programs=8 * 8)  # a short chunk after a long context does not
    # Decode rows of up to 4 splits walk in registers once the grid has ~1.5 programs per SM; below, only rows of 1.
    assert [_inline_splits(batch * 8, num_sms=132) for batch in (1, 8, 16, 32, 256)] == [1, 1, 1, 4, 4]
    # Block ids a tile ahead from ~1.5 programs per SM, empty split programs leaving early from batch 8: decode only.
    assert [_ids_ahead(True, b * 8, num_sms=132) for b in (1, 8, 16, 32, 256)] == [False] * 3 + [True] * 2
    assert [_skip_empty(True, b * 8, num_sms=132) for b in (1, 4, 8, 256)] == [False] * 2 + [True] * 2
    assert not _ids_ahead(False, 256 * 8, num_sms=132) and not _skip_empty(False, 256 * 8, num_sms=132)
    # Two column groups for batch-1/4 decode at head_dim 128, never for a 16-column head (groups of 8 cannot run).
    assert [_col_groups(True, b * 8, num_sms=132, d_pad=128) for b in (1, 4, 8)] == [2, 2, 1]
    assert _col_groups(True, 8, num_sms=132, d_pad=16) == 1 and _col_groups(False, 8, num_sms=132, d_pad=128) == 1


def test_split_must_be_tile_times_a_power_of_two():
    paged = Paged(1, 16, torch.float32)
    seq = Seq(10, 2, 1, 16, torch.float32, seed=0)
    paged.write("t", seq, 0, 10)
    with pytest.raises(ValueError, match="power of two"):
        paged.attend(triton_(split=3 * TILE), [("t", seq, 0, 10)])


# ------------------------------------------------------------------------------------ negative control


def test_negative_control_split_count_changes_bits():
    # A kernel with a fixed number of splits (here 2) sizes its splits from the context, so a decode step sees
    # different split boundaries than the prefill of the same sequence: the numbers agree, the bits do not.
    n = 300
    seq = Seq(n, 9, 3, 64, torch.float32, seed=1)
    paged = Paged(3, 64, torch.float32)
    paged.write("t", seq, 0, n)

    def two_splits(context: int) -> int:
        return -(-context // (2 * TILE)) * TILE

    positions = [100, 150, 200, 250, 299]
    prefill = paged.attend(cpu(two_splits(n)), [("t", seq, 0, n)])[0][positions]
    decode = torch.cat([paged.attend(cpu(two_splits(p + 1)), [("t", seq, p, p + 1)])[0] for p in positions])
    torch.testing.assert_close(decode, prefill, atol=1e-5, rtol=0)
    with pytest.raises(AssertionError, match="differ in bits"):
        assert_bitwise(decode, prefill)


# -------------------------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("writer", [write_kv, _write_kv_triton])
def test_write_kv_places_tokens_and_skips_minus_one(writer):
    k = torch.randn(5, 3, 32)
    v = torch.randn(5, 3, 32)
    k_cache = torch.zeros(4, 7, 3, 32)
    v_cache = torch.zeros(4, 7, 3, 32)
    slots = torch.tensor([3, 27, -1, 8, 14])
    writer(k, v, k_cache, v_cache, slots)
    kf, vf = k_cache.view(-1, 3, 32), v_cache.view(-1, 3, 32)
    keep = torch.tensor([0, 1, 3, 4])
    assert torch.equal(kf[slots[keep]], k[keep]) and torch.equal(vf[slots[keep]], v[keep])
    untouched = torch.ones(28, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert not kf[untouched].any() and not vf[untouched].any()
