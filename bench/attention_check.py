"""Correctness, bitwise invariance and decode speed of lockstep's paged attention (Triton) on a GPU.

    python bench/attention_check.py            # H200: 32 q / 8 kv heads, head_dim 128, bf16, page 16
    python bench/attention_check.py --smoke    # tiny shapes; without a GPU it runs through the Triton interpreter

Values: prefill and decode against an fp32 reference (torch SDPA on the gathered, upcast K/V).
Invariance: every output row of a target sequence (crossing several splits) must have the same bits from a
one-shot prefill, chunked prefills, decode steps inside batches of 1..64 sequences with contexts up to 32k,
a prefill inside a mixed batch, a prefix hit, other physical blocks, and every launch shape (BLOCK_M, warps,
split programs + merge kernel vs in-register merge). This is where the kernel's claim that the MMA row count
does not change a row's bits gets checked. Exits 1 if anything fails.
Speed: decode (one query per sequence) against F.scaled_dot_product_attention on contiguous K/V, and a causal
prefill, timed in CUDA graphs.

Launch options timed side by side (every one must give the default's bits): split programs with 1 or 4 splits of a
row walked in registers (``inline_splits``), the in-register path, stages 2-4, a tile's KV heads apart instead of
side by side (``heads_inner``) and 1, 2 or 4 column groups per KV head (``col_groups``; the defaults were picked
here), a register cap of 168 (``maxnreg``: three programs per SM instead of two), block ids loaded a tile ahead
(``ids_ahead``) and split programs with nothing to do leaving early or not (``skip_empty``). Decode is also timed
by page size, 16 to 128 positions (the engine's ``block_size``; a K/V tile gathers 4 pages at 16), with the cache
stored heads-outer (HND), and with blocks placed as the engine's allocator places them, with the same bits required
everywhere. ``--only wide|pages|fastmode|merge|gluon`` runs one table (merge: the merge kernel's shapes and the split
grid, with the default launch's kernels timed apart by torch.profiler; gluon: the Gluon prefill walk's bits only).

``--only fastmode`` times the fast (``default``) kernel set's decode attention against the invariant launch at batch
1/16/64 x context 1k/8k/32k: as a CUDA graph step sees it (a 40,960-position table, no host lengths) and as an eager
step does (the batch's own table width, the lengths on the host), beside the rule it replaced and fixed split sizes
256-4096 (to fit ``layers.torch_kernels.split_for_batch``'s constants). Its values must match the invariant launch's
to bf16 rounding and a graph step's must be the invariant bits.
"""

import argparse
import copy
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from lockstep.layers.batch import HOST_SEQ_LENS, AttentionMetadata  # noqa: E402
from lockstep.layers.torch_kernels import batch_split_attention, split_for_batch  # noqa: E402
from lockstep.ops._common import num_sms  # noqa: E402
from lockstep.ops.attention import FP8_KV, SPLIT, TILE, write_kv  # noqa: E402
from lockstep.ops.attention.launch import _paged_attention_triton  # noqa: E402

FAILURES: list[str] = []
KV_DTYPE: torch.dtype | None = None  # --kv-cache-dtype fp8: caches of e4m3 (None: the queries' dtype)


def kv_values(*shape, gen, device, dtype):
    """Random K or V rows; with an FP8 cache, values it holds exactly (e4m3), so a bf16 twin holds the same."""
    x = torch.randn(*shape, generator=gen).to(device, dtype)
    return x.to(FP8_KV).to(dtype) if KV_DTYPE == FP8_KV else x


class Cache:
    """A paged cache; sequences are written through write_kv into blocks taken in a shuffled order."""

    def __init__(self, num_blocks, page, hkv, d, dtype, device, seed):
        self.page = page
        self.k = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=KV_DTYPE or dtype, device=device)
        self.v = torch.full_like(self.k, float("nan"))
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[str, list[int]] = {}

    def write(self, name, kv, start, end, shared=()):
        table = self.tables.setdefault(name, list(shared))
        while len(table) * self.page < end:
            table.append(self.free.pop())
        pos = torch.arange(start, end)
        slots = (torch.tensor(table)[pos // self.page] * self.page + pos % self.page).to(self.k.device)
        write_kv(kv[0][start:end], kv[1][start:end], self.k, self.v, slots)

    def batch(self, items, queries):
        """items: (name, start, end); queries: name -> q [len, hq, d]. Returns the kernel's arguments."""
        device = self.k.device
        width = max(len(self.tables[n]) for n, _, _ in items)
        tables = torch.full((len(items), width), -1, dtype=torch.int32)
        for i, (n, _, _) in enumerate(items):
            tables[i, : len(self.tables[n])] = torch.tensor(self.tables[n])
        q = torch.cat([queries[n][s:e] for n, s, e in items])
        counts = torch.tensor([0] + [e - s for _, s, e in items])
        return dict(
            q=q,
            k_cache=self.k,
            v_cache=self.v,
            block_tables=tables.to(device),
            seq_lens=torch.tensor([e for _, _, e in items], dtype=torch.int32, device=device),
            query_start_loc=counts.cumsum(0).to(torch.int32).to(device),
        )

    def attend(self, items, queries, scale, **launch):
        out = _paged_attention_triton(**self.batch(items, queries), scale=scale, **launch)
        counts = [e - s for _, s, e in items]
        return list(out.split(counts))


def report(name, ok, detail=""):
    print(f"  {'ok  ' if ok else 'FAIL'}  {name}  {detail}")
    if not ok:
        FAILURES.append(name)


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def n_diff(a, b):
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


def reference(q, k, v, start, scale):
    """fp32 causal attention of queries at positions start.. over contiguous k, v: [len, h, d]."""
    group = q.shape[1] // k.shape[1]
    qq = q.float().transpose(0, 1)[None]
    kk = k.float().repeat_interleave(group, 1).transpose(0, 1)[None]
    vv = v.float().repeat_interleave(group, 1).transpose(0, 1)[None]
    pos = torch.arange(start, start + q.shape[0], device=q.device)
    mask = torch.arange(k.shape[0], device=q.device)[None, :] <= pos[:, None]
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)[0].transpose(0, 1)


def check_values(cfg, device, gen):
    print("values against fp32 reference")
    hq, hkv, d, dtype, page, scale = cfg["hq"], cfg["hkv"], cfg["d"], cfg["dtype"], cfg["page"], cfg["scale"]
    lengths, q_lens = cfg["value_lengths"], cfg["value_qlens"]
    cache = Cache(sum(-(-n // page) for n in lengths) + 8, page, hkv, d, dtype, device, seed=1)
    queries, kvs = {}, {}
    for i, n in enumerate(lengths):
        kvs[i] = [kv_values(n, hkv, d, gen=gen, device=device, dtype=dtype) for _ in range(2)]
        queries[f"s{i}"] = torch.randn(n, hq, d, generator=gen).to(device, dtype)
        cache.write(f"s{i}", kvs[i], 0, n)
    items = [(f"s{i}", n - ql, n) for i, (n, ql) in enumerate(zip(lengths, q_lens, strict=True))]
    for launch in cfg["launches"]:
        outs = cache.attend(items, queries, scale, **launch)
        worst = 0.0
        for i, ((name, s, e), out) in enumerate(zip(items, outs, strict=True)):
            ref = reference(queries[name][s:e], kvs[i][0][:e], kvs[i][1][:e], s, scale)
            worst = max(worst, (out.float() - ref).abs().max().item())
        report(f"max |err| {launch}", worst < cfg["atol"], f"{worst:.2e} (lengths {lengths}, q_lens {q_lens})")


def check_gluon(cfg, device, gen):
    """Hopper: the Gluon prefill walk (the default there) against the Triton kernel, bit for bit, on prefill steps:
    one-shot, chunked and mixed, up to 20k positions, pages of 8 to 128 positions, fp16, NaN in unwritten slots."""
    print("Gluon prefill walk against the Triton kernel (bits)")
    hq, hkv, d, scale = cfg["hq"], cfg["hkv"], cfg["d"], cfg["scale"]
    cases = [
        ("one-shot 4096", [(0, 4096)], {}), ("one-shot 5000", [(0, 5000)], {}),
        ("last 1000 of 5000", [(4000, 5000)], {}), ("last 37 of 5000", [(4963, 5000)], {}),
        ("37 after 1000", [(1000, 1037)], {}),
        ("four sequences", [(0, 300), (4000, 5000), (0, 17), (1948, 2048)], {}), ("64", [(0, 64)], {}),
        ("65", [(0, 65)], {}), ("513", [(0, 513)], {}), ("200 of 511", [(311, 511)], {}),
        ("last 129 of 20000", [(19871, 20000)], {}), ("page 8", [(0, 1000)], dict(page=8)),
        ("page 32", [(0, 3000)], dict(page=32)), ("page 64", [(0, 3000)], dict(page=64)),
        ("page 128, two", [(0, 700), (2401, 3001)], dict(page=128)), ("fp16", [(0, 2000)], dict(dtype=torch.float16)),
    ]  # fmt: skip
    for name, spans, kw in cases:
        page, dtype = kw.get("page", cfg["page"]), kw.get("dtype", cfg["dtype"])
        cache = Cache(sum(-(-e // page) for _, e in spans) + 4, page, hkv, d, dtype, device, seed=3)
        queries = {}
        for i, (_, e) in enumerate(spans):
            cache.write(f"s{i}", [kv_values(e, hkv, d, gen=gen, device=device, dtype=dtype) for _ in range(2)], 0, e)
            queries[f"s{i}"] = torch.randn(e, hq, d, generator=gen).to(device, dtype)
        items = [(f"s{i}", b, e) for i, (b, e) in enumerate(spans)]
        gluon = torch.cat(cache.attend(items, queries, scale, block_m=128, split_programs=False, gluon=True))
        triton_ = torch.cat(cache.attend(items, queries, scale, block_m=128, split_programs=False, gluon=False))
        report(name, same_bits(gluon, triton_), f"{n_diff(gluon, triton_)} differ")


def check_invariance(cfg, device, gen):
    hq, hkv, d, dtype, page, scale = cfg["hq"], cfg["hkv"], cfg["d"], cfg["dtype"], cfg["page"], cfg["scale"]
    n = cfg["target"]
    print(f"bitwise invariance: target of {n} positions ({-(-n // cfg['split'])} splits of {cfg['split']})")
    split = dict(split=cfg["split"])
    others = cfg["neighbours"]
    blocks = (2 * n + sum(others) + len(others) * page) // page + 16
    cache = Cache(blocks, page, hkv, d, dtype, device, seed=2)
    kv = [kv_values(n, hkv, d, gen=gen, device=device, dtype=dtype) for _ in range(2)]
    queries = {"t": torch.randn(n, hq, d, generator=gen).to(device, dtype)}
    cache.write("t", kv, 0, n)
    for i, m in enumerate(others):
        okv = [kv_values(m, hkv, d, gen=gen, device=device, dtype=dtype) for _ in range(2)]
        queries[f"o{i}"] = torch.randn(m, hq, d, generator=gen).to(device, dtype)
        cache.write(f"o{i}", okv, 0, m)

    ref = cache.attend([("t", 0, n)], queries, scale, **split)[0]

    def compare(name, out, rows=slice(None)):
        report(name, same_bits(out, ref[rows]), "" if same_bits(out, ref[rows]) else f"{n_diff(out, ref[rows])} differ")

    for launch in cfg["launches"]:
        compare(f"one-shot prefill, launch {launch}", cache.attend([("t", 0, n)], queries, scale, **split, **launch)[0])
    if KV_DTYPE == FP8_KV:  # the e4m3 cache read as the bf16 cache of the same values, launch by launch
        twin = copy.copy(cache)  # the same block tables
        twin.k, twin.v = cache.k.to(dtype), cache.v.to(dtype)
        decode = [("t", n - 1, n)] + [(f"o{i}", m - 1, m) for i, m in enumerate(others)]
        for kind, items, launches in (("prefill", [("t", 0, n)], cfg["launches"]),
                                      ("decode", decode, cfg["decode_launches"])):  # fmt: skip
            for launch in [{}, *launches]:
                a = cache.attend(items, queries, scale, **split, **launch)[0]
                b = twin.attend(items, queries, scale, **split, **launch)[0]
                report(f"e4m3 cache == bf16 cache of its values, {kind}, launch {launch or 'default'}",
                       same_bits(a, b), "" if same_bits(a, b) else f"{n_diff(a, b)} differ")  # fmt: skip

    for chunk in cfg["chunks"]:
        fresh = Cache(n // page + 4, page, hkv, d, dtype, device, seed=chunk)
        outs = []
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            fresh.write("t", kv, s, e)
            outs += fresh.attend([("t", s, e)], queries, scale, **split)
        compare(f"chunked prefill, chunks of {chunk}", torch.cat(outs))

    positions = sorted({0, 1, TILE - 1, TILE, cfg["split"] - 1, cfg["split"], cfg["split"] + 1, n - 1}
                       | set(torch.randint(0, n, (cfg["decode_samples"],), generator=gen).tolist()))  # fmt: skip
    for batch_size in cfg["decode_batches"]:
        for launch in [{}] + cfg["decode_launches"]:
            outs = []
            for j, p in enumerate(positions):
                # neighbours decode at random points of their contexts; the target sits at a rotating slot
                items = []
                for i in range(batch_size - 1):
                    o = (j + i) % len(others)
                    x = int(torch.randint(0, others[o], (1,), generator=gen))
                    items.append((f"o{o}", x, x + 1))
                slot = j % batch_size
                items.insert(slot, ("t", p, p + 1))
                outs.append(cache.attend(items, queries, scale, **split, **launch)[slot])
            compare(f"decode in batches of {batch_size}, launch {launch or 'default'}", torch.cat(outs), positions)

    mixed = [("o0", 0, min(others[0], 300)), ("t", 0, n)] + [(f"o{i}", m - 1, m) for i, m in enumerate(others)]
    compare("prefill inside a mixed prefill/decode batch", cache.attend(mixed, queries, scale, **split)[1])

    hit = (n // 2) // page * page
    cache.write("hit", kv, hit, n, shared=cache.tables["t"][: hit // page])
    queries["hit"] = queries["t"]
    suffix = cache.attend([("o1", others[1] - 5, others[1]), ("hit", hit, n)], queries, scale, **split)[1]
    compare("prefix hit (shared blocks, suffix only)", suffix, slice(hit, n))

    moved = Cache(n // page + 50, page, hkv, d, dtype, device, seed=99)
    moved.write("t", kv, 0, n)
    compare("other physical blocks", moved.attend([("t", 0, n)], queries, scale, **split)[0])

    # Negative control: a different split size must change bits (the harness can see a difference).
    other = cache.attend([("t", 0, n)], queries, scale, split=cfg["split"] * 2)[0]
    report("negative control: split size x2 changes bits", not same_bits(other, ref), f"{n_diff(other, ref)} differ")


def us(fn):
    from triton.testing import do_bench_cudagraph

    # do_bench_cudagraph runs fn on a fresh side stream, which does not wait for the default stream. Without
    # this sync the first call read block tables, seq_lens and query_start_loc that the default stream had
    # not written yet (still behind 8 GB of torch.randn at batch 64 / 32k): garbage block ids, then an
    # illegal memory access. That is how this script crashed; the kernel's offsets are int64.
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def bench_speed(cfg, device):
    hq, hkv, d, dtype, page = cfg["hq"], cfg["hkv"], cfg["d"], cfg["dtype"], cfg["page"]
    scale = cfg["scale"]
    decode_launches = {
        "lockstep": {},
        "(in-register)": {"split_programs": False},
        "(split, st 2)": {"split_programs": True, "num_stages": 2},
        "(split, st 3)": {"split_programs": True, "num_stages": 3},
        "(split, st 4)": {"split_programs": True, "num_stages": 4},
        "(split 256)": {"split": 256},
        "(split 128)": {"split": 128},
        "(heads outer)": {"heads_inner": False},
        "(1 col group)": {"col_groups": 1},
        "(2 col groups)": {"col_groups": 2},
        "(4 col groups)": {"col_groups": 4},
    }
    print("\ndecode: us per call (TB/s reading K+V)")
    print(f"  {'B':>3} {'ctx':>6} | " + " ".join(f"{n:>16}" for n in decode_launches) + f" | {'SDPA':>16}")
    for ctx in cfg["speed_ctx"]:
        for b in cfg["speed_batches"]:
            nblk = b * ctx // page
            k_cache = torch.randn(nblk, page, hkv, d, device=device, dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            tables = torch.randperm(nblk, device=device).view(b, ctx // page).int()
            q = torch.randn(b, hq, d, device=device, dtype=dtype)
            args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                        seq_lens=torch.full((b,), ctx, device=device, dtype=torch.int32),
                        query_start_loc=torch.arange(b + 1, device=device, dtype=torch.int32))  # fmt: skip
            gbytes = 2 * b * ctx * hkv * d * k_cache.element_size() / 1e9
            times = [us(lambda la=la: _paged_attention_triton(**args, scale=scale, **la))
                     for la in decode_launches.values()]  # fmt: skip
            kc = k_cache[tables.long()].view(b, ctx, hkv, d).transpose(1, 2)  # [B, H_kv, ctx, D]
            vc = v_cache[tables.long()].view(b, ctx, hkv, d).transpose(1, 2)
            qs = q[:, :, None]
            try:
                sdpa = us(lambda: F.scaled_dot_product_attention(qs, kc, vc, scale=scale, enable_gqa=True))
            except (RuntimeError, TypeError):
                kr, vr = kc.repeat_interleave(hq // hkv, 1), vc.repeat_interleave(hq // hkv, 1)
                sdpa = us(lambda: F.scaled_dot_product_attention(qs, kr, vr, scale=scale))
            cells = [f"{t:8.1f} ({gbytes / t * 1e3:4.2f})" for t in times + [sdpa]]
            print(f"  {b:3d} {ctx:6d} | " + " ".join(f"{c:>16}" for c in cells[:-1]) + f" | {cells[-1]:>16}")
            del k_cache, v_cache, kc, vc, args

    bench_wide(cfg, device)
    bench_pages(cfg, device)
    print("\ncausal prefill, S sequences of n tokens: us (TFLOP/s)")
    for seqs, n in cfg["speed_prefill"]:
        k_cache = torch.randn(seqs * n // page, page, hkv, d, device=device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(seqs * n, hq, d, device=device, dtype=dtype)
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache,
                    block_tables=torch.arange(seqs * n // page, device=device, dtype=torch.int32).view(seqs, -1),
                    seq_lens=torch.full((seqs,), n, device=device, dtype=torch.int32),
                    query_start_loc=torch.arange(0, seqs * n + 1, n, device=device, dtype=torch.int32))  # fmt: skip
        flops = seqs * 4 * n * n * hq * d / 2
        reference = _paged_attention_triton(**args, scale=scale)
        row = []
        variants = [
            dict(block_m=b, num_stages=st, heads_inner=inner, gluon=False)
            for b, st, inner in ((64, 2, True), (64, 3, True), (128, 2, True), (128, 3, True), (64, 2, False))
        ]
        if torch.cuda.get_device_capability()[0] == 9:
            variants.append(dict(block_m=128, split_programs=False, gluon=True))
        for launch in variants:
            block_m, stages, inner = launch["block_m"], launch.get("num_stages"), launch.get("heads_inner", True)
            if not torch.equal(_paged_attention_triton(**args, scale=scale, **launch), reference):
                FAILURES.append(f"prefill launch {launch} at {seqs} x {n} changed bits")
            t = us(lambda la=launch: _paged_attention_triton(**args, scale=scale, **la))
            name = "Gluon" if launch.get("gluon") else f"BLOCK_M {block_m} st {stages}{'' if inner else ' heads outer'}"
            row.append(f"{name}: {t:9.1f} ({flops / t / 1e6:5.1f})")
        qs = q.view(seqs, n, hq, d).transpose(1, 2)
        kc = k_cache.view(seqs, n, hkv, d).transpose(1, 2)
        vc = v_cache.view(seqs, n, hkv, d).transpose(1, 2)
        t = us(lambda: F.scaled_dot_product_attention(qs, kc, vc, is_causal=True, scale=scale, enable_gqa=True))
        print(f"  {seqs} x {n:6d}  lockstep " + "  ".join(row) + f"  | SDPA {t:9.1f} ({flops / t / 1e6:5.1f})")


def wide_case(cfg, device, lens):
    """Decode launch arguments for rows of ``lens`` positions over a ``cfg["wide"]``-position block table (what a
    CUDA graph step sees), each row's blocks taken in a shuffled order."""
    hq, hkv, d, dtype, page = cfg["hq"], cfg["hkv"], cfg["d"], cfg["dtype"], cfg["page"]
    b = len(lens)
    nblk = sum(-(-n // page) for n in lens)
    k_cache = torch.randn(nblk, page, hkv, d, device=device, dtype=dtype)
    blocks = torch.randperm(nblk, device=device).int()
    tables = torch.zeros(b, -(-cfg["wide"] // page), device=device, dtype=torch.int32)
    used = 0
    for row, n in enumerate(lens):
        tables[row, : -(-n // page)] = blocks[used : used + -(-n // page)]
        used += -(-n // page)
    return dict(q=torch.randn(b, hq, d, device=device, dtype=dtype), k_cache=k_cache, v_cache=torch.randn_like(k_cache),
                block_tables=tables, seq_lens=torch.tensor(lens, device=device, dtype=torch.int32),
                query_start_loc=torch.arange(b + 1, device=device, dtype=torch.int32), scale=cfg["scale"])  # fmt: skip


def time_launches(args, launches, where):
    """(us, same bits as the default launch) for each launch; a launch with other bits is a failure."""
    reference = _paged_attention_triton(**args)
    cells = []
    for launch in launches.values():
        same = torch.equal(_paged_attention_triton(**args, **launch), reference)
        if not same:
            FAILURES.append(f"decode launch {launch} at {where} changed bits")
        t = us(lambda la=launch: _paged_attention_triton(**args, **la)) if args["q"].is_cuda else float("nan")
        cells.append((t, same))
    return cells


def bench_wide(cfg, device):
    hkv, d = cfg["hkv"], cfg["d"]
    # What a CUDA-graph decode step sees: a block table as wide as max_model_len (here 40,960 positions, Qwen3's),
    # whatever the context. The default launch against split programs with S = 0 / 1 / 4 / all rows walked in
    # registers by their first program (``inline_splits``), and the in-register path; uniform contexts, then one
    # long row among short ones (where walking every row in registers leaves one program with all of its work).
    # Every launch must give the default's bits ("!" marks one that does not, and fails the run).
    wide = cfg["wide"]
    launches = {"default": {}, "in-register": dict(split_programs=False)}
    for label, inline in (("S1", 1), ("S4", 4)):
        launches[label] = dict(split_programs=True, inline_splits=inline)
    launches["1 col group"] = dict(col_groups=1)
    launches["2 col groups"] = dict(col_groups=2)  # 128 registers and 54 KB: 4 programs per SM, each reading all of K
    launches["empties stay"] = dict(skip_empty=False)  # split programs with nothing to do load the query first
    launches["empties leave"] = dict(skip_empty=True)  # ... or leave after the row's length (the default from batch 8)
    launches["168 regs"] = dict(maxnreg=168)  # 3 programs per SM (ptxas gives the default launch ~200 at 4 warps)
    launches["ids in split"] = dict(ids_ahead=False)  # the default below ~1.5 programs per SM
    launches["ids ahead"] = dict(ids_ahead=True)  # no layout conversions in the tile loop, ~15 more registers
    print(f"\ndecode over a {wide:,}-position block table: us per call (the default's TB/s reading K+V)")
    print(f"  {'B':>3} {'contexts':>12} | " + " ".join(f"{n:>11}" for n in launches))
    batches = [1, 2, 4] + cfg["speed_batches"][1:] + [128, 256]
    cases = [(b, [ctx] * b) for b in batches for ctx in (128, 1024, 2048, 4096)]
    cases += [(b, [long] + [short] * (b - 1)) for b in (8, 64, 256) for long, short in ((32768, 1024), (4096, 512))]
    for b, lens in cases:
        args = wide_case(cfg, device, lens)
        k_cache = args["k_cache"]
        cells = time_launches(args, launches, f"batch {b}")
        gbytes = 2 * sum(lens) * hkv * d * k_cache.element_size() / 1e9
        label = f"{lens[0]}" if len(set(lens)) == 1 else f"{lens[0]}+{lens[1]}s"
        row = " ".join(f"{t:10.1f}{' ' if same else '!'}" for t, same in cells)
        print(f"  {b:3d} {label:>12} | {row}  ({gbytes / cells[0][0] * 1e3:.2f} TB/s)")
        del k_cache, args


def bench_pages(cfg, device):
    hq, hkv, d, dtype, scale = cfg["hq"], cfg["hkv"], cfg["d"], cfg["dtype"], cfg["scale"]
    wide = cfg["wide"]
    # The page size (the engine's block_size) only enters address arithmetic: the same K/V at pages of 16 to 128
    # positions must give the same bits, and larger pages make a K/V tile fewer, longer runs of memory. So does the
    # cache's layout: "HND" stores a block as [kv_heads, page, head_dim] (FlashInfer's; the kernel reads it through a
    # permuted view's strides), so a KV head's page is one run of page * head_dim elements. And where the blocks sit:
    # shuffled over the cache, or "in order" as the engine's allocator hands them to prefills (sequence s in blocks
    # s * n .. s * n + n - 1, so at 1k context every sequence starts a multiple of 2 MB into a layer's cache), or in
    # order with one spare block between sequences ("gap"), which breaks that alignment.
    print(f"\ndecode by page size, layout and block placement over a {wide:,}-position table: us per call (TB/s)")
    layouts = [(pg, outer, "shuffled") for pg in (16, 32, 64, 128) for outer in (False, True)]
    layouts += [(16, False, "in order"), (16, False, "gap")]
    labels = [f"page {p}" + (" HND" if o else "") + ("" if at == "shuffled" else f" {at}") for p, o, at in layouts]
    print(f"  {'B':>3} {'ctx':>6} | " + " ".join(f"{label:>16}" for label in labels))
    for b, ctx in ((1, 1024), (64, 1024), (64, 4096), (256, 1024), (256, 2048)):
        k_seq = torch.randn(b, ctx, hkv, d, device=device, dtype=dtype)
        v_seq = torch.randn_like(k_seq)
        q = torch.randn(b, hq, d, device=device, dtype=dtype)
        gbytes = 2 * k_seq.numel() * k_seq.element_size() / 1e9
        cells, first = [], None
        for pg, outer, at in layouts:
            per_seq = ctx // pg
            step = per_seq + (at == "gap")  # blocks from one sequence's first to the next's
            if at == "shuffled":
                order = torch.randperm(b * per_seq, device=device)  # page j of sequence s sits in block order[s, j]
            else:
                order = (
                    torch.arange(b, device=device)[:, None] * step + torch.arange(per_seq, device=device)
                ).flatten()
            nblk = b * step
            shape = (nblk, hkv, pg, d) if outer else (nblk, pg, hkv, d)
            caches = []
            for seq in (k_seq, v_seq):
                cache = torch.empty(shape, device=device, dtype=dtype)
                pages = seq.reshape(b * per_seq, pg, hkv, d)
                cache[order] = pages.transpose(1, 2) if outer else pages
                caches.append(cache.transpose(1, 2) if outer else cache)  # always viewed as [block, page, head, D]
            tables = torch.zeros(b, wide // pg, device=device, dtype=torch.int32)
            tables[:, :per_seq] = order.view(b, per_seq).int()
            args = dict(q=q, k_cache=caches[0], v_cache=caches[1], block_tables=tables,
                        seq_lens=torch.full((b,), ctx, device=device, dtype=torch.int32),
                        query_start_loc=torch.arange(b + 1, device=device, dtype=torch.int32), scale=scale)  # fmt: skip
            out = _paged_attention_triton(**args)
            first = out if first is None else first
            same = torch.equal(out, first)
            if not same:
                FAILURES.append(
                    f"decode at page {pg} ({'HND, ' if outer else ''}{at}), batch {b}, ctx {ctx} changed bits"
                )
            t = us(lambda a=args: _paged_attention_triton(**a))
            cells.append(f"{t:7.1f}{' ' if same else '!'}({gbytes / t * 1e3:4.2f})")
            del caches, args
        print(f"  {b:3d} {ctx:6d} | " + " ".join(f"{c:>16}" for c in cells))
        del k_seq, v_seq


def old_split_for_batch(num_seqs: int, num_kv_heads: int, max_positions: int, sms: int) -> int:
    """The fast mode's decode split before issue 27: ~2 programs per SM over the block table's width."""
    wanted = max(1, -(-2 * sms // max(1, num_seqs * num_kv_heads)))
    tiles = max(1, -(-max_positions // wanted // TILE))
    return TILE * (1 << (tiles - 1).bit_length())


def fastmode_calls(cfg, device, b, ctx, sms):
    """The launches ``bench_fastmode`` times at batch ``b`` of ``ctx``-position rows, by column name."""
    hq, hkv, d, dtype, page, scale = cfg["hq"], cfg["hkv"], cfg["d"], cfg["dtype"], cfg["page"], cfg["scale"]
    wide = cfg["wide"]
    per_seq = -(-ctx // page)
    k_cache = torch.randn(b * per_seq, page, hkv, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    blocks = torch.randperm(b * per_seq, device=device).view(b, per_seq).int()
    tables = {"graph": torch.zeros(b, -(-wide // page), device=device, dtype=torch.int32), "eager": blocks}
    tables["graph"][:, :per_seq] = blocks
    q = torch.randn(b, hq, d, device=device, dtype=dtype)
    seq_lens = torch.full((b,), ctx, device=device, dtype=torch.int32)
    starts = torch.arange(b + 1, device=device, dtype=torch.int32)
    metas = {
        kind: AttentionMetadata(torch.zeros(0, dtype=torch.int64, device=device), tables[kind], seq_lens, starts, [],
                                scratch={HOST_SEQ_LENS: [ctx] * b} if kind == "eager" else {})
        for kind in tables
    }  # fmt: skip

    def kernel(kind, split=SPLIT):
        return lambda: _paged_attention_triton(q, k_cache, v_cache, tables[kind], seq_lens, starts, scale, split=split)

    def fast(kind):
        return lambda: batch_split_attention(q, k_cache, v_cache, metas[kind], scale, sms)

    calls = {
        "invariant": kernel("graph"),
        "fast graph": fast("graph"),
        "fast eager": fast("eager"),
        "old graph": kernel("graph", old_split_for_batch(b, hkv, wide, sms)),
        "old eager": kernel("eager", old_split_for_batch(b, hkv, per_seq * page, sms)),
    }
    return calls | {f"split {s}": kernel("eager", s) for s in cfg["fast_fixed_splits"]}


def bench_fastmode(cfg, device):
    hkv, d, wide, sms = cfg["hkv"], cfg["d"], cfg["wide"], num_sms(torch.device(device))
    fixed = cfg["fast_fixed_splits"]
    print(f"\nfast (default) vs invariant decode attention, {sms} SMs: us per call (TB/s reading K+V); graph = a "
          f"{wide:,}-position table and no host lengths, eager = the batch's own width and lengths")  # fmt: skip
    heads = ["invariant", "fast graph", "fast eager", "old graph", "old eager"] + [f"split {s}" for s in fixed]
    print(f"  {'B':>3} {'ctx':>6} {'split':>12} | " + " ".join(f"{h:>16}" for h in heads) + " | fast/inv")
    rows = []
    for ctx in cfg["fast_ctx"]:
        for b in cfg["fast_batches"]:
            calls = fastmode_calls(cfg, device, b, ctx, sms)
            outs = {name: fn() for name, fn in calls.items()}
            inv = outs["invariant"]
            if not torch.equal(outs["fast graph"], inv):
                FAILURES.append(f"fast mode's graph step at batch {b}, ctx {ctx} is not the invariant launch")
            for name, out in outs.items():
                err = (out.float() - inv.float()).abs().max().item()
                if err > cfg["atol"]:
                    FAILURES.append(f"{name} at batch {b}, ctx {ctx} is {err:.3g} from the invariant output")
            times = {name: us(fn) if device == "cuda" else float("nan") for name, fn in calls.items()}
            gbytes = 2 * b * ctx * hkv * d * inv.element_size() / 1e9
            chosen = split_for_batch([ctx] * b, hkv, sms)
            best = min([SPLIT] + fixed, key=lambda s: times.get(f"split {s}", times["invariant"]))
            ratio = min(times["fast graph"], times["fast eager"]) / times["invariant"]
            cells = [f"{times[h]:8.1f} ({gbytes / times[h] * 1e3:4.2f})" for h in heads]
            label = f"{chosen}/{old_split_for_batch(b, hkv, wide, sms)}"
            print(f"  {b:3d} {ctx:6d} {label:>12} | " + " ".join(f"{c:>16}" for c in cells) + f" | {ratio:5.2f}")
            rows.append({"batch": b, "ctx": ctx, "split": chosen, "best_fixed_split": best, "us": times})
            del calls, outs, inv
    print("  split: the fast rule's eager choice / the old rule's over the graph's table; fast/inv: the fast mode's "
          "better path over the invariant launch (the goal: <= 1.00); best fixed split per row: "
          + ", ".join(f"{r['batch']}x{r['ctx']}: {r['best_fixed_split']}" for r in rows))  # fmt: skip
    return rows


def kernel_us(fn, reps=20):
    """CUDA time per call of each kernel ``fn`` launches, by kernel name (torch.profiler), in us."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and "kernel" in ev.key:
            times[ev.key] = times.get(ev.key, 0.0) + ev.device_time_total / reps
    return times


def bench_merge(cfg, device):
    """Decode over a graph-wide block table with the merge kernel's shapes (query heads per program, splits loaded
    before they are merged) and the split grid, against SDPA on contiguous K/V; the default's kernels by profiler.
    Every launch must give the default's bits."""
    hq, hkv, d, dtype, page, scale, wide = (cfg[k] for k in ("hq", "hkv", "d", "dtype", "page", "scale", "wide"))
    h_pad = 1 << (hq - 1).bit_length()
    launches = {"default": {}, "old merge": dict(merge_heads=h_pad, merge_chunk=1)}
    for heads, chunk in ((h_pad, 4), (h_pad, 8), (4, 4), (4, 8), (1, 1), (1, 4), (1, 8)):
        if heads <= h_pad:
            launches[f"h{heads} c{chunk}"] = dict(merge_heads=heads, merge_chunk=chunk)
    launches |= {f"grid {g}": dict(split_grid=g) for g in (32, 8)}
    launches["grid 32 c8"] = dict(split_grid=32, merge_chunk=8)
    launches["in-register"] = dict(split_programs=False)
    print(f"\ndecode, merge kernel shapes, a {wide:,}-position table: us per call (TB/s reading K+V); "
          "hH cC: H query heads per merge program, C splits loaded at once")  # fmt: skip
    print(f"  {'B':>3} {'ctx':>6} | " + " ".join(f"{n:>11}" for n in launches) + f" | {'SDPA':>9} | default's kernels")
    for ctx in cfg["merge_ctx"]:
        for b in cfg["merge_batches"]:
            args = wide_case(cfg, device, [ctx] * b)
            q, k_cache, v_cache, tables = (args[k] for k in ("q", "k_cache", "v_cache", "block_tables"))
            per_seq = -(-ctx // page)
            cells = [f"{t:10.1f}{' ' if same else '!'}" for t, same in time_launches(args, launches, f"{b} x {ctx}")]
            sdpa = float("nan")
            kernels = ""
            if device == "cuda":
                kc = k_cache[tables[:, :per_seq].long()].view(b, ctx, hkv, d).transpose(1, 2)
                vc = v_cache[tables[:, :per_seq].long()].view(b, ctx, hkv, d).transpose(1, 2)
                sdpa = us(lambda q=q, kc=kc, vc=vc: F.scaled_dot_product_attention(q[:, :, None], kc, vc, scale=scale,
                                                                                  enable_gqa=True))  # fmt: skip
                split_kernels = kernel_us(lambda a=args: _paged_attention_triton(**a))
                kernels = ", ".join(f"{name[:28]} {t:.1f}" for name, t in split_kernels.items())
                del kc, vc
            gbytes = 2 * b * ctx * hkv * d * k_cache.element_size() / 1e9
            print(f"  {b:3d} {ctx:6d} | " + " ".join(cells) + f" | {sdpa:9.1f} | {kernels}  "
                  f"(SDPA {gbytes / sdpa * 1e3:.2f} TB/s)")  # fmt: skip
            del q, k_cache, v_cache, tables, args


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU via the interpreter)")
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument("--speed-only", action="store_true", help="skip the value and invariance checks")
    parser.add_argument(
        "--only",
        choices=["wide", "pages", "fastmode", "merge", "gluon"],
        help="only this decode speed table (wide: a max_model_len-wide block table; pages: by page size and layout; "
        "fastmode: the default kernel set's decode against the invariant launch), or gluon: only the Gluon prefill "
        "walk's bits against the Triton kernel's (Hopper)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="fp8: the value and invariance checks over e4m3 caches (and against bf16 twins)",
    )
    args = parser.parse_args()
    global KV_DTYPE
    KV_DTYPE = FP8_KV if args.kv_cache_dtype == "fp8" else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    launches = [dict(split_programs=sp, block_m=bm, num_warps=nw)
                for sp in (False, True) for bm, nw in ((16, 4), (32, 4), (64, 4), (64, 8), (128, 8))]  # fmt: skip
    launches += [dict(split_programs=sp, block_m=bm, num_stages=st) for sp, bm, st in
                 ((True, 16, 2), (True, 16, 4), (False, 16, 3), (False, 64, 3), (False, 128, 3))]  # fmt: skip
    launches += [dict(split_programs=sp, heads_inner=False) for sp in (False, True)]
    launches += [dict(split_programs=sp, col_groups=g) for sp in (False, True) for g in (2, 8)]
    launches += [dict(split_programs=sp, ids_ahead=True) for sp in (False, True)]
    launches = [{**la, "gluon": False} for la in launches]  # the Triton kernel, even where the Gluon one would run
    hopper = device == "cuda" and torch.cuda.get_device_capability()[0] == 9
    gluon = [dict(split_programs=False, block_m=128, gluon=True)] if hopper else []  # the Gluon walk (Hopper)
    launches += gluon
    if args.smoke:
        # The interpreter's tl.dot is numpy's matmul, whose sums follow the block shape: the smoke's launches keep
        # the default's BLOCK_M (the split-program path and the in-register walk), where a GPU's MMA would not need to.
        smoke_launches = [dict(split_programs=sp, block_m=128, gluon=False) for sp in (False, True)]
        cfg = dict(hq=4, hkv=2, d=32, dtype=torch.bfloat16, page=16, scale=32**-0.5, split=128,
                   value_lengths=[1, 17, 150], value_qlens=[1, 5, 150], atol=3e-2,
                   launches=smoke_launches, target=200, neighbours=[300, 40, 130], chunks=[64],
                   decode_batches=[1, 3], decode_launches=[dict(split_programs=True)], decode_samples=2,
                   wide=1024, fast_ctx=[100, 600], fast_batches=[1, 3], fast_fixed_splits=[256, 1024],
                   merge_ctx=[600], merge_batches=[1, 3])  # fmt: skip
    else:
        cfg = dict(hq=32, hkv=8, d=128, dtype=torch.bfloat16, page=16, scale=128**-0.5, split=SPLIT,
                   value_lengths=[1, 17, 1000, 4097, 32768], value_qlens=[1, 17, 1000, 300, 1], atol=2e-2,
                   launches=launches, target=5000, neighbours=[32768, 1000, 4096, 17, 20000, 513, 8192, 3],
                   chunks=[512, 1000, 37], decode_batches=[1, 7, 64],
                   decode_launches=[dict(split_programs=False), dict(split_programs=True, block_m=64),
                                    dict(split_programs=True, num_stages=2), dict(split_programs=True, num_stages=4),
                                    dict(split_programs=False, num_stages=2)] + gluon,
                   decode_samples=40, wide=40960, speed_ctx=[4096, 32768], speed_batches=[1, 8, 64],
                   speed_prefill=[(1, 4096), (1, 16384), (8, 1024)], fast_ctx=[1024, 8192, 32768],
                   fast_batches=[1, 16, 64], fast_fixed_splits=[256, 512, 1024, 2048, 4096],
                   merge_ctx=[4096, 8192, 32768], merge_batches=[1, 4, 16])  # fmt: skip
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (Triton interpreter)'}, "
          f"torch {torch.__version__}, heads {cfg['hq']}/{cfg['hkv']}, head_dim {cfg['d']}, {cfg['dtype']}, "
          f"TILE {TILE}, split {cfg['split']}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    if args.only:
        tables = {"wide": bench_wide, "pages": bench_pages, "fastmode": bench_fastmode, "merge": bench_merge,
                  "gluon": lambda cfg, device: check_gluon(cfg, device, gen)}  # fmt: skip
        tables[args.only](cfg, device)
    elif not args.speed_only:
        check_values(cfg, device, gen)
        check_invariance(cfg, device, gen)
        if hopper and KV_DTYPE is None:
            check_gluon(cfg, device, gen)
    if device == "cuda" and not args.smoke and not args.no_speed and not args.only:
        bench_speed(cfg, device)
    print(f"\n{'ALL CHECKS PASSED' if not FAILURES else f'{len(FAILURES)} FAILED: ' + '; '.join(FAILURES)}")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
