"""Tensor parallelism on several GPUs: the same bits at every TP size, and what each size costs.

    python bench/tp.py --sizes 1,2                            # nvidia-h200-x2, the Qwen3-8B shape
    python bench/tp.py --model qwen3-32b --sizes 1,4 --only "tp4,tp4 fast"   # nvidia-h200-x4
    python bench/tp.py --smoke                                 # tiny shapes on the CPU (gloo), < 1 min

Builds a random-weight Qwen3-8B-shaped checkpoint (bench/engine.py's ``build_checkpoint``) and runs each
configuration on it in turn: TP 1 with the tree numerics (``tp_invariant=True``, the reference every TP size must
reproduce), TP 1 without it (what the tree costs on one GPU), TP N for each N, and the fast mode
(``batch_invariant=False``) at each size.

Bits: ``--targets`` prompts of mixed lengths, greedy and seeded T=1, with top-5 logprobs, generated alone and
again inside a batch of ``--crowd`` other requests. Every batch-invariant configuration must give the reference's
token ids and logprob bits both ways; the fast mode is the negative control (it may differ).
Speed: the batch-1 decode step (ms, CUDA graphs) and ``--num-requests`` x ``--input-len`` / ``--output-len``
throughput (wall seconds). Prints a table last; JSON to ``--out``.
"""

import argparse
import faulthandler
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import QWEN3_8B, QWEN3_32B, QWEN3_TINY, add_load_format_arg, bits, build_checkpoint  # noqa: E402

from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.outputs import OutputKind  # noqa: E402


def configurations(sizes: list[int]) -> list[tuple[str, dict]]:
    configs = [("tp1 tree", dict(tensor_parallel_size=1, tp_invariant=True)),
               ("tp1 plain", dict(tensor_parallel_size=1, tp_invariant=False))]  # fmt: skip
    for n in sizes[1:]:
        # Eager first: if graphs (NCCL collectives captured inside them) hang, the eager run still says whether
        # the rest works.
        configs += [
            (f"tp{n} eager", dict(tensor_parallel_size=n, enforce_eager=True)),
            (f"tp{n}", dict(tensor_parallel_size=n)),
        ]
    configs += [(f"tp{n} fast", dict(tensor_parallel_size=n, batch_invariant=False)) for n in sizes]
    return configs


def target_bits(llm: LLM, targets: list[list[int]], crowd: list[list[int]]) -> dict:
    """Each target's bits alone and inside the crowd, greedy and seeded T=1."""
    out = {}
    for name, params in (
        ("greedy", SamplingParams(temperature=0.0, max_tokens=24, logprobs=5, ignore_eos=True)),
        ("t1", SamplingParams(temperature=1.0, seed=11, max_tokens=24, logprobs=5, ignore_eos=True)),
    ):
        alone = [bits(llm.generate([t], params, use_tqdm=False)[0]) for t in targets]
        mixed = llm.generate(targets + crowd, params, use_tqdm=False)[: len(targets)]
        out[name] = {"alone": alone, "batched": [bits(o) for o in mixed]}
    return out


def decode_step_ms(llm: LLM, input_len: int, steps: int, vocab: int, rng: random.Random) -> float:
    """Mean ms of a batch-1 decode step of the whole engine (graphs where the set has them)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    engine.add_request("step", [rng.randrange(vocab) for _ in range(input_len)], params, output_kind=OutputKind.DELTA)
    for _ in range(4):  # the prefill and warm steps
        engine.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    elapsed = (time.perf_counter() - t0) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed * 1e3


def throughput_s(llm: LLM, args, vocab: int, rng: random.Random) -> float:
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    sync()
    return time.perf_counter() - t0


def watchdog(seconds: float, name: str) -> threading.Timer:
    """After ``seconds``, print where the driver and (through SIGUSR1, which workers answer with their stacks)
    every worker is, and exit: a configuration that hangs says where."""

    def fire() -> None:
        print(f"\n{name}: no progress after {seconds:.0f} s; stacks follow", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGUSR1)
        time.sleep(3)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_one(job_file: str) -> None:
    """One configuration (``main`` runs each in a process of its own): its bits, decode step and throughput,
    written next to the job as result.json."""
    job = json.loads(Path(job_file).read_text())
    args = argparse.Namespace(**job["args"])
    watchdog(args.config_timeout, str(job["kwargs"]))  # a daemon timer: os._exit below ends it
    t0 = time.perf_counter()
    llm = LLM(job["folder"], device=job["device"], dtype="bfloat16", max_num_seqs=max(args.num_requests, 64),
              enable_prefix_caching=False, load_format=args.load_format, async_scheduling=args.async_scheduling,
              **job["kwargs"])  # fmt: skip
    run = {"startup_s": time.perf_counter() - t0, "bits": target_bits(llm, job["targets"], job["crowd"])}
    run["decode_ms"] = decode_step_ms(llm, 128, 32, job["vocab"], random.Random(1))
    if not args.no_throughput:
        run["throughput_s"] = throughput_s(llm, args, job["vocab"], random.Random(2))
    run["compiles_after_start"] = llm.engine.triton_compiles_after_start
    run["compiled_after_start"] = llm.engine.triton_kernels_compiled_after_start
    (Path(job_file).parent / "result.json").write_text(json.dumps(run, default=bytes.hex))  # bits: hex
    t0 = time.perf_counter()
    llm.close()  # after the result is written: a close that hangs still leaves the figures
    print(f"closed in {time.perf_counter() - t0:.1f} s", flush=True)
    # Exit at once: an NCCL group that did not finish leaving (tp_workers.LEAVE_TIMEOUT) could hang the
    # interpreter's own teardown, and with it this benchmark.
    os._exit(0)


def main() -> None:
    if sys.argv[1:2] == ["--run-one"]:
        run_one(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--model", choices=["qwen3-8b", "qwen3-32b"], default="qwen3-8b", help="the random model's shape")
    ap.add_argument("--layers", type=int, default=None, help="cut the model's depth (default: all its layers)")
    ap.add_argument("--sizes", default="1,2", help="TP sizes (comma list; 1 always runs)")
    ap.add_argument("--targets", type=int, default=4)
    ap.add_argument("--crowd", type=int, default=60)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="every configuration with async scheduling or without (default: the engine's, on with CUDA)",
    )  # fmt: skip
    ap.add_argument("--only", default="", help="run only these configurations (comma list of names)")
    ap.add_argument("--config-timeout", type=float, default=300, help="seconds before a stuck configuration dumps")
    add_load_format_arg(ap)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    sizes = sorted({1, *(int(s) for s in args.sizes.split(","))})
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        args.num_requests, args.input_len, args.output_len, args.crowd = 8, 32, 8, 6
    full = {"qwen3-8b": QWEN3_8B, "qwen3-32b": QWEN3_32B}[args.model]
    shape, layers = (full, args.layers) if not args.smoke else (QWEN3_TINY, None)
    folder = Path(tempfile.mkdtemp(prefix="lockstep-tp-"))
    info = build_checkpoint(folder, shape, layers, device, weights=args.load_format != "dummy")
    vocab = shape["vocab_size"]
    rng = random.Random(0)
    lengths = [7, 100, 513, 1500][: args.targets] if not args.smoke else [3, 17, 40][: args.targets]
    targets = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    crowd = [[rng.randrange(vocab) for _ in range(rng.randint(5, 300 if cuda else 30))] for _ in range(args.crowd)]

    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
              "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
              "model": info, "args": vars(args), "runs": {}}  # fmt: skip
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    for name, kwargs in configurations(sizes):
        if only and name not in only:
            continue
        # Each configuration in a process of its own: GPU memory an earlier engine kept (its graph pool, the
        # caching allocator) would shrink a later one's KV cache and slow its throughput.
        job = {"kwargs": kwargs, "folder": str(folder), "device": str(device), "targets": targets, "crowd": crowd,
               "vocab": vocab, "args": vars(args)}  # fmt: skip
        job_file = folder / "job.json"
        job_file.write_text(json.dumps(job))
        result_file = folder / "result.json"
        result_file.unlink(missing_ok=True)
        code = subprocess.run([sys.executable, __file__, "--run-one", str(job_file)]).returncode
        if code != 0:
            print(f"{name}: exit code {code}", flush=True)
        if not result_file.exists():
            report["runs"][name] = {"error": f"exit code {code}"}
            print(f"{name}: failed (exit code {code})", flush=True)
            continue
        run = json.loads(result_file.read_text())
        report["runs"][name] = run
        print(f"{name}: start {run['startup_s']:.1f} s, decode {run['decode_ms']:.2f} ms, "
              f"throughput {run.get('throughput_s', float('nan')):.1f} s", flush=True)  # fmt: skip

    ref = report["runs"].get("tp1 tree", {}).get("bits")
    print(f"\nTP bits and speed | {report['gpus'] or 'cpu'} | {shape['arch']} {info['num_hidden_layers']} layers")
    print(
        f"{'config':12s} {'vs tp1 tree':>14s} {'alone=batched':>14s} {'decode ms':>10s} {'tput s':>8s} {'start s':>8s}"
    )
    for name, run in report["runs"].items():
        if "error" in run:
            print(f"{name:12s} {run['error']}")
            continue
        b = run["bits"]
        same_ref = "-" if ref is None else str(all(b[k]["alone"] == ref[k]["alone"] for k in b))
        batched = all(b[k]["alone"] == b[k]["batched"] for k in b)
        run["same_as_tp1_tree"], run["alone_equals_batched"] = same_ref, batched
        print(f"{name:12s} {same_ref:>14s} {str(batched):>14s} {run['decode_ms']:10.2f} "
              f"{run.get('throughput_s', float('nan')):8.1f} {run['startup_s']:8.1f}")  # fmt: skip
    for run in report["runs"].values():
        run.pop("bits", None)  # the verdicts above stay
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tp_bench.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
