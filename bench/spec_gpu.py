"""Speculative decoding on the H200, Qwen3-8B shape (random weights): what a verify step costs, and what that buys.

    python bench/spec_gpu.py                      # H200: 36 layers, batches 1,16,64, k = 1,3,7
    python bench/spec_gpu.py --tiny --steps 4     # CPU smoke test at a tiny size

1. Step cost: for each batch size, ``--batch`` requests of ``--input-len`` random tokens are prefilled, then
   ``--steps`` engine steps are timed (schedule, forward, sample, accept, outputs) after ``--warm-steps``: plain
   decode steps (CUDA graphs, and eager), and verify steps with exactly ``k`` drafts per sequence (a drafter that
   always proposes ``k`` random tokens;
   chunks of up to 8 tokens replay decode graphs as one-token rows). With random weights almost nothing is
   accepted, so a verify step here adds one token per sequence: its time is the price of checking ``k`` drafts.
2. tok/s against acceptance: with each draft accepted with probability ``a`` (independently), a verify step adds
   ``(1 - a^(k+1)) / (1 - a)`` tokens per sequence on average; tok/s = batch x that / the measured verify step.
3. Measured at full acceptance: an oracle drafter proposes the target's own greedy continuation (from a plain run
   first), so every draft is accepted; tok/s is measured and the output asserted bit-identical to plain decoding.

Prints tables; JSON to ``--out``. The issue's goals: a k = 3 verify step at batch 1 within 1.15x of a plain decode
step, and >= 450 tok/s at batch 1 with >= 3 accepted tokens per step.
"""

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import QWEN3_8B, QWEN3_TINY, build_checkpoint, write_report  # noqa: E402

from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.outputs import OutputKind  # noqa: E402


class FixedDrafter:
    """Proposes exactly ``k`` random tokens for every sequence (``k`` 0: none)."""

    def __init__(self, k: int, vocab: int) -> None:
        self.k, self.vocab, self.rng = k, vocab, random.Random(0)

    def propose(self, requests) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab) for _ in range(min(self.k, r.num_tokens))] for r in requests]

    def release(self, seq_id: int) -> None:
        pass


class OracleDrafter:
    """Proposes ``k`` tokens of the continuation a plain run produced for the sequence (every one is accepted)."""

    def __init__(self, full: list[list[int]], k: int) -> None:
        self.full, self.k = full, k

    def propose(self, requests) -> list[list[int]]:
        out = []
        for r in requests:
            n = len(r.token_ids)
            match = next((f for f in self.full if f[:n] == r.token_ids), None)
            out.append([] if match is None else match[n : n + min(self.k, r.num_tokens)])
        return out

    def release(self, seq_id: int) -> None:
        pass


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(llm: LLM, batch: int, args, drafter, graphs: bool, tag: str) -> tuple[float, int]:
    """Seconds per engine step at ``batch`` with ``drafter`` (None: plain decoding), and tokens added per step."""
    engine = llm.engine
    engine.drafter = drafter
    engine.runner.use_graphs = graphs and engine.runner.graphs is not None
    rng = random.Random(batch)
    steps = args.warm_steps + args.steps
    params = SamplingParams(temperature=0.0, max_tokens=8 * steps + 8, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(10, args.vocab - 10) for _ in range(args.input_len)]
        engine.add_request(f"{tag}-{i}", prompt, params, output_kind=OutputKind.FINAL_ONLY)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(args.warm_steps):
        engine.step()
    before = sum(s.num_output_tokens for s in sched.running)
    sync(engine.runner.device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync(engine.runner.device)
    per_step = (time.perf_counter() - t0) / args.steps
    added = sum(s.num_output_tokens for s in sched.running) - before
    for s in list(sched.running):
        engine.abort(s.request_id)
    return per_step, added / args.steps


def measured_oracle(llm: LLM, args, k: int) -> dict:
    """Batch 1, every draft accepted: tok/s of the whole generate call against plain decoding's, same bits."""
    engine = llm.engine
    rng = random.Random(99)
    prompt = [rng.randrange(10, args.vocab - 10) for _ in range(args.input_len)]
    params = SamplingParams(temperature=0.0, max_tokens=args.oracle_tokens, ignore_eos=True, logprobs=1)
    results = {}
    for name, drafter in (("plain", None), ("oracle", "oracle")):
        engine.drafter = None if drafter is None else OracleDrafter([prompt + results["plain"][1]], k)
        engine.runner.use_graphs = engine.runner.graphs is not None
        llm.generate([prompt], params, use_tqdm=False)  # warm-up (and the plain run's tokens)
        engine.spec_stats = type(engine.spec_stats)()
        sync(engine.runner.device)
        t0 = time.perf_counter()
        [out] = llm.generate([prompt], params, use_tqdm=False)
        sync(engine.runner.device)
        seconds = time.perf_counter() - t0
        c = out.outputs[0]
        results[name] = (seconds, list(c.token_ids), [x.hex() for x in c.token_logprobs])
    same = results["plain"][1:] == results["oracle"][1:]
    assert same, "the oracle-drafted output differs from plain decoding's"
    n = len(results["plain"][1])
    steps = engine.spec_stats.num_drafts
    return {"k": k, "tokens": n, "plain_tok_s": n / results["plain"][0], "spec_tok_s": n / results["oracle"][0],
            "identical": same, "verify_chunks": steps}  # fmt: skip


def expected_tokens(a: float, k: int) -> float:
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen3 on the CPU (fp32): a smoke test")
    ap.add_argument("--layers", type=int, default=None, help="depth (default: the shape's)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--ks", default="1,3,7")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warm-steps", type=int, default=4)
    ap.add_argument("--oracle-tokens", type=int, default=256, help="new tokens of the full-acceptance runs")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    cuda = not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    shape = QWEN3_TINY if args.tiny else QWEN3_8B
    args.vocab = shape["vocab_size"]
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="lockstep-spec-"))
    build_checkpoint(workdir, shape, args.layers, device, weights=False)  # load_format="dummy"
    llm = LLM(
        str(workdir), device=str(device), dtype="bfloat16" if cuda else "float32", max_num_seqs=max(batches),
        max_model_len=4096 if cuda else 1024, enable_prefix_caching=False, gpu_memory_utilization=0.85,
        load_format="dummy", speculative_config={"method": "ngram", "num_speculative_tokens": max(ks)},
        max_num_batched_tokens=max(8192 if cuda else 256, max(batches) * (max(ks) + 1)),
    )  # fmt: skip
    report = {"args": vars(args), "device": torch.cuda.get_device_name(device) if cuda else "cpu", "steps": []}
    print(f"{'batch':>5} {'k':>3} {'graph ms':>9} {'eager ms':>9} {'verify ms':>10} {'vs graph':>9} {'tok/step':>9}")
    for batch in batches:
        graph_s, _ = time_steps(llm, batch, args, None, True, f"g{batch}")
        eager_s, _ = time_steps(llm, batch, args, None, False, f"e{batch}")
        for k in ks:
            # graphs on: verify chunks of k + 1 <= 8 tokens replay the decode graphs as one-token rows (session 13's
            # H200 run timed them eagerly, 32-52 ms against 5.2-7.2 for a plain graph step)
            verify_s, per_step = time_steps(llm, batch, args, FixedDrafter(k, args.vocab), True, f"v{batch}-{k}")
            row = {"batch": batch, "k": k, "plain_graph_ms": graph_s * 1e3, "plain_eager_ms": eager_s * 1e3,
                   "verify_ms": verify_s * 1e3, "tokens_per_step": per_step / batch}  # fmt: skip
            row["tok_s_by_acceptance"] = {
                str(a): batch * expected_tokens(a, k) / verify_s for a in (0.0, 0.5, 0.7, 0.8, 0.9, 1.0)
            }
            report["steps"].append(row)
            print(f"{batch:>5} {k:>3} {graph_s * 1e3:>9.2f} {eager_s * 1e3:>9.2f} {verify_s * 1e3:>10.2f} "
                  f"{verify_s / graph_s:>8.2f}x {per_step / batch:>9.2f}", flush=True)  # fmt: skip
    print("\ntok/s from the measured steps, each draft accepted with probability a (plain: graph steps)")
    alphas = (0.0, 0.5, 0.7, 0.8, 0.9, 1.0)
    print(f"{'batch':>5} {'k':>3} {'plain':>9}" + "".join(f"{'a=' + str(a):>9}" for a in alphas))
    for row in report["steps"]:
        plain = row["batch"] / row["plain_graph_ms"] * 1e3
        cells = "".join(f"{row['tok_s_by_acceptance'][str(a)]:>9.1f}" for a in alphas)
        print(f"{row['batch']:>5} {row['k']:>3} {plain:>9.1f}{cells}")
    print("\nbatch 1, every draft accepted (oracle drafter), measured over a whole generate call:")
    report["oracle"] = []
    for k in [k for k in ks if k >= 3] or ks[-1:]:
        r = measured_oracle(llm, args, k)
        report["oracle"].append(r)
        speedup = r["spec_tok_s"] / r["plain_tok_s"]
        print(f"  k={k}: {r['tokens']} tokens, plain {r['plain_tok_s']:.1f} tok/s, speculative "
              f"{r['spec_tok_s']:.1f} tok/s ({speedup:.2f}x), identical {r['identical']}")  # fmt: skip
    write_report(report, args.out, "spec_gpu.json")


if __name__ == "__main__":
    main()
