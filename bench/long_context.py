"""Long-context serving: time to first token and decode step time at 8k-32k context, the invariant and the fast
(``default``) kernel sets in one run, each figure beside its floor.

    python bench/long_context.py --out $OUT              # CUDA: Qwen3-8B shape, 36 layers, random bf16 weights
    python bench/long_context.py --tiny --out /tmp/lc    # a toy Qwen3 (2 layers) on the CPU: what the test runs

The engine as a user runs it: one ``LLM`` per kernel set (random weights drawn by ``load_format="dummy"``, prefix
caching off, ``max_model_len`` the model's whole context unless ``--max-model-len``), prompts of random token ids,
greedy. Time to first token: ``LLM.generate`` of one prompt of each context with ``max_tokens=1``, after one
untimed prompt of that length (the first compiles nothing then: the engine's warm-up stops at 8192 tokens, and a
longer prompt is prefilled in chunks of the step budget); the best of ``--repeats``. Decode: ``--batches`` requests
of each context prefilled, ``--warm-steps`` steps, then ``--steps`` timed engine steps (CUDA graphs on, as served).

Floors, measured in the same run with torch: decode reads every weight and the K/V of every row at its mean timed
context, over the device-to-device copy bandwidth (bytes read plus written per second, as bench/decode_step.py);
prefill does the prompt's FLOPs (linear layers over every token, the causal attention's QK^T and PV, the LM head
over the one sampled row) at the measured bf16 matmul rate (an 8192^3 ``torch.mm``). Contexts past the model's
``max_position_embeddings`` are skipped and said so (Qwen3-8B's 40,960 leaves out 128k: its config sets no rope
scaling), as are batches whose K/V the cache cannot hold. Prints a table last; JSON to ``--out``.
"""

import argparse
import gc
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
from engine import QWEN3_8B, QWEN3_TINY, build_checkpoint  # noqa: E402

from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.outputs import OutputKind  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus written), best of 10 copies of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an ``n x n x n`` ``torch.mm`` in ``dtype``, best of 10."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def prefill_flops(shape: dict, layers: int, n: int) -> float:
    """FLOPs of a causal prefill of ``n`` tokens of a Llama/Qwen3 ``shape``, sampling one token: every linear layer
    over every token (2 per weight a token), QK^T and PV over the causal triangle (4 * head_dim per (query, key,
    head) pair: query i sees i keys), and the LM head over one row. Norms, rotary and the softmax are left out."""
    hidden, inter, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    hq, hkv = shape["num_attention_heads"], shape["num_key_value_heads"]
    per_token = hidden * (hq + 2 * hkv) * d + hq * d * hidden + 3 * hidden * inter  # qkv, o, gate/up/down weights
    attention = 4 * d * hq * n * (n + 1) / 2
    return layers * (2 * n * per_token + attention) + 2 * hidden * shape["vocab_size"]


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab // 8, vocab - 1) for _ in range(n)]  # away from the special ids at either end


def time_to_first_token(llm: LLM, n: int, rng: random.Random, repeats: int, vocab: int) -> float:
    """Best seconds of ``LLM.generate`` of one ``n``-token prompt to its first (greedy) token, after an untimed one."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    device = llm.engine.runner.device
    best = float("inf")
    for i in range(repeats + 1):
        prompt = {"prompt_token_ids": random_prompt(rng, n, vocab)}
        sync(device)
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)
        sync(device)
        assert len(out[0].outputs[0].token_ids) == 1
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def decode_step_time(llm: LLM, batch: int, n: int, args, rng: random.Random, vocab: int) -> float:
    """Mean seconds per engine step of ``batch`` requests decoding after ``n``-token prompts (graphs as configured)."""
    engine = llm.engine
    device = engine.runner.device
    # Room to decode while the batch's other prompts are still prefilling: with max_tokens = the timed steps, the
    # first rows of 16 x 32k finished before the last one's prefill did, and the timed steps ran a few rows.
    params = SamplingParams(temperature=0.0, max_tokens=engine.config.max_model_len - n, ignore_eos=True)
    ids = [f"decode-{batch}-{n}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, random_prompt(rng, n, vocab), params, output_kind=OutputKind.FINAL_ONLY)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(args.warm_steps):
        engine.step()
    running = len(sched.running)  # the whole batch, or the step times are not what the row says
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync(device)
    per_step = (time.perf_counter() - t0) / args.steps
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return per_step, running


def kv_capacity_ok(llm: LLM, batch: int, n: int, extra: int) -> bool:
    """Whether the K/V cache holds ``batch`` sequences of ``n + extra`` tokens at once (no preemption while timed)."""
    config = llm.engine.config
    blocks = -(-(n + extra) // config.block_size)
    return batch * blocks <= config.num_kv_blocks


def measure(llm: LLM, mode: str, shape: dict, layers: int, contexts: list[int], batches: list[int], args,
            report: dict) -> None:  # fmt: skip
    """Time to first token and decode step times of one kernel set's ``llm``, each with its floor, into ``report``."""
    runner, config = llm.engine.runner, llm.engine.config
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_token_bytes = sum(2 * k[0, 0].numel() * k.element_size() for k, _ in runner.kv_caches)  # K and V, all layers
    extra = args.warm_steps + args.steps + 2
    rng = random.Random(0)  # the same prompts for every mode
    vocab = shape["vocab_size"]
    rows = report["results"]
    for n in contexts:
        ttft = time_to_first_token(llm, n, rng, args.repeats, vocab)
        floor = prefill_flops(shape, layers, n) / report["matmul_flops_per_s"]
        rows.append({"mode": mode, "what": "ttft", "context": n, "batch": 1, "ms": ttft * 1e3, "floor_ms": floor * 1e3})
        print(json.dumps(rows[-1]), flush=True)
        for b in batches:
            if not kv_capacity_ok(llm, b, n, extra):
                why = f"the K/V cache holds {config.num_kv_blocks * config.block_size:,} tokens"
                report["skipped"].append({"mode": mode, "context": n, "batch": b, "why": why})
                continue
            step, running = decode_step_time(llm, b, n, args, rng, vocab)
            context = n + args.warm_steps + args.steps / 2  # the rows' mean context over the timed steps
            floor = (weight_bytes + b * context * kv_token_bytes) / report["copy_bandwidth"]
            rows.append({"mode": mode, "what": "decode", "context": n, "batch": b, "ms": step * 1e3,
                         "floor_ms": floor * 1e3, "running": running})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a toy Qwen3 at contexts 64/128 (runs on the CPU)")
    ap.add_argument("--layers", type=int, default=None, help="default: 36 (2 with --tiny)")
    ap.add_argument("--contexts", default=None, help="default 8192,16384,32768,131072 (64,128,131072 with --tiny)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--modes", default="invariant,default")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warm-steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="timed prompts per context for time to first token")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = QWEN3_TINY if args.tiny else QWEN3_8B
    layers = args.layers or (2 if args.tiny else 36)
    contexts = [
        int(c) for c in (args.contexts or ("64,128,131072" if args.tiny else "8192,16384,32768,131072")).split(",")
    ]
    batches = [int(b) for b in args.batches.split(",")]
    max_pos = shape["max_position_embeddings"]
    extra = args.warm_steps + args.steps + 2  # tokens a decode request adds past its prompt
    max_model_len = args.max_model_len or max_pos
    skipped = []
    for n in contexts:
        if n + extra > max_pos:
            skipped.append({"context": n, "why": f"past the model's max_position_embeddings ({max_pos:,}; no rope "
                                                 "scaling in its config)"})  # fmt: skip
        elif n + extra > max_model_len:
            skipped.append({"context": n, "why": f"past --max-model-len {max_model_len:,}"})
    kept = [n for n in contexts if n + extra <= min(max_pos, max_model_len)]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the CPU's matmuls are fp32 ones

    bandwidth = copy_bandwidth(device, (1 << 31) if device.type == "cuda" else (1 << 26))
    mm_rate = matmul_rate(device, dtype, 8192 if device.type == "cuda" else 512)
    report = {"args": vars(args), "device": str(device), "layers": layers, "max_model_len": max_model_len,
              "copy_bandwidth": bandwidth, "matmul_flops_per_s": mm_rate, "startup_s": {}, "results": [],
              "skipped": skipped}  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="lockstep-longctx-"))
    build_checkpoint(workdir, shape, layers, device, weights=False)  # load_format="dummy": the engine draws them
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        llm = LLM(
            str(workdir), kernels=mode, device=device.type, dtype=str(dtype).removeprefix("torch."),
            max_num_seqs=max(batches), max_model_len=max_model_len, enable_prefix_caching=False,
            gpu_memory_utilization=args.gpu_memory_utilization, load_format="dummy",
        )  # fmt: skip
        report["startup_s"][mode] = time.perf_counter() - t0
        measure(llm, mode, shape, layers, kept, batches, args, report)
        llm.close()
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for r in report["results"]:
        r["x_floor"] = r["ms"] / r["floor_ms"]
    report["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report["versions"] = {"torch": torch.__version__, "gpu": gpu}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_context.json").write_text(json.dumps(report, indent=2))
    print(f"\nlong context, Qwen3{'-tiny' if args.tiny else '-8B'} shape, {layers} layers, max_model_len "
          f"{max_model_len:,}, {gpu}: copy {bandwidth / 1e12:.3f} TB/s, {dtype} matmul "
          f"{mm_rate / 1e12:.1f} TFLOP/s")  # fmt: skip
    print(f"{'mode':10s}{'what':>8s}{'context':>9s}{'batch':>6s}{'ms':>11s}{'floor ms':>11s}{'x floor':>9s}")
    for r in report["results"]:
        print(f"{r['mode']:10s}{r['what']:>8s}{r['context']:>9d}{r['batch']:>6d}{r['ms']:>11.2f}"
              f"{r['floor_ms']:>11.2f}{r['x_floor']:>9.2f}")  # fmt: skip
    for s in skipped:
        where = f"{s['mode']} batch {s['batch']} at " if "mode" in s else ""
        print(f"skipped: {where}context {s['context']:,}: {s['why']}")
    return report


if __name__ == "__main__":
    main()
