"""Where a decode step's time goes: cProfile of the engine on a random Qwen3-8B-shaped checkpoint.

    python bench/engine_profile.py --layers 8 --batch 256 --input-len 1024 --output-len 32
    python bench/engine_profile.py --layers 36 --batch 1 --input-len 128 --modes invariant --quantization fp8
    python bench/engine_profile.py --layers 36 --batch 1 --input-len 128 --modes invariant --fp8-block
    python bench/engine_profile.py --tiny --batch 2 --input-len 16 --output-len 4   # CPU: toy shape, seconds

Builds the checkpoint like bench/engine.py, prefills ``--batch`` requests, runs ``--warm-steps`` decode steps
(Triton compiles the decode shapes there), then for each kernel set: ``--output-len`` steps timed plainly,
``--output-len`` steps under cProfile (the functions with the most own time, and cumulative: the host waits for
the GPU only where it reads results back, ``.tolist()``), and on CUDA a few steps under torch.profiler (GPU time
by kernel, and how much of a step the GPU is busy). ``--quantization fp8`` (online FP8 weights: per-channel weight
scales, per-token activation scales) and ``--kv-cache-dtype fp8`` go to the engine as they are; ``--fp8-block``
makes the checkpoint Qwen3-FP8's layout instead (block weights, activations per 128 columns: the layout whose
activation quantization the matmul can fuse; the table does not, docs/design.md).
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
from engine import QWEN3_8B, QWEN3_TINY, build_checkpoint, mark_fp8_block  # noqa: E402

from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.outputs import OutputKind  # noqa: E402

KERNEL_STEPS = 4  # decode steps under torch.profiler (CUDA)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--warm-steps", type=int, default=8, help="decode steps run before profiling")
    ap.add_argument("--modes", default="invariant,default")
    ap.add_argument("--quantization", default=None, help='the engine\'s quantization ("fp8": online FP8 weights)')
    ap.add_argument("--kv-cache-dtype", default="auto", help='the engine\'s kv_cache_dtype ("fp8": e4m3 caches)')
    ap.add_argument(
        "--fp8-block",
        action="store_true",
        help="a Qwen3-FP8-style checkpoint (128 x 128 block weights, activations per 128 columns)",
    )
    ap.add_argument("--tiny", action="store_true", help="a toy Qwen3 shape (2 layers, hidden 64): checks the script")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    workdir = Path(tempfile.mkdtemp(prefix="lockstep-profile-"))
    shape = QWEN3_TINY if args.tiny else QWEN3_8B
    build_checkpoint(workdir, shape, None if args.tiny else args.layers, device, weights=False)  # load_format="dummy"
    if args.fp8_block:
        mark_fp8_block(workdir)
    rng = random.Random(0)
    low, high = (1, shape["vocab_size"] - 1) if args.tiny else (1000, 100_000)
    prompts = [[rng.randrange(low, high) for _ in range(args.input_len)] for _ in range(args.batch)]
    what = (
        f"quantization={args.quantization}, kv_cache_dtype={args.kv_cache_dtype}, fp8 block checkpoint={args.fp8_block}"
    )
    for mode in args.modes.split(","):
        decode_steps = args.warm_steps + 2 * args.output_len + KERNEL_STEPS
        # Room for the decode steps that ride along with other requests' prefills too: every request must still
        # be running in the profiled steps.
        seq_len = args.input_len + 2 * decode_steps + 64
        llm = LLM(
            str(workdir), kernels=mode, device=str(device), dtype="bfloat16" if device.type == "cuda" else "float32",
            max_num_seqs=args.batch, num_kv_blocks=args.batch * (seq_len // 16 + 1) + 64,
            max_model_len=seq_len + 16, enable_prefix_caching=False, load_format="dummy",
            quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        )  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=seq_len - args.input_len, ignore_eos=True)
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        engine = llm.engine
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params, output_kind=OutputKind.DELTA)
        sched = engine.scheduler
        while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
            engine.step()  # the prefills (and the first decodes that ride along)
        for _ in range(args.warm_steps):
            engine.step()  # Triton compiles the decode shapes here, not in the profile
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.output_len):
            engine.step()
        sync()
        plain = (time.perf_counter() - t0) / args.output_len
        print(f"\n=== {mode} ({what}): decode at batch {args.batch}: {plain * 1e3:.2f} ms a step (no profiler) ===")

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.output_len):
            engine.step()
        prof.disable()
        for key, n in (("tottime", 25), ("cumulative", 40)):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(n)
            print(buf.getvalue())

        if device.type == "cuda":
            # GPU time by kernel over a few steps: how much of a step the GPU is busy, and with what.
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                for _ in range(KERNEL_STEPS):
                    engine.step()
                sync()
            events = tp.key_averages()
            busy = sum(e.self_device_time_total for e in events) / 1e3 / KERNEL_STEPS
            print(f"GPU kernel time {busy:.1f} ms a step (torch.profiler, {KERNEL_STEPS} steps)")
            print(events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))
        del llm, engine
        torch.cuda.empty_cache() if device.type == "cuda" else None


if __name__ == "__main__":
    main()
