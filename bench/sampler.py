"""The sampler on one step's logits: the fused Gumbel-max (ops/gumbel.py) against the torch path it replaces, bit
for bit and in time; the sampled tokens' logprobs from row stats (``ops.log_softmax_at``) against the whole
log_softmax gathered; and the whole ``Sampler`` under greedy, plain temperature and Qwen3's chat defaults.

    python bench/sampler.py                 # CUDA: vocab 151936, rows 1, 64, 256
    python bench/sampler.py --smoke         # CPU, tiny (the interpreter)
    python bench/sampler.py --profile       # also each setting's GPU kernels at the largest row count

Prints a table; JSON goes to ``--out``.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # set before lockstep is imported

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import CHAT_SAMPLING  # noqa: E402

from lockstep import ops  # noqa: E402
from lockstep.layers import sampler  # noqa: E402
from lockstep.layers.sampler import Sampler  # noqa: E402
from lockstep.ops.gumbel import gumbel_argmax  # noqa: E402
from lockstep.sampling_params import SamplingParams  # noqa: E402

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "T=1": dict(temperature=1.0),
    "chat": CHAT_SAMPLING,
}


def ms(fn, reps: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def torch_path(x: torch.Tensor, keys: torch.Tensor):
    return sampler._argmax_lowest(x.double() + sampler._gumbel(keys[:, None], x.shape[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", default="1,64,256")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="torch.profiler: GPU time per kernel, largest --rows")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        args.rows, args.vocab, args.reps = "1,5", 3000, 2
    gen = torch.Generator(device=device).manual_seed(0)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, generator=gen, device=device) * 4
        keys = sampler._row_keys(list(range(rows)), [100 + r for r in range(rows)], device)[:, 0]
        r: dict = {"rows": rows}
        # Bits: the fused kernel against the torch path, on full rows and on rows top-k left 20 tokens.
        top20 = logits.masked_fill(logits < logits.topk(20, dim=-1).values[:, -1:], float("-inf"))
        for name, x in (("full", logits), ("top-k 20", top20)):
            t_f, b_f = gumbel_argmax(x, keys)
            t_t, b_t = torch_path(x, keys)
            r[f"same tokens, {name}"] = bool(torch.equal(t_f, t_t))
            r[f"same scores, {name}"] = bool(torch.equal(b_f, b_t))
        r["fused ms"] = ms(lambda: gumbel_argmax(logits, keys), args.reps)
        r["torch ms"] = ms(lambda: torch_path(logits, keys), args.reps)
        # The sampled tokens' logprobs from the row stats against the whole log_softmax gathered (the trainer's).
        index = torch.randint(args.vocab, (rows,), generator=gen, device=device)
        whole = lambda: ops.log_softmax(logits, -1).gather(1, index[:, None])[:, 0]  # noqa: E731
        r["log_softmax_at same bits"] = bool(torch.equal(ops.log_softmax_at(logits, index), whole()))
        r["log_softmax_at ms"] = ms(lambda: ops.log_softmax_at(logits, index), args.reps)
        r["log_softmax + gather ms"] = ms(whole, args.reps)
        for name, kwargs in SETTINGS.items():
            params = [SamplingParams(seed=i, **kwargs) for i in range(rows)]
            positions = [7] * rows
            s = Sampler()
            r[f"Sampler {name} ms"] = ms(lambda: s.sample(logits, params, positions), args.reps)
        results.append(r)
        print(json.dumps(r), flush=True)
    print(f"\nsampler | {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'} | vocab {args.vocab}")
    for k in results[0]:
        cells = (str(round(r[k], 3) if isinstance(r[k], float) else r[k]) for r in results)
        print(f"{k:28s} " + " ".join(f"{c:>10s}" for c in cells))
    if args.profile and device == "cuda":
        profile(logits, args.reps)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sampler_bench.json").write_text(json.dumps({"device": device, "results": results}, indent=1))


def profile(logits: torch.Tensor, reps: int) -> None:
    """Where each setting's GPU time goes: the kernels of ``reps`` calls, by total device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    rows = logits.shape[0]
    for name, kwargs in SETTINGS.items():
        params = [SamplingParams(seed=i, **kwargs) for i in range(rows)]
        s = Sampler()
        s.sample(logits, params, [7] * rows)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                s.sample(logits, params, [7] * rows)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.self_device_time_total for e in events) / reps / 1e3
        print(f"\n{name}, {rows} rows: {total:.3f} ms of GPU time a call")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:10]:
            print(f"  {e.self_device_time_total / reps / 1e3:8.3f} ms  {e.count // reps:3d}x  {e.key[:90]}")


if __name__ == "__main__":
    main()
