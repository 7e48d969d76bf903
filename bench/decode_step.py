"""Decode-step time at several batch sizes, per kernel set, CUDA graphs on and off, with start-up time.

    python bench/decode_step.py --layers 36 --batches 1,16,128,256 --modes invariant,torch-linear,default
    python bench/decode_step.py --layers 36 --batches 1,16 --modes invariant,default --input-len 8192 \
        --max-model-len 40960     # long context, graphs captured for Qwen3's whole context

Builds a random-weight Qwen3-8B-shaped checkpoint (bench/engine.py's ``build_checkpoint``), loads one ``LLM`` per
kernel set (the load, graph capture included, is the start-up time), and for each batch size: prefills
``--batch`` requests of ``--input-len`` random tokens, runs ``--warm-steps`` decode steps, then times
``--steps`` decode steps of the whole engine (schedule, forward, sample, outputs), with graphs and, for sets
that have them, again eagerly (``runner.use_graphs = False``). Also checks that the graph and eager steps give
the same tokens and logprob bits. ``--max-model-len`` (default 4096, raised to fit ``--input-len`` and the steps)
sizes the CUDA graphs' block tables, as a server's would be sized for the model's context (the fast mode's decode
split once followed it: issue 27). ``--async-scheduling on`` runs every step with async scheduling; ``both`` times
the graph steps again with it (``async_ms``) and checks those bits too (profiles then run with it). A mode
``NAME+nopdl`` runs kernel set NAME without programmatic dependent launch (``LOCKSTEP_PDL=0``, graphs captured
so; on by default on Hopper) and checks its tokens and logprob bits against NAME's, when NAME ran first. The
"x floor" column is the ratio to the read floor: the weights' bytes plus the K/V bytes of every row at its mean
timed context, over the measured copy bandwidth (``floor_ms``; ``weight_floor_ms`` without the K/V). Prints a table
last; JSON to ``--out``.
"""

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import QWEN3_8B, build_checkpoint  # noqa: E402

from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.ops._common import PDL_ENV  # noqa: E402
from lockstep.outputs import OutputKind  # noqa: E402


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus written), over 4 GiB."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - t0)


def time_steps(
    llm: LLM, batch: int, args, graphs: bool, rng: random.Random, overlap: bool = False
) -> tuple[float, list]:
    """Mean seconds per decode step at ``batch``, and the outputs (token ids, logprobs) of the timed run;
    ``overlap``: with async scheduling."""
    engine = llm.engine
    engine.runner.use_graphs = graphs and engine.runner.graphs is not None
    engine.config = dataclasses.replace(engine.config, async_scheduling=overlap)
    steps = args.warm_steps + args.steps
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    prompts = [[rng.randrange(1000, 100_000) for _ in range(args.input_len)] for _ in range(batch)]
    for i, p in enumerate(prompts):
        engine.add_request(f"b{batch}-{graphs}-{overlap}-{i}", p, params, output_kind=OutputKind.FINAL_ONLY)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(args.warm_steps):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t0) / args.steps
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    outs.sort(key=lambda o: int(o.request_id.rsplit("-", 1)[1]))
    return per_step, [(o.token_ids, o.token_logprobs) for o in outs]


def profile_steps(llm: LLM, batch: int, args, rng: random.Random) -> dict:
    """GPU kernel time by kernel over ``PROFILE_STEPS`` graph-replayed decode steps at ``batch``, and how much of
    a step's wall time the GPU is busy."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    engine.runner.use_graphs = engine.runner.graphs is not None
    engine.config = dataclasses.replace(engine.config, async_scheduling=args.async_scheduling != "off")
    params = SamplingParams(temperature=0.0, max_tokens=args.warm_steps + PROFILE_STEPS + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"p{batch}-{i}",
            [rng.randrange(1000, 100_000) for _ in range(args.input_len)],
            params,
            output_kind=OutputKind.DELTA,
        )
    for _ in range(args.warm_steps + 1):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(PROFILE_STEPS):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / PROFILE_STEPS
    while engine.has_unfinished_requests():
        engine.step()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    busy = sum(e.self_device_time_total for e in events) / 1e3 / PROFILE_STEPS
    top = [(e.key[:70], e.self_device_time_total / 1e3 / PROFILE_STEPS, e.count // PROFILE_STEPS) for e in events]
    print(f"\n--- {llm.engine.runner.model.kernels.name}, batch {batch}: step {wall * 1e3:.2f} ms (profiled), "
          f"GPU busy {busy:.2f} ms ---")  # fmt: skip
    for name, ms, count in top[:18]:
        print(f"  {ms:8.3f} ms {count:5d}x  {name}")
    return {"batch": batch, "wall_ms": wall * 1e3, "gpu_busy_ms": busy, "kernels": top[:40]}


PROFILE_STEPS = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batches", default="1,16,128,256")
    ap.add_argument("--modes", default="invariant,torch-linear,default")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096, help="raised to fit --input-len and the steps")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warm-steps", type=int, default=4)
    ap.add_argument("--profile", default="", help="batch sizes to profile with torch.profiler (graphs on)")
    ap.add_argument(
        "--async-scheduling", choices=["off", "on", "both"], default="off",
        help="on: every step with async scheduling; both: the graph steps timed again with it (async_ms)",
    )  # fmt: skip
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="fp8: FP8 linear layers (online)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    device = torch.device("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    max_model_len = max(args.max_model_len, args.input_len + args.warm_steps + args.steps + 2 + PROFILE_STEPS)
    workdir = Path(tempfile.mkdtemp(prefix="lockstep-decode-"))
    build_checkpoint(workdir, QWEN3_8B, args.layers, device, weights=False)  # load_format="dummy"
    bandwidth = copy_bandwidth(device)
    rows, report = [], {"args": vars(args), "copy_bandwidth": bandwidth, "results": []}
    outputs = {}  # (kernel set, batch) -> the graph steps' tokens and logprobs with PDL (the default)
    pdl_before = os.environ.get(PDL_ENV)
    for mode in args.modes.split(","):
        kernels, _, flag = mode.partition("+")
        if flag not in ("", "nopdl"):
            raise SystemExit(f"unknown mode suffix in {mode!r} (only +nopdl)")
        os.environ[PDL_ENV] = "0" if flag else "1"  # read at each launch, the graphs' capture included
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        llm = LLM(
            str(workdir), kernels=kernels, device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
            max_model_len=max_model_len, enable_prefix_caching=False, gpu_memory_utilization=0.85,
            load_format="dummy", quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        )  # fmt: skip
        startup = time.perf_counter() - t0
        weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
        # K/V bytes a token keeps over all layers (k and v); a timed step reads them for its rows' mean context.
        kv_token_bytes = sum(2 * c[0, 0].numel() * c.element_size() for c, _ in llm.engine.runner.kv_caches)
        context = args.input_len + args.warm_steps + args.steps / 2
        has_graphs = llm.engine.runner.graphs is not None
        on = args.async_scheduling == "on"
        for batch in batches:
            floor = (weight_bytes + batch * context * kv_token_bytes) / bandwidth
            r = {"mode": mode, "batch": batch, "startup_s": startup, "floor_ms": floor * 1e3, "async": on}
            r["weight_floor_ms"] = weight_bytes / bandwidth * 1e3
            r["graph_ms"] = r["eager_ms"] = r["async_ms"] = r["async_equals_sync"] = None
            rng_seed = 7 * batch
            if has_graphs:
                t_graph, out_graph = time_steps(llm, batch, args, True, random.Random(rng_seed), on)
                r["graph_ms"] = t_graph * 1e3
            t_eager, out_eager = time_steps(llm, batch, args, False, random.Random(rng_seed), on)
            r["eager_ms"] = t_eager * 1e3
            r["graph_equals_eager"] = out_graph == out_eager if has_graphs else None
            bits = out_graph if has_graphs else out_eager
            if not flag:
                outputs[kernels, batch] = bits
            r["same_as_with_pdl"] = outputs[kernels, batch] == bits if flag and (kernels, batch) in outputs else None
            if args.async_scheduling == "both":
                t_async, out_async = time_steps(llm, batch, args, has_graphs, random.Random(rng_seed), True)
                r["async_ms"] = t_async * 1e3
                r["async_equals_sync"] = out_async == bits
            r["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            r["compiles_after_start"] = llm.engine.triton_compiles_after_start
            r["compiled_after_start"] = llm.engine.triton_kernels_compiled_after_start
            rows.append(r)
            report["results"].append(r)
            print(json.dumps(r), flush=True)
        if has_graphs and args.profile:
            report.setdefault("profiles", {})[mode] = [
                profile_steps(llm, int(b), args, random.Random(3)) for b in args.profile.split(",")
            ]
        del llm
        torch.cuda.empty_cache()
    if pdl_before is None:
        del os.environ[PDL_ENV]
    else:
        os.environ[PDL_ENV] = pdl_before
    report["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    report["versions"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    out = Path(args.out)
    (out if out.suffix == ".json" else out / "decode_step.json").write_text(json.dumps(report, indent=2))
    print(f"\ndecode step, Qwen3-8B shape {args.layers} layers, {args.input_len}-token prompts, "
          f"max_model_len {max_model_len}, "
          f"{torch.cuda.get_device_name()}, copy {bandwidth / 1e12:.2f} TB/s")  # fmt: skip
    print(f"{'mode':14s}{'batch':>6s}{'graph ms':>10s}{'eager ms':>10s}{'async ms':>10s}{'x floor':>9s}"
          f"{'same bits':>10s}{'start s':>9s}{'peak GiB':>9s}{'compiles':>9s}")  # fmt: skip
    for r in rows:
        best = min(t for t in (r["graph_ms"], r["eager_ms"], r["async_ms"]) if t is not None)
        g = f"{r['graph_ms']:.2f}" if r["graph_ms"] is not None else "-"
        a = f"{r['async_ms']:.2f}" if r["async_ms"] is not None else "-"
        same = all(r[k] is not False for k in ("graph_equals_eager", "async_equals_sync", "same_as_with_pdl"))
        print(f"{r['mode']:14s}{r['batch']:>6d}{g:>10s}{r['eager_ms']:>10.2f}{a:>10s}{best / r['floor_ms']:>9.2f}"
              f"{str(same):>10s}{r['startup_s']:>9.1f}{r['peak_gib']:>9.1f}"
              f"{r['compiles_after_start']:>9d}")  # fmt: skip


if __name__ == "__main__":
    main()
