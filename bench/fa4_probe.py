"""FlashAttention-4 (``flash-attn-4``, CuTe DSL) on the H200, measured against lockstep's paged attention and SDPA,
and checked for the bits lockstep's contract needs (issue 27, item 1).

    python bench/fa4_probe.py --out $OUT      # needs a GPU and flash_attn.cute importable

What it answers, each in its own table:
- which page sizes FA4's Hopper forward takes for a paged cache (lockstep's cache is [blocks, page, kv_heads, d],
  FA4's layout too), and whether it splits KV on sm_90 (``num_splits > 1``);
- decode (one query per sequence) at batch x context 1-64 x 4k-32k: FA4 paged, lockstep, SDPA on contiguous K/V;
- causal prefill TFLOP/s: FA4, lockstep, SDPA;
- bits: a sequence's decode row alone vs in a batch of 64 other contexts; the last row of a causal prefill vs a
  decode of that token; a chunked prefill's rows vs the one-shot prefill's; paged vs contiguous K/V. A row that
  differs anywhere means FA4 cannot be lockstep's invariant kernel as it is (it can still be the fast mode's).
Times are CUDA-graph medians where FA4's launch can be captured, else plain ``do_bench`` medians (marked).
"""

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

HQ, HKV, D = 32, 8, 128
SCALE = D**-0.5
RESULTS: dict = {}


def bench_us(fn):
    """Median us of fn: in a CUDA graph when it can be captured, else plain (returned with a '*')."""
    from triton.testing import do_bench, do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    try:
        return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3, ""
    except Exception:  # noqa: BLE001 - a launch path that cannot be captured is timed plainly
        torch.cuda.synchronize()
        return do_bench(fn, rep=50, return_mode="median") * 1e3, "*"


def same(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def n_diff(a, b):
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


def fa4_fwd(q, k, v, **kw):
    """FA4's forward (inference: the autograd wrapper is not needed). q [b, s, HQ, D] or [total, HQ, D]."""
    from flash_attn.cute.interface import _flash_attn_fwd

    return _flash_attn_fwd(q, k, v, softmax_scale=SCALE, **kw)[0]


def paged(b, ctx, page, dtype=torch.bfloat16, gen_seed=0):
    """A shuffled paged cache holding b sequences of ctx positions each, and its page table [b, ctx / page]."""
    torch.manual_seed(gen_seed)
    nblk = b * ctx // page
    k = torch.randn(nblk, page, HKV, D, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    table = torch.randperm(nblk, device="cuda").view(b, ctx // page).int()
    return k, v, table


def page_sizes():
    print("\npage sizes FA4's sm_90 forward takes (decode, 1 x 4096):")
    out = {}
    for page in (16, 32, 64, 128, 256):
        k, v, table = paged(1, 4096, page)
        q = torch.randn(1, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        seqused = torch.full((1,), 4096, device="cuda", dtype=torch.int32)
        t0 = time.time()
        try:
            fa4_fwd(q, k, v, page_table=table, seqused_k=seqused, causal=True)
            torch.cuda.synchronize()
            out[page] = f"ok (first call {time.time() - t0:.1f} s)"
        except Exception as e:  # noqa: BLE001 - the table records what it refuses
            out[page] = f"refused: {type(e).__name__}: {str(e)[:120]}"
        print(f"  page {page:4d}: {out[page]}")
    try:
        k, v, table = paged(1, 4096, 128)
        q = torch.randn(1, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        fa4_fwd(q, k, v, page_table=table, seqused_k=torch.full((1,), 4096, device="cuda", dtype=torch.int32),
                causal=True, num_splits=4)  # fmt: skip
        out["num_splits=4"] = "ok"
    except Exception as e:  # noqa: BLE001
        out["num_splits=4"] = f"refused: {type(e).__name__}: {str(e)[:160]}"
    print(f"  num_splits=4: {out['num_splits=4']}")
    RESULTS["page_sizes"] = out


def decode_speed(pages):
    from lockstep.ops.attention.launch import _paged_attention_triton

    print("\ndecode: us per call (TB/s reading K+V); * = not in a CUDA graph")
    cols = [f"FA4 p{p}" for p in pages] + ["lockstep p16", "SDPA"]
    print(f"  {'B':>3} {'ctx':>6} | " + " ".join(f"{c:>16}" for c in cols))
    rows = []
    for ctx in (4096, 32768):
        for b in (1, 8, 64):
            gbytes = 2 * b * ctx * HKV * D * 2 / 1e9
            cells = {}
            q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
            seqused = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
            for p in pages:
                k, v, table = paged(b, ctx, p)
                try:
                    t, mark = bench_us(lambda: fa4_fwd(q[:, None], k, v, page_table=table, seqused_k=seqused,
                                                       causal=True))  # fmt: skip
                    cells[f"FA4 p{p}"] = (t, mark)
                except Exception as e:  # noqa: BLE001
                    cells[f"FA4 p{p}"] = (float("nan"), type(e).__name__[:6])
            k, v, table = paged(b, ctx, 16)
            args = dict(q=q, k_cache=k, v_cache=v, block_tables=table, seq_lens=seqused,
                        query_start_loc=torch.arange(b + 1, device="cuda", dtype=torch.int32))  # fmt: skip
            cells["lockstep p16"] = bench_us(lambda: _paged_attention_triton(**args, scale=SCALE))
            kc = k[table.long()].view(b, ctx, HKV, D).transpose(1, 2)
            vc = v[table.long()].view(b, ctx, HKV, D).transpose(1, 2)
            qs = q[:, :, None]
            cells["SDPA"] = bench_us(lambda: F.scaled_dot_product_attention(qs, kc, vc, scale=SCALE, enable_gqa=True))
            text = [f"{t:8.1f}{m:1} ({gbytes / t * 1e3:4.2f})" for t, m in (cells[c] for c in cols)]
            print(f"  {b:3d} {ctx:6d} | " + " ".join(f"{c:>16}" for c in text))
            rows.append(dict(batch=b, ctx=ctx, gbytes=gbytes, **{c: cells[c][0] for c in cols}))
    RESULTS["decode"] = rows


def prefill_speed():
    from lockstep.ops.attention.launch import _paged_attention_triton

    print("\ncausal prefill, S sequences of n tokens: us (TFLOP/s); * = not in a CUDA graph")
    rows = []
    for seqs, n in ((1, 4096), (1, 16384), (8, 1024), (1, 32768)):
        flops = seqs * 4 * n * n * HQ * D / 2
        q = torch.randn(seqs, n, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(seqs, n, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cells = {}
        try:
            cells["FA4"] = bench_us(lambda: fa4_fwd(q, k, v, causal=True))
        except Exception as e:  # noqa: BLE001
            cells["FA4"] = (float("nan"), type(e).__name__[:6])
        # the same K/V as a paged cache of 128-position pages in order (what a prefill writes)
        kp, vp = k.view(-1, 128, HKV, D), v.view(-1, 128, HKV, D)
        table = torch.arange(kp.shape[0], device="cuda", dtype=torch.int32).view(seqs, -1)
        lens = torch.full((seqs,), n, device="cuda", dtype=torch.int32)
        try:
            cells["FA4 paged p128"] = bench_us(
                lambda: fa4_fwd(q, kp, vp, page_table=table, seqused_k=lens, causal=True)
            )
        except Exception as e:  # noqa: BLE001
            cells["FA4 paged p128"] = (float("nan"), type(e).__name__[:6])
        k16, v16 = k.view(-1, 16, HKV, D), v.view(-1, 16, HKV, D)
        args = dict(q=q.view(-1, HQ, D), k_cache=k16, v_cache=v16,
                    block_tables=torch.arange(k16.shape[0], device="cuda", dtype=torch.int32).view(seqs, -1),
                    seq_lens=lens,
                    query_start_loc=torch.arange(0, seqs * n + 1, n, device="cuda", dtype=torch.int32))  # fmt: skip
        cells["lockstep"] = bench_us(lambda: _paged_attention_triton(**args, scale=SCALE))
        qs, ks, vs = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cells["SDPA"] = bench_us(
            lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE, enable_gqa=True)
        )
        text = "  ".join(f"{c} {t:9.1f}{m:1} ({flops / t / 1e6:5.1f})" for c, (t, m) in cells.items())
        print(f"  {seqs} x {n:6d}  {text}")
        rows.append(dict(seqs=seqs, n=n, **{c: t for c, (t, _) in cells.items()}))
    RESULTS["prefill"] = rows


def scattered(lens, page):
    """A paged cache holding sequences of ``lens`` positions in shuffled blocks, and their tables (padding: 0)."""
    width = -(-max(lens) // page)
    nblk = sum(-(-n // page) for n in lens) + 8
    k = torch.randn(nblk, page, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    perm = torch.randperm(nblk).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(lens):
        for j in range(-(-n // page)):
            tables[i, j] = perm.pop()
    return k, v, tables.cuda()


def bits(page):
    """The rows lockstep's contract needs equal, through FA4 with pages of ``page`` positions."""
    print(f"\nbits through FA4 (page {page}): a row must not depend on its neighbours or on the path")
    torch.manual_seed(1)
    target = 5000
    lens = [target, 32768, 1000, 4096, 17, 20000, 513, 8192, 3] * 8  # 72 sequences, the target first
    lens = lens[:64]
    k, v, tables = scattered(lens, page)
    qs = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)
    out = {}

    def decode(idx):
        sel = torch.tensor(idx, device="cuda")
        seqused = torch.tensor([lens[i] for i in idx], device="cuda", dtype=torch.int32)
        table = tables[sel].contiguous()
        return fa4_fwd(qs[sel][:, None], k, v, page_table=table, seqused_k=seqused, causal=True)[:, 0]

    alone = decode([0])
    for name, idx in (("in a batch of 64", list(range(64))), ("in a batch of 8", list(range(8))),
                      ("last of a batch of 9", list(range(1, 9)) + [0])):  # fmt: skip
        o = decode(idx)
        row = o[idx.index(0)][None]
        out[f"decode alone == decode {name}"] = same(alone, row)
        print(f"  {'ok  ' if same(alone, row) else 'DIFF'}  decode alone == decode {name}"
              f"{'' if same(alone, row) else f' ({n_diff(alone, row)} of {alone.numel()} values)'}")  # fmt: skip

    # prefill of the target's whole sequence (its K/V from the cache, contiguous copy), its last row vs decode
    n = target
    kc = k[tables[0, : -(-n // page)].long()].reshape(-1, HKV, D)[:n][None]
    vc = v[tables[0, : -(-n // page)].long()].reshape(-1, HKV, D)[:n][None]
    qp = torch.randn(1, n, HQ, D, device="cuda", dtype=torch.bfloat16)
    qp[0, -1] = qs[0]
    full = fa4_fwd(qp, kc, vc, causal=True)[0]
    checks = {"prefill's last row == decode of that token": (full[-1:], alone)}
    full_paged = fa4_fwd(qp, k, v, page_table=tables[:1].contiguous(),
                         seqused_k=torch.tensor([n], device="cuda", dtype=torch.int32), causal=True)[0]  # fmt: skip
    checks["paged prefill == contiguous prefill"] = (full_paged, full)
    for a, b_ in ((0, 1000), (1000, 1037), (1037, 4096), (4096, n)):  # chunks over the same K/V (bottom-right causal)
        part = fa4_fwd(qp[:, a:b_], kc[:, :b_], vc[:, :b_], causal=True)[0]
        checks[f"chunk [{a}, {b_}) == the same rows of the one-shot prefill"] = (part, full[a:b_])
    for name, (x, y) in checks.items():
        ok = same(x, y)
        out[name] = ok
        print(f"  {'ok  ' if ok else 'DIFF'}  {name}{'' if ok else f' ({n_diff(x, y)} of {x.numel()} values)'}")
    ref = F.scaled_dot_product_attention(qp.transpose(1, 2).float(), kc.transpose(1, 2).float(),
                                         vc.transpose(1, 2).float(), is_causal=True, scale=SCALE,
                                         enable_gqa=True).transpose(1, 2)[0]  # fmt: skip
    err = (full.float() - ref).abs().max().item()
    out["max |prefill - fp32 reference|"] = err
    print(f"  max |prefill - fp32 SDPA| = {err:.3e}")
    RESULTS[f"bits_p{page}"] = out


def nan_slots():
    """Unwritten cache slots hold garbage, NaN included (lockstep's tests fill them with NaN): FA4 must never let a
    slot past a sequence's length reach its output. Through ``lockstep.ops.attention.fa4``, the fast set's route, at
    page 16 (FA4's cp.async path, as the engine runs it)."""
    from lockstep.ops.attention import fa4

    print("\nunwritten slots as NaN (page 16, lockstep's FA4 route): finite, and the same as with finite garbage")
    out = {}
    for ctx, q_len in ((1000, 1000), (1037, 37), (4095, 1)):
        k, v, table = paged(1, 4096, 16)
        q = torch.randn(q_len, HQ, D, device="cuda", dtype=torch.bfloat16)
        starts = torch.tensor([0, q_len], device="cuda", dtype=torch.int32)
        lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)
        finite = fa4.paged_attention(q, k, v, table, lens, starts, q_len, SCALE)
        used = table[0, : -(-ctx // 16)].long()
        for c in (k, v):
            c[used[-1], ctx % 16 or 16 :] = float("nan")  # the rest of the last page
            c[table[0, -(-ctx // 16) :].long()] = float("nan")  # the pages the sequence does not use
        poisoned = fa4.paged_attention(q, k, v, table, lens, starts, q_len, SCALE)
        ok = bool(torch.isfinite(poisoned).all()) and same(finite, poisoned)
        out[f"{ctx}/{q_len}"] = ok
        print(f"  {'ok  ' if ok else 'DIFF'}  context {ctx}, {q_len} queries")
    RESULTS["nan_slots"] = out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--pages", default="16,128", help="page sizes of the decode table")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: nan,pages,decode,prefill,bits,split")
    ap.add_argument("--splits", default="1024,2048", help="split sizes of the split-contract section")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fa4_probe: needs a GPU (FlashAttention-4 has no CPU path)")
        return 0
    try:
        from importlib.metadata import version

        import flash_attn.cute  # noqa: F401

        RESULTS["versions"] = {p: version(p) for p in ("flash-attn-4", "nvidia-cutlass-dsl", "torch")}
    except Exception as e:  # noqa: BLE001
        print(f"fa4_probe: flash_attn.cute does not import: {type(e).__name__}: {e}")
        return 1
    print(f"{torch.cuda.get_device_name()}, {RESULTS['versions']}")
    skip = set(filter(None, args.skip.split(",")))
    pages = [int(p) for p in args.pages.split(",")]
    sections = [("nan", nan_slots), ("pages", page_sizes), ("bits", lambda: [bits(p) for p in (128, 16)]),
                ("decode", lambda: decode_speed(pages)), ("prefill", prefill_speed),
                ("split", lambda: [split_contract(int(s)) for s in args.splits.split(",")])]  # fmt: skip
    for name, fn in sections:
        if name in skip:
            continue
        t0 = time.time()
        try:
            fn()
        except Exception:  # noqa: BLE001 - one section's failure must not hide the others
            traceback.print_exc(limit=4)
            RESULTS[f"{name}_error"] = traceback.format_exc(limit=4)
        print(f"  ({name}: {time.time() - t0:.0f} s)")
        sys.stdout.flush()
        with open(os.path.join(args.out, "fa4_probe.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    return 0


# ---- lockstep's split contract through FA4: each (row, split) partial by FA4, merged in split order ----------------


def split_plan(q_lens, ctx_lens, split, page, tables):
    """The virtual sequences that give every query row its partial over each split of ``split`` positions.

    Sequence b's query rows sit at positions ctx - q_len + i. Against split j = [jS, (j+1)S) a row either lies in it
    (the diagonal: a causal entry whose keys run from jS to the last such row, bottom-right aligned, so row i sees
    keys <= its position) or lies past it (a full, non-causal entry over the whole split). Returns per call kind
    (causal, full): the query rows gathered, cu_seqlens_q, seqused_k, the page table of each entry (the sequence's
    table from page jS / page), and where (token, split) went: idx [tokens, max splits] -> row, -1 if none."""
    plans = {}
    token0 = 0
    tokens = sum(q_lens)
    max_splits = max(-(-c // split) for c in ctx_lens)
    idx = torch.full((tokens, max_splits), -1, dtype=torch.long)
    pieces = {True: [], False: []}
    for b, (n, c) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        pos0 = c - n
        for j in range(-(-c // split)):
            lo, hi = j * split, (j + 1) * split
            diag = (max(pos0, lo), min(c, hi))  # positions of rows inside split j
            if diag[0] < diag[1]:
                pieces[True].append((b, token0 + diag[0] - pos0, token0 + diag[1] - pos0, lo, diag[1] - lo, j))
            full = (max(pos0, hi), c)
            if full[0] < full[1]:
                pieces[False].append((b, token0 + full[0] - pos0, token0 + full[1] - pos0, lo, split, j))
        token0 += n
    for causal, items in pieces.items():
        if not items:
            continue
        rows = torch.cat([torch.arange(r0, r1) for _, r0, r1, _, _, _ in items])
        counts = torch.tensor([0] + [r1 - r0 for _, r0, r1, _, _, _ in items])
        cu = counts.cumsum(0)
        width = max(-(-k_len // page) for *_, k_len, _ in items)
        table = torch.zeros(len(items), width, dtype=torch.int32)
        for i, (b, r0, r1, lo, k_len, j) in enumerate(items):
            pages = tables[b, lo // page : lo // page + -(-k_len // page)].cpu()
            table[i, : len(pages)] = pages
            idx[r0:r1, j] = torch.arange(cu[i], cu[i + 1]) + (0 if causal else 1 << 40)
        plans[causal] = dict(rows=rows.cuda(), cu=cu.int().cuda(), seqused=torch.tensor([k for *_, k, _ in items],
                             dtype=torch.int32).cuda(), table=table.cuda(), max_q=int(counts.max()))  # fmt: skip
    return plans, idx


def fa4_calls(q, k, v, plans):
    """Every (row, split) partial through FA4: one causal call (diagonal entries), one full call. causal -> (o, lse)."""
    from flash_attn.cute.interface import _flash_attn_fwd

    parts = {}
    for causal, p in plans.items():
        parts[causal] = _flash_attn_fwd(q[p["rows"]], k, v, cu_seqlens_q=p["cu"], seqused_k=p["seqused"],
                                        page_table=p["table"], max_seqlen_q=p["max_q"], causal=causal,
                                        softmax_scale=SCALE, return_lse=True)[:2]  # fmt: skip
    return parts


def split_attend(q, k, v, plans, idx):
    """The partials, then the fixed-order merge (elementwise, fp32)."""
    return merge(fa4_calls(q, k, v, plans), idx)


def merge(parts, idx):
    full = idx >= (1 << 40)
    tokens = idx.shape[0]
    m = torch.full((tokens, HQ), float("-inf"), device="cuda")
    w = torch.zeros(tokens, HQ, device="cuda")
    acc = torch.zeros(tokens, HQ, D, device="cuda")
    for j in range(idx.shape[1]):
        col = idx[:, j]
        o_j = torch.zeros(tokens, HQ, D, device="cuda")
        l_j = torch.full((tokens, HQ), float("-inf"), device="cuda")
        for causal, (o, lse) in parts.items():
            sel = (col >= 0) & (full[:, j] != causal)
            if sel.any():
                t = sel.nonzero()[:, 0].cuda()
                r = (col[sel] - (0 if causal else 1 << 40)).cuda()
                o_j[t] = o[r].float()
                l_j[t] = lse[:, r].T
        m_new = torch.maximum(m, l_j)
        base = torch.where(m_new == float("-inf"), 0.0, m_new)
        a = torch.where(m == m_new, 1.0, torch.exp(m - base))
        b = torch.where(l_j == m_new, 1.0, torch.exp(l_j - base))
        seen = l_j > float("-inf")
        acc = torch.where(seen[..., None], acc * a[..., None] + o_j * b[..., None], acc)
        w = torch.where(seen, w * a + b, w)
        m = torch.where(seen, m_new, m)
    return (acc / w[..., None]).to(torch.bfloat16)


def split_contract(split):
    print(f"\nlockstep's split contract through FA4 (split {split}, page 16): bits and speed")
    page = 16
    torch.manual_seed(2)
    target = 5000
    lens = ([target, 32768, 1000, 4096, 17, 20000, 513, 8192, 3] * 8)[:64]
    k, v, tables = scattered(lens, page)
    q_all = torch.randn(target, HQ, D, device="cuda", dtype=torch.bfloat16)  # the target's query rows
    q_nb = torch.randn(len(lens), HQ, D, device="cuda", dtype=torch.bfloat16)

    def run(items):
        """items: (seq, first row, end row) -> the output rows, in order."""
        qs = torch.cat([q_all[a:e] if s == 0 else q_nb[s : s + 1].expand(e - a, HQ, D) for s, a, e in items])
        plans, idx = split_plan([e - a for _, a, e in items], [e for _, _, e in items], split, page,
                                tables[[s for s, _, _ in items]])  # fmt: skip
        return split_attend(qs, k, v, plans, idx), plans, idx

    one_shot = run([(0, 0, target)])[0]
    checks = {}
    for a, e in ((0, 1000), (1000, 1037), (1037, 4096), (4096, target)):
        checks[f"chunk [{a}, {e}) == one-shot rows"] = (run([(0, a, e)])[0], one_shot[a:e])
    dec = run([(0, target - 1, target)])[0]
    checks["decode of the last token == one-shot's last row"] = (dec, one_shot[-1:])
    batch = [(0, target - 1, target)] + [(s, lens[s] - 1, lens[s]) for s in range(1, 64)]
    checks["decode in a batch of 64 == decode alone"] = (run(batch)[0][:1], dec)
    mixed = [(s, lens[s] - 1, lens[s]) for s in range(1, 9)] + [(0, 4096, target)]
    checks["chunk [4096, 5000) after 8 decode rows == one-shot rows"] = (run(mixed)[0][8:], one_shot[4096:])
    out = {}
    for name, (x, y) in checks.items():
        ok = same(x, y)
        out[name] = ok
        print(f"  {'ok  ' if ok else 'DIFF'}  {name}{'' if ok else f' ({n_diff(x, y)} of {x.numel()} values)'}")
    kc = k[tables[0, : -(-target // page)].long()].reshape(-1, HKV, D)[:target]
    vc = v[tables[0, : -(-target // page)].long()].reshape(-1, HKV, D)[:target]
    ref = F.scaled_dot_product_attention(q_all.transpose(0, 1)[None].float(), kc.transpose(0, 1)[None].float(),
                                         vc.transpose(0, 1)[None].float(), is_causal=True, scale=SCALE,
                                         enable_gqa=True)[0].transpose(0, 1)  # fmt: skip
    unsplit = fa4_fwd(q_all[None], kc[None], vc[None], causal=True)[0]
    out["max err split"] = (one_shot.float() - ref).abs().max().item()
    out["max err unsplit"] = (unsplit.float() - ref).abs().max().item()
    print(f"  max |out - fp32 SDPA|: split {out['max err split']:.3e}, FA4 unsplit {out['max err unsplit']:.3e}")

    print("  decode, us: the two FA4 calls (and with the torch merge, not fused) vs FA4 unsplit p16")
    for ctx in (4096, 32768):
        for b in (1, 8, 64):
            kk, vv, table = paged(b, ctx, page)
            q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
            plans, idx = split_plan([1] * b, [ctx] * b, split, page, table)
            t_calls, mk = bench_us(lambda: fa4_calls(q, kk, vv, plans))
            t_all, mk2 = bench_us(lambda: split_attend(q, kk, vv, plans, idx))
            seqused = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
            t_un, mk3 = bench_us(lambda: fa4_fwd(q[:, None], kk, vv, page_table=table, seqused_k=seqused, causal=True))
            gbytes = 2 * b * ctx * HKV * D * 2 / 1e9
            print(f"    {b:3d} x {ctx:6d}: calls {t_calls:8.1f}{mk} ({gbytes / t_calls * 1e3:4.2f} TB/s)  "
                  f"+ torch merge {t_all:8.1f}{mk2}  unsplit {t_un:8.1f}{mk3}")  # fmt: skip
            out[f"decode {b}x{ctx}"] = dict(calls=t_calls, with_merge=t_all, unsplit=t_un)
    print("  causal prefill (one sequence), us (TFLOP/s): the two FA4 calls with the row gather, vs unsplit")
    for n in (4096, 16384, 32768):
        kk, vv, table = paged(1, n, page)
        q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
        plans, idx = split_plan([n], [n], split, page, table)
        flops = 4 * n * n * HQ * D / 2
        t_calls, mk = bench_us(lambda: fa4_calls(q, kk, vv, plans))
        lens1 = torch.full((1,), n, device="cuda", dtype=torch.int32)
        t_un, mk3 = bench_us(lambda: fa4_fwd(q[None], kk, vv, page_table=table, seqused_k=lens1, causal=True))
        print(f"    {n:6d}: calls {t_calls:9.1f}{mk} ({flops / t_calls / 1e6:5.1f})  unsplit {t_un:9.1f}{mk3} "
              f"({flops / t_un / 1e6:5.1f})")  # fmt: skip
        out[f"prefill {n}"] = dict(calls=t_calls, unsplit=t_un)
    RESULTS[f"split_{split}"] = out


if __name__ == "__main__":
    sys.exit(main())
