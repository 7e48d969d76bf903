"""Speculative decoding with and without async scheduling on the H200, Qwen3-8B shape (random weights): tok/s of
whole ``LLM.generate`` calls, and the bits asserted equal to plain synchronous decoding's.

    python bench/spec_async_gpu.py                     # H200: 36 layers, batches 1,16, k = 3
    python bench/spec_async_gpu.py --tiny              # CPU smoke test at a tiny size

Under async scheduling a verify step is read back before the next step is planned (its accepted count decides the
next positions), and a step that ran ahead (no drafts in it) lets the next one draft one token behind
(docs/design.md, "Async scheduling while speculating"). So the overlap depends on how often the drafter proposes.
The drafter here is an oracle (the target's own greedy continuation from a plain run: every draft accepted) that
proposes on a fraction ``--hit-rates`` of its calls and nothing otherwise, as an n-gram drafter that finds a match
only sometimes. For each batch and hit rate: plain decoding (sync, async) and speculative (sync, async) tok/s, and
steps per call. Prints a table; JSON to ``--out``.
"""

import argparse
import gc
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


class SometimesOracle:
    """Proposes the plain run's continuation of a sequence on a fraction ``hit_rate`` of calls (per sequence and
    length, so sync and async runs see the same choices for the same history), nothing otherwise."""

    def __init__(self, full: list[list[int]], hit_rate: float) -> None:
        self.full, self.hit_rate = full, hit_rate

    def propose(self, requests) -> list[list[int]]:
        out = []
        for r in requests:
            n = len(r.token_ids)
            hit = random.Random(n * 1000003 + r.seq_id).random() < self.hit_rate
            match = next((f for f in self.full if f[:n] == r.token_ids), None) if hit else None
            out.append([] if match is None else match[n : n + r.num_tokens])
        return out

    def release(self, seq_id: int) -> None:
        pass


def measure(workdir: Path, cases: list, params: SamplingParams, **engine_args) -> list[tuple[float, list, int]]:
    """``timed_generate`` for each ``(prompts, drafter)`` of ``cases`` (drafter None: plain decoding) on one engine,
    whose GPU memory is given back before the next engine starts. A drafter may be a function of the results so
    far (the oracle needs the plain run's tokens)."""
    results = []
    with LLM(str(workdir), **engine_args) as llm:
        for prompts, drafter in cases:
            llm.engine.drafter = drafter(results) if callable(drafter) else drafter
            results.append(timed_generate(llm, prompts, params))
        cuda = llm.engine.runner.device.type == "cuda"
    del llm
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return results


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list, int]:
    """Seconds of one generate call, its outputs (ids, logprob bits) and how many engine steps it took."""
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
    engine, steps = llm.engine, [0]
    step = engine.step
    engine.step = lambda: steps.__setitem__(0, steps[0] + 1) or step()
    sync(engine.runner.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(engine.runner.device)
    seconds = time.perf_counter() - t0
    engine.step = step
    return (
        seconds,
        [(list(o.outputs[0].token_ids), [x.hex() for x in o.outputs[0].token_logprobs]) for o in outs],
        steps[0],
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen3 on the CPU (fp32): a smoke test")
    ap.add_argument("--layers", type=int, default=None, help="depth (default: the shape's)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--hit-rates", default="0,0.5,1")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per request (default 256; tiny 24)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    cuda = not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    shape = QWEN3_TINY if args.tiny else QWEN3_8B
    tokens = args.tokens or (24 if args.tiny else 256)
    batches = [int(b) for b in args.batches.split(",")]
    rates = [float(r) for r in args.hit_rates.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="lockstep-spec-async-"))
    build_checkpoint(workdir, shape, args.layers, device, weights=False)  # load_format="dummy"
    common = dict(
        device=str(device), dtype="bfloat16" if cuda else "float32", max_num_seqs=max(batches),
        max_model_len=4096 if cuda else 1024, enable_prefix_caching=False, gpu_memory_utilization=0.45,
        load_format="dummy", seed=0,
    )  # fmt: skip
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    report = {"args": vars(args), "device": torch.cuda.get_device_name(device) if cuda else "cpu", "rows": []}
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=1)
    print(f"{'batch':>5} {'hit':>5} {'plain sync':>11} {'plain async':>12} {'spec sync':>10} {'spec async':>11} "
          f"{'async/sync':>11} {'identical':>9} {'steps: spec sync/async':>23}  (tok/s)")  # fmt: skip
    # One engine per setting (async off, on), each running every case: per batch, plain decoding, then the
    # oracle at each hit rate (it proposes the continuation that engine's own plain run produced).
    cases, keys = [], []
    for batch in batches:
        rng = random.Random(batch)
        prompts = [[rng.randrange(10, shape["vocab_size"] - 10) for _ in range(args.input_len)] for _ in range(batch)]
        plain_at = len(cases)
        cases.append((prompts, None))
        keys.append((batch, None))
        for rate in rates:
            oracle = lambda done, p=prompts, i=plain_at, r=rate: SometimesOracle(
                [x + out[0] for x, out in zip(p, done[i][1], strict=True)], r
            )
            cases.append((prompts, oracle))
            keys.append((batch, rate))
    got = {on: dict(zip(keys, measure(workdir, cases, params, async_scheduling=on, speculative_config=spec,
                                     **common), strict=True)) for on in (False, True)}  # fmt: skip
    for batch in batches:
        plain = {on: got[on][(batch, None)] for on in (False, True)}
        for rate in rates:
            spec_runs = {on: got[on][(batch, rate)] for on in (False, True)}
            same = spec_runs[False][1] == plain[False][1] == spec_runs[True][1] == plain[True][1]
            assert same, "speculative or async output differs from plain synchronous decoding's"
            n = batch * tokens
            row = {"batch": batch, "hit_rate": rate, "plain_sync_tok_s": n / plain[False][0],
                   "plain_async_tok_s": n / plain[True][0], "spec_sync_tok_s": n / spec_runs[False][0],
                   "spec_async_tok_s": n / spec_runs[True][0], "identical": same, "steps": {
                       "plain_sync": plain[False][2], "plain_async": plain[True][2],
                       "spec_sync": spec_runs[False][2], "spec_async": spec_runs[True][2]}}  # fmt: skip
            report["rows"].append(row)
            print(f"{batch:>5} {rate:>5.2f} {row['plain_sync_tok_s']:>11.1f} {row['plain_async_tok_s']:>12.1f} "
                  f"{row['spec_sync_tok_s']:>10.1f} {row['spec_async_tok_s']:>11.1f} "
                  f"{spec_runs[False][0] / spec_runs[True][0]:>10.2f}x {str(same):>9} "
                  f"{spec_runs[False][2]:>11}/{spec_runs[True][2]:<11}", flush=True)  # fmt: skip
    write_report(report, args.out, "spec_async_gpu.json")
    return report


if __name__ == "__main__":
    main()
