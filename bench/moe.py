"""The mixture-of-experts layer on a GPU: bitwise invariance and speed of lockstep's grouped matmul against the
non-invariant fast mode and torch's per-expert loop, at the Qwen3-30B-A3B shape.

    python bench/moe.py [--out DIR] [--quick] [--dtype bf16|fp16]

One MoE layer of Qwen3-30B-A3B (hidden 2048, 128 experts, top 8, expert width 768, renormalised top-k), random
weights (1.2 GB in bf16: every step reads them from HBM). Three implementations of router + experts:

- invariant: ``ops.moe_route`` + ``ops.moe_experts`` (the ``invariant`` kernel set);
- fast: torch's routing + the same grouped matmul with the outputs summed by ``index_add_`` in sorted order (the
  ``default`` set: float atomics, the way fused-MoE engines combine);
- torch: torch's routing + a loop over the experts with cuBLAS (``F.linear``), host-synced (the ``torch`` set).

Checks (the script exits 1 if an invariant one fails):
1. parity: each implementation against an fp32 evaluation of the same routing (relative error, norm-wise);
2. batch invariance: probe tokens placed among random neighbours at every batch size of the grid (decode and
   prefill sizes) give the bits they have alone (M = 1) -- required for invariant, counted for fast and torch
   (the negative control: they should differ somewhere);
3. a token alone at its experts vs the same token with thousands of others routed to the same experts;
4. tile configs: the grouped matmul gives the same bits under every candidate config (BK fixed, BM/BN/warps/
   stages varied) at decode and prefill sizes -- the premise behind ``ops.moe.moe_config`` choosing BM/BN from the
   average load per expert.
Timings: median microseconds over CUDA-graph replays (triton.testing.do_bench_cudagraph) for invariant and fast,
triton.testing.do_bench for the host-synced torch loop; the expert-weight bandwidth achieved at decode sizes.

Decode diagnostics (skipped with ``--quick``; ``--decode-only`` runs only these):
- breakdown: the invariant layer's parts timed alone at decode sizes (router matmul, routing, the plan -- the
  fused Triton one and the torch one it replaced --, gate/up matmul, down matmul, combine);
- sweep: the whole expert op with each decode candidate (``DECODE_CONFIGS``) for the gate/up matmul while the
  down matmul keeps the table's tile, and the other way round, each checked for the table's bits. Compare the
  table's choice (``ops.moe.moe_config``) with the fastest candidate before changing it.
"""

import argparse
import json
import os
import platform
import sys
import time
from datetime import date

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from lockstep import ops
from lockstep.layers import torch_kernels
from lockstep.ops import moe
from lockstep.ops.moe import MoEConfig
from lockstep.ops.moe import layer as moe_layer
from lockstep.ops.moe.grouped_mm import _grouped_mm

HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 128, 8, 768
DEVICE = "cuda"  # the checks also run on the CPU (Triton's interpreter) at small shapes, for a smoke test
DECODE = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL = [512, 1024, 2048, 4096, 8192, 16384]
PROBES = 4  # tokens followed across batch sizes
CONFIGS = [
    MoEConfig(16, 32, 64, 4, 4), MoEConfig(16, 64, 64, 4, 4), MoEConfig(16, 128, 64, 4, 3),
    MoEConfig(32, 64, 64, 4, 4), MoEConfig(64, 64, 64, 4, 4), MoEConfig(64, 128, 64, 4, 3),
    MoEConfig(128, 128, 64, 8, 3), MoEConfig(128, 64, 64, 4, 3), MoEConfig(64, 256, 64, 8, 3),
]  # fmt: skip
# Tiles for a few tokens (BM 16; BK fixed at 64 for bf16/fp16): BN, warps and stages varied.
DECODE_CONFIGS = [
    MoEConfig(16, 16, 64, 2, 4), MoEConfig(16, 32, 64, 2, 4), MoEConfig(16, 32, 64, 4, 4),
    MoEConfig(16, 32, 64, 4, 6), MoEConfig(16, 64, 64, 4, 4), MoEConfig(16, 64, 64, 4, 6),
    MoEConfig(16, 64, 64, 8, 4), MoEConfig(16, 128, 64, 4, 3), MoEConfig(16, 128, 64, 8, 4),
]  # fmt: skip
DECODE_DIAG = [1, 2, 4, 8, 16, 64]


class Layer:
    """One MoE layer's weights and its three implementations."""

    def __init__(self, dtype: torch.dtype, seed: int = 0):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        randn = lambda *shape, scale: (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)
        self.gate = randn(EXPERTS, HIDDEN, scale=HIDDEN**-0.5)
        self.w13 = randn(EXPERTS, 2 * WIDTH, HIDDEN, scale=HIDDEN**-0.5)
        self.w2 = randn(EXPERTS, HIDDEN, WIDTH, scale=WIDTH**-0.5)

    def invariant(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = ops.moe_route(ops.linear(x, self.gate), TOP_K, True)
        return ops.moe_experts(x, self.w13, self.w2, weights, ids)

    def fast(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = torch_kernels.torch_moe_route(torch.nn.functional.linear(x, self.gate), TOP_K, True)
        return torch_kernels.fast_moe_experts(x, self.w13, self.w2, weights, ids)

    def torch(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = torch_kernels.torch_moe_route(torch.nn.functional.linear(x, self.gate), TOP_K, True)
        return torch_kernels.torch_moe_experts(x, self.w13, self.w2, weights, ids)


def tokens(m: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(m, HIDDEN, generator=gen, device=DEVICE).to(dtype)


def check_parity(layer: Layer, x: torch.Tensor) -> dict:
    """Each implementation against fp32 arithmetic over the invariant routing (same experts, same weights)."""
    weights, ids = ops.moe_route(ops.linear(x, layer.gate), TOP_K, True)
    ref = moe.experts_reference(x.float(), layer.w13.float(), layer.w2.float(), weights, ids).double()
    out = {}
    for name, fn in (("invariant", ops.moe_experts), ("fast", torch_kernels.fast_moe_experts),
                     ("torch", torch_kernels.torch_moe_experts)):  # fmt: skip
        got = fn(x, layer.w13, layer.w2, weights, ids).double()
        out[name] = ((got - ref).norm() / ref.norm()).item()
    return out


def check_batches(layer: Layer, dtype: torch.dtype, sizes: list[int]) -> dict:
    """Probe tokens alone, then placed among random neighbours at every size: rows that changed, per impl."""
    probes = tokens(PROBES, 1, dtype)
    result = {}
    for name in ("invariant", "fast", "torch"):
        fn = getattr(layer, name)
        alone = torch.cat([fn(probes[i : i + 1]) for i in range(PROBES)])
        differing = []
        for m in sizes:
            if m < PROBES:
                continue
            batch = tokens(m, 1000 + m, dtype)
            where = torch.linspace(0, m - 1, PROBES, device=DEVICE).long()
            batch[where] = probes
            got = fn(batch)[where]
            if not torch.equal(got, alone):
                differing.append(m)
        result[name] = {"sizes_checked": sum(m >= PROBES for m in sizes), "sizes_differing": differing}
    return result


def check_crowding(layer: Layer, dtype: torch.dtype) -> dict:
    """Token 0 routed to experts 0..7 alone, then with 4095 others routed to exactly the same experts."""
    x = tokens(4096, 7, dtype)
    ids = torch.arange(TOP_K, device=DEVICE).repeat(4096, 1)
    ids[1:] = ids[1:].roll(1, dims=1)  # the same experts, other ranks
    spread = torch.rand(4095, EXPERTS - TOP_K, device=DEVICE).argsort(1)[:, :TOP_K] + TOP_K
    weights = torch.softmax(torch.randn(4096, TOP_K, device=DEVICE), -1)
    alone_ids = torch.cat([ids[:1], spread])  # nobody else at experts 0..7
    out = {}
    for name, fn in (("invariant", ops.moe_experts), ("fast", torch_kernels.fast_moe_experts),
                     ("torch", torch_kernels.torch_moe_experts)):  # fmt: skip
        a = fn(x, layer.w13, layer.w2, weights, alone_ids)[0]
        b = fn(x, layer.w13, layer.w2, weights, ids)[0]
        out[name] = bool(torch.equal(a, b))
    return out


def check_configs(layer: Layer, dtype: torch.dtype, sizes: list[int]) -> dict:
    """The grouped matmul's bits under every candidate tile config, against the table's choice."""
    result = {}
    for m in sizes:
        x = tokens(m, 3, dtype)
        weights, ids = ops.moe_route(ops.linear(x, layer.gate), TOP_K, True)
        base = moe_layer._experts_triton(x, layer.w13, layer.w2, weights, ids)
        bad = [
            vars(c)
            for c in CONFIGS
            if not torch.equal(moe_layer._experts_triton(x, layer.w13, layer.w2, weights, ids, c), base)
        ]
        result[m] = {"configs": len(CONFIGS), "differing": bad}
    return result


def timings(layer: Layer, dtype: torch.dtype, sizes: list[int], with_torch: bool) -> list[dict]:
    rows = []
    for m in sizes:
        x = tokens(m, 5, dtype)
        row = {"m": m}
        for name in ("invariant", "fast"):
            fn = getattr(layer, name)
            fn(x)  # compile outside the graph
            try:
                row[name + "_us"] = do_bench_cudagraph(lambda fn=fn: fn(x), rep=40, return_mode="median") * 1e3
                row[name + "_graph"] = True
            except RuntimeError as e:  # not capturable: say so, and time it eagerly
                print(f"M={m} {name}: CUDA graph capture failed ({e}); timing eagerly", flush=True)
                torch.cuda.synchronize()
                row[name + "_us"] = do_bench(lambda fn=fn: fn(x), rep=40, return_mode="median") * 1e3
                row[name + "_graph"] = False
        if with_torch:
            row["torch_us"] = do_bench(lambda: layer.torch(x), rep=40, return_mode="median") * 1e3
        _, ids = ops.moe_route(ops.linear(x, layer.gate), TOP_K, True)
        used = int(torch.unique(ids).numel())
        weight_bytes = used * 3 * HIDDEN * WIDTH * layer.w13.element_size()
        row["experts_used"] = used
        row["invariant_weight_TBps"] = weight_bytes / (row["invariant_us"] * 1e-6) / 1e12
        row["invariant_over_fast"] = row["invariant_us"] / row["fast_us"]
        rows.append(row)
        print(
            f"M={m:6d} experts={used:3d} invariant {row['invariant_us']:9.1f} us  fast {row['fast_us']:9.1f} us  "
            + (f"torch {row['torch_us']:9.1f} us  " if with_torch else "")
            + f"ratio {row['invariant_over_fast']:.3f}  weights {row['invariant_weight_TBps']:.2f} TB/s",
            flush=True,
        )
    return rows


def graph_us(fn) -> float:
    fn()  # compile outside the graph
    return do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3


def table_configs(m: int, dtype: torch.dtype) -> tuple[MoEConfig, MoEConfig]:
    pairs = m * TOP_K
    return (moe.moe_config(pairs, EXPERTS, WIDTH, HIDDEN, dtype), moe.moe_config(pairs, EXPERTS, HIDDEN, WIDTH, dtype))


def torch_plan(ids: torch.Tensor, bm: int):
    plan = moe.plan_routing_torch(ids, EXPERTS)
    return plan, moe.tile_table_torch(plan.bounds, ids.numel(), EXPERTS, bm)


def decode_breakdown(layer: Layer, dtype: torch.dtype, sizes: list[int]) -> list[dict]:
    """Each part of the invariant layer alone, at a few tokens (CUDA-graph replays, microseconds)."""
    rows = []
    for m in sizes:
        x = tokens(m, 5, dtype)
        logits = ops.linear(x, layer.gate)
        weights, ids = ops.moe_route(logits, TOP_K, True)
        cfg1, cfg2 = table_configs(m, dtype)
        plan = moe.plan_routing_triton(ids, EXPERTS, cfg1.bm)
        act = _grouped_mm(x, plan.tokens, layer.w13, plan, cfg1, silu_mul=True)
        y = _grouped_mm(act, None, layer.w2, plan, cfg2, silu_mul=False)
        row = {
            "m": m,
            "router_linear_us": graph_us(lambda: ops.linear(x, layer.gate)),
            "route_us": graph_us(lambda: ops.moe_route(logits, TOP_K, True)),
            "plan_triton_us": graph_us(lambda: moe.plan_routing_triton(ids, EXPERTS, cfg1.bm)),
            "plan_torch_us": graph_us(lambda: torch_plan(ids, cfg1.bm)),
            "gate_up_us": graph_us(lambda: _grouped_mm(x, plan.tokens, layer.w13, plan, cfg1, silu_mul=True)),
            "down_us": graph_us(lambda: _grouped_mm(act, None, layer.w2, plan, cfg2, silu_mul=False)),
            "combine_us": graph_us(lambda: moe.combine(y, weights, plan.rows.view(ids.shape))),
            "whole_us": graph_us(lambda: layer.invariant(x)),
            "configs": [vars(cfg1), vars(cfg2)],
        }  # fmt: skip
        torch_plan_out, torch_tiles = torch_plan(ids, cfg1.bm)
        row["plans_equal"] = all(
            torch.equal(getattr(plan, f), getattr(torch_plan_out, f)) for f in ("order", "tokens", "rows", "bounds")
        ) and all(torch.equal(a, b) for a, b in zip(plan.tiles, torch_tiles, strict=True))
        rows.append(row)
        print(
            f"M={m:4d} " + " ".join(f"{k[:-3]} {v:.1f}" for k, v in row.items() if k.endswith("_us"))
            + f" us; plans equal: {row['plans_equal']}",
            flush=True,
        )  # fmt: skip
    return rows


def plan_timings(layer: Layer, dtype: torch.dtype, sizes: list[int]) -> list[dict]:
    """The fused plan against the torch plan at every size (both with the tile table): microseconds and equality,
    to place ``ops.moe.FUSED_PLAN_MAX_PAIRS`` (the size above which the layer uses the torch plan)."""
    rows = []
    for m in sizes:
        _, ids = ops.moe_route(ops.linear(tokens(m, 5, dtype), layer.gate), TOP_K, True)
        bm = table_configs(m, dtype)[0].bm
        fused = moe.plan_routing_triton(ids, EXPERTS, bm)
        ref, ref_tiles = torch_plan(ids, bm)
        equal = all(torch.equal(getattr(fused, f), getattr(ref, f)) for f in ("order", "tokens", "rows", "bounds"))
        equal = equal and all(torch.equal(a, b) for a, b in zip(fused.tiles, ref_tiles, strict=True))
        row = {
            "m": m, "pairs": ids.numel(), "equal": equal,
            "fused_us": graph_us(lambda: moe.plan_routing_triton(ids, EXPERTS, bm)),
            "torch_us": graph_us(lambda: torch_plan(ids, bm)),
        }  # fmt: skip
        rows.append(row)
        print(f"plan M={m:6d}: fused {row['fused_us']:8.1f} us, torch {row['torch_us']:8.1f} us, equal {equal}",
              flush=True)  # fmt: skip
    return rows


def decode_sweep(layer: Layer, dtype: torch.dtype, sizes: list[int]) -> list[dict]:
    """The expert op with each decode candidate for one matmul (the other keeps the table's), timed and checked."""
    rows = []
    for m in sizes:
        x = tokens(m, 5, dtype)
        weights, ids = ops.moe_route(ops.linear(x, layer.gate), TOP_K, True)
        cfg1, cfg2 = table_configs(m, dtype)
        run = lambda c: moe_layer._experts_triton(x, layer.w13, layer.w2, weights, ids, c)  # noqa: E731
        base = run((cfg1, cfg2))
        row = {"m": m, "table": [vars(cfg1), vars(cfg2)], "table_us": graph_us(lambda: run((cfg1, cfg2)))}
        for which in ("gate_up", "down"):
            results = []
            for c in DECODE_CONFIGS:
                pair = (c, cfg2) if which == "gate_up" else (cfg1, c)
                results.append(
                    {**vars(c), "us": graph_us(lambda p=pair: run(p)), "same_bits": bool(torch.equal(run(pair), base))}
                )
            best = min(results, key=lambda r: r["us"])
            row[which] = results
            print(
                f"M={m:4d} {which:7s}: table {row['table_us']:.1f} us; best {best['us']:.1f} us with "
                f"BM {best['bm']} BN {best['bn']} warps {best['num_warps']} stages {best['num_stages']}; "
                f"all same bits: {all(r['same_bits'] for r in results)}",
                flush=True,
            )
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="folder for moe.json")
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--decode-only", action="store_true", help="only the decode breakdown and tile sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/moe.py needs a CUDA GPU")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    decode = [1, 8, 64, 256] if args.quick else DECODE
    prefill = [2048, 8192] if args.quick else PREFILL
    layer = Layer(dtype)
    started = time.time()
    diagnostics = {}
    if args.decode_only or not args.quick:
        diagnostics["breakdown"] = decode_breakdown(layer, dtype, DECODE_DIAG)
        diagnostics["sweep"] = decode_sweep(layer, dtype, DECODE_DIAG)
    if args.decode_only:
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "moe_decode.json"), "w") as f:
                json.dump(diagnostics, f, indent=1)
        bad = [r["m"] for r in diagnostics["breakdown"] if not r["plans_equal"]]
        bad += [
            r["m"] for r in diagnostics["sweep"] for w in ("gate_up", "down") if not all(c["same_bits"] for c in r[w])
        ]
        if bad:
            sys.exit(f"FAILED: plans or tile bits differ at M = {sorted(set(bad))}")
        return

    parity = check_parity(layer, tokens(512, 2, dtype))
    print("parity (rel. error vs fp32):", {k: f"{v:.2e}" for k, v in parity.items()}, flush=True)
    check_sizes = sorted(set(decode + prefill + [3, 17, 127, 129, 1000, 3000]))
    batches = check_batches(layer, dtype, check_sizes)
    print("batch invariance:", json.dumps(batches), flush=True)
    crowding = check_crowding(layer, dtype)
    print("alone vs crowded, same bits:", crowding, flush=True)
    configs = check_configs(layer, dtype, [1, 64, 2048, 8192] if not args.quick else [1, 2048])
    print("tile configs:", json.dumps({m: len(v["differing"]) for m, v in configs.items()}), flush=True)
    rows = timings(layer, dtype, decode + prefill, with_torch=True)
    plans = plan_timings(layer, dtype, decode + prefill)

    failures = []
    if parity["invariant"] > 2e-2:
        failures.append(f"invariant parity {parity['invariant']:.2e}")
    if batches["invariant"]["sizes_differing"]:
        failures.append(f"invariant rows changed at M = {batches['invariant']['sizes_differing']}")
    if not crowding["invariant"]:
        failures.append("invariant: a token alone at its experts and crowded differ")
    failures += [f"M={r['m']}: the fused plan differs from the torch plan" for r in plans if not r["equal"]]
    for r in diagnostics.get("breakdown", []):
        if not r["plans_equal"]:
            failures.append(f"M={r['m']}: the fused plan differs from the torch plan")
    for r in diagnostics.get("sweep", []):
        if not all(c["same_bits"] for w in ("gate_up", "down") for c in r[w]):
            failures.append(f"M={r['m']}: a decode tile config changes the bits")
    for m, v in configs.items():
        if v["differing"]:
            failures.append(f"M={m}: tile configs {v['differing']} change the bits")
    if not batches["fast"]["sizes_differing"] and not batches["torch"]["sizes_differing"]:
        print("WARNING: the negative controls (fast, torch) never changed a row: the harness saw no difference")

    result = {
        "date": str(date.today()), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(), "dtype": args.dtype,
        "shape": {"hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K, "expert_width": WIDTH},
        "parity": parity, "batch_invariance": batches, "alone_vs_crowded_same_bits": crowding,
        "tile_configs": configs, "timings": rows, "plans": plans, "decode": diagnostics, "failures": failures,
        "seconds": time.time() - started,
    }  # fmt: skip
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "moe.json"), "w") as f:
            json.dump(result, f, indent=1)
    if failures:
        print("FAILED:", *failures, sep="\n  ")
        sys.exit(1)
    print("all invariance checks passed")


if __name__ == "__main__":
    main()
