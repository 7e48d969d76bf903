"""Correctness, bitwise invariance and speed of lockstep's ops on a GPU, against torch's own kernels.

    python bench/ops.py [--out DIR] [--sweep] [--quick]

Matmul: Qwen3-8B shapes (K x N), bf16. Every M in 1..512 and 1000, 2048, 4096, 8192 is checked bitwise against
the M=8192 result; the same grid counts how often cuBLAS (torch with the mode off) changes row 0. Timings use
CUDA graphs (triton.testing.do_bench_cudagraph) over several weight copies so the weights come from HBM, not L2.
Row ops: rms_norm, softmax, log_softmax at hidden/vocab sizes, same checks, bandwidth against torch's kernels.
--sweep times candidate tile configs per (shape, M bucket) and checks that each gives the reference bits.
"""

import argparse
import json
import math
import os
import platform
import time
from datetime import date

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench_cudagraph

from lockstep import ops
from lockstep.ops.matmul import MatmulConfig, _bmm_triton, matmul_config

# (K, N) of every linear the Qwen3-8B shape runs: o_proj, fused qkv_proj, fused gate_up_proj, down_proj, lm_head.
SHAPES = [(4096, 4096), (4096, 6144), (4096, 24576), (12288, 4096), (4096, 151936)]
# The other dense linears of the supported MoE shapes (their experts run the grouped matmul, bench/moe.py):
# Qwen3-30B-A3B's fused qkv_proj, o_proj, router and lm_head; Mixtral-8x7B's lm_head (its attention is Qwen3-8B's).
MOE_SHAPES = [(2048, 5120), (4096, 2048), (2048, 128), (2048, 151936), (4096, 32000)]
CHECK_MS = list(range(1, 513)) + [1000, 2048, 4096, 8192]
TIME_MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 2048, 4096, 8192]
L2_BYTES = 60 * 2**20
TMA_ONLY = os.environ.get("SWEEP_LARGE_M") == "1"
SWEEP_MS = [int(m) for m in os.environ.get("SWEEP_MS", "").split(",") if m]  # e.g. SWEEP_MS=1,16: only these M


def bench(fn) -> float:
    """Median microseconds of fn, replayed in a CUDA graph."""
    return do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3


def weight_copies(n: int, k: int, dtype) -> list[torch.Tensor]:
    # Enough copies that cycling through them defeats the L2 cache.
    copies = max(1, min(8, math.ceil(4 * L2_BYTES / (n * k * 2))))
    return [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(copies)]


def check_matmul(k: int, n: int, x: torch.Tensor, w: torch.Tensor) -> dict:
    full = ops.linear(x, w)
    ref = (x[:64].float() @ w.float().t()).double()
    rel = ((full[:64].double() - ref).norm() / ref.norm()).item()
    bad = [m for m in CHECK_MS if not torch.equal(ops.linear(x[:m], w), full[:m])]
    # Negative control: cuBLAS row 0 across the same M grid.
    cublas_full = F.linear(x, w)
    cublas_row0 = {F.linear(x[:m], w)[0].view(torch.int16).cpu().numpy().tobytes() for m in CHECK_MS}
    cublas_bad = sum(not torch.equal(F.linear(x[:m], w)[0], cublas_full[0]) for m in CHECK_MS)
    return {"rel_err": rel, "ms_checked": len(CHECK_MS), "ms_differing": bad,
            "cublas_row0_distinct": len(cublas_row0), "cublas_ms_differing": cublas_bad}  # fmt: skip


def time_matmul(k: int, n: int, dtype) -> list[dict]:
    ws = weight_copies(n, k, dtype)
    rows = []
    for m in TIME_MS:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        ours = bench(lambda: [ops.linear(x, w) for w in ws]) / len(ws)
        cublas = bench(lambda: [F.linear(x, w) for w in ws]) / len(ws)
        flops = 2 * m * n * k
        rows.append({"K": k, "N": n, "M": m, "ours_us": ours, "cublas_us": cublas, "ratio": ours / cublas,
                     "ours_tflops": flops / ours / 1e6, "config": str(matmul_config(m, n, k, dtype))})  # fmt: skip
        print(f"  K={k:5d} N={n:6d} M={m:5d}  ours {ours:9.1f} us  cuBLAS {cublas:9.1f} us  ratio {ours / cublas:5.2f}")
    return rows


def sweep_candidates(m: int, n: int) -> list[MatmulConfig]:
    C = MatmulConfig
    # flat: one pipelined loop over a program's (tile, k step) pairs, for programs that own several tiles.
    if m <= 16:
        loops = [C(16, bn, bk, num_warps=w, num_stages=s) for bn in (16, 32, 64) for bk, s in ((256, 5), (512, 4))
                 for w in (4, 8)] + [C(16, 128, 256, num_stages=3)]  # fmt: skip
        flat = [C(16, bn, bk, num_stages=s, flat=True) for bn, bk, s in
                ((16, 512, 4), (16, 512, 5), (16, 1024, 4), (32, 256, 5), (32, 512, 4), (64, 256, 5))]  # fmt: skip
        return loops + flat
    if m <= 64:
        tiles = ((16, 256), (32, 256), (64, 256), (32, 512), (64, 128), (128, 64))
        return [C(min(m, 64), bn, bk, num_stages=4, flat=flat) for bn, bk in tiles for flat in (False, True)]
    big = [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)]
    small = [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4)]
    if m <= 256:
        # Decode at batch 128-256 (compute-bound, too few 128 x 128 tiles to fill the SMs): also two warpgroups
        # sharing a 64- or 128-row tile, and K steps of 128. TMA only: it won every M >= 128 so far.
        eight = [(64, 128, 64, 8, 4), (128, 64, 64, 8, 4), (64, 256, 64, 8, 3), (64, 128, 128, 8, 3),
                 (128, 64, 128, 8, 3), (128, 128, 128, 8, 3)]  # fmt: skip
        # and the flat loop of 64 x 32 tiles (narrow products at M <= 128)
        flat = [C(64, 32, 256, num_stages=4, flat=True)]
        return [C(bm, bn, bk, 8, w, s, True) for bm, bn, bk, w, s in small + big[:2] + eight] + flat
    if n <= 2048:  # a narrow product (a router, a TP shard): the large tiles leave most SMs idle
        big = small + [(32, 64, 128, 4, 4)] + big[:1]
    return [C(bm, bn, bk, 8, w, s, tma) for bm, bn, bk, w, s in big for tma in (False, True)]


def sweep_matmul(k: int, n: int, dtype) -> list[dict]:
    ws = weight_copies(n, k, dtype)
    x_all = torch.randn(8192, k, device="cuda", dtype=dtype)
    ref = ops.linear(x_all, ws[0])
    rows = []
    for m in SWEEP_MS or ([128, 256, 512, 2048, 8192] if TMA_ONLY else [1, 8, 16, 32, 64, 128, 256, 512, 2048, 8192]):
        x = x_all[:m]
        for cfg in sweep_candidates(m, n):
            try:
                same = torch.equal(_bmm_triton(x[None], ws[0].t()[None], config=cfg)[0], ref[:m])
                t = bench(lambda: [_bmm_triton(x[None], w.t()[None], config=cfg) for w in ws]) / len(ws)
            except Exception as exc:  # a config the compiler rejects (shared memory)
                rows.append({"K": k, "N": n, "M": m, "config": str(cfg), "error": str(exc)[:200]})
                continue
            rows.append({"K": k, "N": n, "M": m, "config": str(cfg), "us": t, "same_bits": same})
        cublas = bench(lambda: [F.linear(x, w) for w in ws]) / len(ws)
        table = bench(lambda: [ops.linear(x, w) for w in ws]) / len(ws)
        best = min((r for r in rows if r["M"] == m and "us" in r), key=lambda r: r["us"], default=None)
        if best:
            print(f"  sweep K={k} N={n} M={m}: best {best['us']:.1f} us {best['config']} same_bits={best['same_bits']}"
                  f" | table {table:.1f} us | cuBLAS {cublas:.1f} us")  # fmt: skip
    return rows


def check_and_time_rows(dtype) -> list[dict]:
    """rms_norm / softmax / log_softmax: invariance over M, error vs fp64, bandwidth vs torch."""
    results = []
    for op, n in [
        ("rms_norm", 128),  # q/k norm rows: several rows share one program
        ("rms_norm", 576),
        ("softmax", 576),
        ("rms_norm", 4096),
        ("rms_norm", 12288),
        ("softmax", 4096),
        ("softmax", 151936),
        ("log_softmax", 151936),
    ]:
        x = torch.randn(8192, n, device="cuda", dtype=dtype)
        w = torch.randn(n, device="cuda", dtype=dtype)
        if op == "rms_norm":
            ours_fn = lambda t: ops.rms_norm(t, w, 1e-6)
            torch_fn = lambda t: F.rms_norm(t, (n,), w, 1e-6)
            ref_fn = lambda t: (t.double() * torch.rsqrt(t.double().pow(2).mean(-1, keepdim=True) + 1e-6)) * w.double()
        else:
            fn_ours = getattr(ops, op)
            fn_torch = getattr(torch, op)
            ours_fn = lambda t, f=fn_ours: f(t, -1)
            torch_fn = lambda t, f=fn_torch: f(t, -1)
            ref_fn = lambda t, f=fn_torch: f(t.double(), -1)
        full = ours_fn(x)
        ref = ref_fn(x[:256])
        rel = ((full[:256].double() - ref).norm() / ref.norm()).item()
        bad = [m for m in CHECK_MS if not torch.equal(ours_fn(x[:m]), full[:m])]
        for m in [1, 64, 1024, 8192]:
            xm = x[:m]
            ours, theirs = bench(lambda: ours_fn(xm)), bench(lambda: torch_fn(xm))
            nbytes = 2 * xm.numel() * xm.element_size()
            results.append({"op": op, "N": n, "M": m, "dtype": str(dtype), "rel_err": rel, "ms_differing": bad,
                            "ours_us": ours, "torch_us": theirs, "ours_tbps": nbytes / ours / 1e6,
                            "torch_tbps": nbytes / theirs / 1e6})  # fmt: skip
            print(f"  {op:11s} N={n:6d} M={m:5d} ours {ours:8.1f} us ({nbytes / ours / 1e6:4.2f} TB/s)"
                  f"  torch {theirs:8.1f} us ({nbytes / theirs / 1e6:4.2f} TB/s)  differing M: {len(bad)}")  # fmt: skip
    return results


def check_and_time_rotary() -> list[dict]:
    """ops.rotary (one fused kernel) against torch's formula: the same bits, and the time of each. Then
    ops.rotary_write_kv (rotary and the cache write in one kernel) against ops.rotary + ops.write_kv: the same q
    and cache bits (what the RL trainer, which runs the two, relies on), and the time of each."""
    from lockstep.ops.rotary import rotary_torch

    results = []
    for m in [1, 128, 8192]:
        qkv = torch.randn(m, 48 * 128, device="cuda", dtype=torch.bfloat16)  # Qwen3-8B: 32 q + 8 k + 8 v heads
        q, k = qkv[:, : 32 * 128].view(m, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(m, 8, 128)
        v = qkv[:, 40 * 128 :].view(m, 8, 128)
        angles = torch.randn(m, 64, device="cuda") * 100
        cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None].to(torch.bfloat16)
        sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None].to(torch.bfloat16)
        ours, theirs = ops.rotary(q, k, cos, sin), rotary_torch(q, k, cos, sin)
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(ours, theirs, strict=True))
        t_ours = bench(lambda: ops.rotary(q, k, cos, sin))
        t_torch = bench(lambda: rotary_torch(q, k, cos, sin))
        results.append({"op": "rotary", "M": m, "same_bits": same, "ours_us": t_ours, "torch_us": t_torch})
        print(f"  rotary M={m:5d} ours {t_ours:7.1f} us  torch {t_torch:7.1f} us  same bits {same}")
        blocks = -(-m // 16) + 3
        slots = torch.randperm(blocks * 16, device="cuda")[:m]
        slots[::7] = -1  # graph padding rows
        caches = [torch.zeros(blocks, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]

        def two_kernels():
            q_rot, k_rot = ops.rotary(q, k, cos, sin)
            ops.write_kv(k_rot, v, caches[0], caches[1], slots)
            return q_rot

        q_two = two_kernels()
        q_one = ops.rotary_write_kv(q, k, v, cos, sin, caches[2], caches[3], slots)
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                   for a, b in ((q_one, q_two), (caches[2], caches[0]), (caches[3], caches[1])))  # fmt: skip
        t_one = bench(lambda: ops.rotary_write_kv(q, k, v, cos, sin, caches[2], caches[3], slots))
        t_two = bench(two_kernels)
        results.append({"op": "rotary_write_kv", "M": m, "same_bits": same, "ours_us": t_one, "two_kernels_us": t_two})
        print(f"  rotary_write_kv M={m:5d} one kernel {t_one:7.1f} us  rotary + write_kv {t_two:7.1f} us  "
              f"same bits {same}")  # fmt: skip
        # Qwen3's q and k norms in one launch against two rms_norm calls (what the RL trainer runs).
        wq, wk = (torch.randn(128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        qn, kn = ops.rms_norm_qk(q, k, wq, wk, 1e-6)
        same = torch.equal(qn, ops.rms_norm(q, wq, 1e-6)) and torch.equal(kn, ops.rms_norm(k, wk, 1e-6))
        t_one = bench(lambda: ops.rms_norm_qk(q, k, wq, wk, 1e-6))
        t_two = bench(lambda: (ops.rms_norm(q, wq, 1e-6), ops.rms_norm(k, wk, 1e-6)))
        results.append({"op": "rms_norm_qk", "M": m, "same_bits": same, "ours_us": t_one, "two_kernels_us": t_two})
        print(f"  rms_norm_qk M={m:5d} one launch {t_one:7.1f} us  two rms_norm {t_two:7.1f} us  same bits {same}")
    return results


def markdown(result: dict) -> str:
    """The tables for docs/perf.md."""
    lines = ["| K x N | M | lockstep us | cuBLAS us | ratio | lockstep TFLOP/s |", "|---|---|---|---|---|---|"]
    for r in result["timings"]:
        lines.append(f"| {r['K']}x{r['N']} | {r['M']} | {r['ours_us']:.1f} | {r['cublas_us']:.1f} | {r['ratio']:.2f} "
                     f"| {r['ours_tflops']:.0f} |")  # fmt: skip
    lines += ["", "| op | N | M | lockstep us (TB/s) | torch us (TB/s) | M differing |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['op']} | {r['N']} | {r['M']} | {r['ours_us']:.1f} ({r['ours_tbps']:.2f}) "
                     f"| {r['torch_us']:.1f} ({r['torch_tbps']:.2f}) | {len(r['ms_differing'])} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sweep", action="store_true", help="time candidate tile configs")
    parser.add_argument("--sweep-only", action="store_true", help="only the config sweep")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (smoke test)")
    parser.add_argument("--moe-shapes", action="store_true", help="also the MoE models' dense shapes")
    parser.add_argument("--rows-only", action="store_true", help="only rms_norm/softmax")
    parser.add_argument("--rotary", action="store_true", help="also rotary, rotary + cache write, q/k norms")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    shapes = SHAPES[:2] if args.quick else SHAPES + (MOE_SHAPES if args.moe_shapes else [])
    meta = {"date": str(date.today()), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version()}  # fmt: skip
    print(meta)
    result = {"meta": meta, "checks": {}, "timings": [], "sweep": [], "rows": []}
    start = time.time()
    for k, n in [] if args.rows_only else shapes:
        if args.sweep_only:
            result["sweep"] += sweep_matmul(k, n, dtype)
            continue
        x = torch.randn(8192, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
        result["checks"][f"{k}x{n}"] = c = check_matmul(k, n, x, w)
        print(f"check K={k} N={n}: rel err {c['rel_err']:.2e}, M differing {c['ms_differing'][:10]}, "
              f"cuBLAS row0 distinct {c['cublas_row0_distinct']} ({c['cublas_ms_differing']} M differ)")  # fmt: skip
        del x, w
        if args.sweep:
            result["sweep"] += sweep_matmul(k, n, dtype)
        result["timings"] += time_matmul(k, n, dtype)
        torch.cuda.empty_cache()
    if args.rotary:
        result["rotary"] = check_and_time_rotary()
    if not args.sweep_only:
        result["rows"] = check_and_time_rows(dtype)
    with open(os.path.join(args.out, "ops.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "ops.md"), "w") as f:
        f.write(markdown(result))

    if args.sweep_only or args.rows_only:
        return
    print(f"\n== summary ({time.time() - start:.0f} s) ==")
    ratios = [r["ratio"] for r in result["timings"]]
    for k, n in shapes:
        c = result["checks"][f"{k}x{n}"]
        rs = [r["ratio"] for r in result["timings"] if (r["K"], r["N"]) == (k, n)]
        geo = math.exp(sum(map(math.log, rs)) / len(rs))
        print(f"K={k:5d} N={n:6d}  differing M: {len(c['ms_differing']):3d}/{c['ms_checked']}  cuBLAS row0 "
              f"distinct: {c['cublas_row0_distinct']}  time/cuBLAS geo {geo:.2f} max {max(rs):.2f}")  # fmt: skip
    print(
        f"matmul time/cuBLAS: geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, max {max(ratios):.2f}"
    )


if __name__ == "__main__":
    main()
