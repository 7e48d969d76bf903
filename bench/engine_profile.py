"""Where a decode step's time goes: cProfile of the engine on a random Qwen3-8B-shaped checkpoint.

    python bench/engine_profile.py --layers 8 --batch 256 --input-len 1024 --output-len 32

Builds the checkpoint like bench/engine.py, prefills ``--batch`` requests, runs ``--warm-steps`` decode steps
(Triton compiles the decode shapes there), then profiles ``--output-len`` decode steps of each kernel set and
prints the step time, the functions with the most own time and the engine's per-step phases (cumulative). The
host waits for the GPU only where it reads results back (``.tolist()``), so a GPU-bound step shows up there and
a host-bound one everywhere else.
"""

import argparse
import cProfile
import io
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import QWEN3_8B, build_checkpoint  # noqa: E402

from lockstep import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--warm-steps", type=int, default=8, help="decode steps run before profiling")
    ap.add_argument("--modes", default="invariant,default")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    workdir = Path(tempfile.mkdtemp(prefix="lockstep-profile-"))
    build_checkpoint(workdir, QWEN3_8B, args.layers, device)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100_000) for _ in range(args.input_len)] for _ in range(args.batch)]
    for mode in args.modes.split(","):
        seq_len = args.input_len + args.warm_steps + args.output_len + 1
        llm = LLM(
            str(workdir), batch_invariant=mode == "invariant", device=str(device), dtype="bfloat16",
            max_num_seqs=args.batch, num_kv_blocks=args.batch * (seq_len // 16 + 1) + 64,
            max_model_len=seq_len + 16, enable_prefix_caching=False,
        )  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=args.warm_steps + args.output_len + 1, ignore_eos=True)
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        engine = llm.engine
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        sched = engine.scheduler
        while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
            engine.step()  # the prefills (and the first decodes that ride along)
        for _ in range(args.warm_steps):
            engine.step()  # Triton compiles the decode shapes here, not in the profile
        torch.cuda.synchronize() if device.type == "cuda" else None
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        steps = 0
        while engine.has_unfinished_requests() and steps < args.output_len:
            engine.step()
            steps += 1
        prof.disable()
        dt = time.perf_counter() - t0
        print(f"\n=== {mode}: {steps} decode steps at batch {args.batch}, {dt / steps * 1e3:.1f} ms a step ===")
        for key, n in (("tottime", 25), ("cumulative", 30)):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(n)
            print(buf.getvalue().split("\n", 4)[-1])
        del llm, engine
        torch.cuda.empty_cache() if device.type == "cuda" else None


if __name__ == "__main__":
    main()
