"""Issue 30's engine speed goals with FP8: the batch-1 decode step and 256 x 1024/1024 (and, with --thousand,
1000 x 1000/1000 output throughput), for bf16, FP8 weights, and FP8 weights + FP8 KV, with bit checks.

    python bench/fp8_engine.py                      # H200: Qwen3-8B shape, 36 layers, random weights (dummy load)
    python bench/fp8_engine.py --thousand           # also 1000 x 1000/1000 (a few more minutes)
    python bench/fp8_engine.py --tiny               # CPU: toy shape, seconds (what CI runs)
    python bench/fp8_engine.py --configs fp8,fp8-block --requests 16   # online FP8 against a block-FP8 checkpoint

Each config loads one ``LLM`` (``load_format="dummy"``: random weights; online FP8 quantizes them per channel) and:
- times ``--steps`` batch-1 decode steps of the whole engine after ``--warm`` (CUDA graphs where the set has them,
  then eagerly), the two giving the same tokens and logprob bits (``graph_equals_eager``); the floor is the bytes
  a step reads (the weights but the embedding table) over the measured copy bandwidth;
- runs ``--requests`` x ``--input-len``/``--output-len`` greedy requests of random tokens in one ``generate``
  (wall time, output tok/s), then two of them again alone for their first ``CHECK_TOKENS`` tokens: the same ids
  and logprob bits as in the batch (``alone_equals_batched``, FP8 KV included).
Goals (issue 30): decode <= 2.5 ms, 256 x 1024/1024 <= 22 s, 1000 x 1000/1000 >= 14,000 output tok/s. Prints a
table; JSON to ``--out``/fp8_engine.json.
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
from engine import QWEN3_8B, QWEN3_TINY, build_checkpoint, mark_fp8_block  # noqa: E402

from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.outputs import OutputKind  # noqa: E402

CONFIGS = {"bf16": {}, "fp8": {"quantization": "fp8"}, "fp8+kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
# Opt-in (--configs): a Qwen3-FP8-style checkpoint (128 x 128 block weights, activations per 128 columns, whose
# quantization the matmul can fuse, where its table says so) instead of online FP8 (per-channel weights, per-token
# activations).
BLOCK_CONFIGS = {"fp8-block": {}, "fp8-block+kv": {"kv_cache_dtype": "fp8"}}
GOALS = {"decode_ms": 2.5, "s256": 22.0, "tok_s_1000": 14_000.0}
CHECK_TOKENS = 32


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read plus written), over 4 GiB; None on the CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 31, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * 10 / (time.perf_counter() - t0)


def decode_steps(llm: LLM, args, graphs: bool, vocab: int) -> tuple[float, list]:
    """Mean seconds per batch-1 decode step, and the timed request's (token ids, logprobs)."""
    engine = llm.engine
    engine.runner.use_graphs = graphs and engine.runner.graphs is not None
    device = engine.runner.device
    rng = random.Random(1)
    prompt = [rng.randrange(vocab) for _ in range(args.decode_prompt)]
    params = SamplingParams(temperature=0.0, max_tokens=args.warm + args.steps + 1, ignore_eos=True)
    engine.add_request(f"decode-{graphs}", prompt, params, output_kind=OutputKind.FINAL_ONLY)
    for _ in range(1 + args.warm):  # the prefill, then warm steps
        engine.step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync(device)
    per_step = (time.perf_counter() - t0) / args.steps
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    return per_step, [(o.token_ids, o.token_logprobs) for o in outs]


def throughput(llm: LLM, n: int, input_len: int, output_len: int, vocab: int) -> dict:
    """One ``generate`` of ``n`` greedy requests; then two of them alone for their first tokens (bit check)."""
    device = llm.engine.runner.device
    rng = random.Random(7)
    prompts = [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    check = min(CHECK_TOKENS, output_len)
    same = []
    for i in (0, n - 1):
        [alone] = llm.generate([prompts[i]], SamplingParams(temperature=0.0, max_tokens=check, ignore_eos=True),
                               use_tqdm=False)  # fmt: skip
        batched = outs[i].outputs[0]
        same.append(
            alone.outputs[0].token_ids == batched.token_ids[:check]
            and alone.outputs[0].token_logprobs == batched.token_logprobs[:check]
        )
    return {"requests": n, "input_len": input_len, "output_len": output_len, "seconds": round(seconds, 3),
            "output_tok_s": round(tokens / seconds, 1), "alone_equals_batched": all(same)}  # fmt: skip


def run_config(name: str, folder: Path, args, device: torch.device, vocab: int, bandwidth: float | None) -> dict:
    largest = max(args.requests, 1000 if args.thousand else 0)
    longest = max(args.input_len + args.output_len, 2000 if args.thousand else 0, args.decode_prompt + 64)
    t0 = time.perf_counter()
    llm = LLM(
        str(folder), device=device.type, dtype="bfloat16" if device.type == "cuda" else "float32",
        load_format="dummy", max_num_seqs=largest, max_model_len=longest + 16, max_num_batched_tokens=8192,
        enable_prefix_caching=False, gpu_memory_utilization=0.85, seed=0, **(CONFIGS | BLOCK_CONFIGS)[name],
    )  # fmt: skip
    r = {"config": name, "startup_s": round(time.perf_counter() - t0, 1)}
    model = llm.engine.runner.model
    r["weight_gb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    # What a batch-1 step reads: every weight but the embedding table (a row of it), unless the head shares it.
    embed = model.model.embed_tokens.weight
    read_gb = r["weight_gb"] - (0 if model.config.tie_word_embeddings else embed.numel() * embed.element_size() / 1e9)
    r["floor_ms"] = read_gb * 1e9 / bandwidth * 1e3 if bandwidth else None
    r["kv_blocks"] = llm.engine.config.num_kv_blocks
    has_graphs = llm.engine.runner.graphs is not None
    t_graph = out_graph = None
    if has_graphs:
        t_graph, out_graph = decode_steps(llm, args, True, vocab)
    t_eager, out_eager = decode_steps(llm, args, False, vocab)
    r["decode_graph_ms"] = None if t_graph is None else round(t_graph * 1e3, 3)
    r["decode_eager_ms"] = round(t_eager * 1e3, 3)
    r["graph_equals_eager"] = None if out_graph is None else out_graph == out_eager
    llm.engine.runner.use_graphs = has_graphs
    r["run"] = throughput(llm, args.requests, args.input_len, args.output_len, vocab)
    if args.thousand:
        r["thousand"] = throughput(llm, 1000, 1000, 1000, vocab)
    del llm, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return r


def print_table(rows: list[dict], args) -> None:
    print(f"\n{'config':12} {'weights GB':>10} {'floor ms':>8} {'decode ms':>9} {'graph=eager':>11} "
          f"{f'{args.requests}x{args.input_len}/{args.output_len} s':>18} {'out tok/s':>10} {'alone=batch':>11}"
          + ("  1000x1000/1000 tok/s" if args.thousand else ""))  # fmt: skip
    for r in rows:
        decode = r["decode_graph_ms"] if r["decode_graph_ms"] is not None else r["decode_eager_ms"]
        floor = f"{r['floor_ms']:.2f}" if r["floor_ms"] else "-"
        line = (f"{r['config']:12} {r['weight_gb']:10.2f} {floor:>8} {decode:9.3f} {str(r['graph_equals_eager']):>11} "
                f"{r['run']['seconds']:18.2f} {r['run']['output_tok_s']:10.1f} "
                f"{str(r['run']['alone_equals_batched']):>11}")  # fmt: skip
        if "thousand" in r:
            line += f"  {r['thousand']['output_tok_s']:.0f} (same bits: {r['thousand']['alone_equals_batched']})"
        print(line)
    print(f"goals (H200, fp8+kv): decode <= {GOALS['decode_ms']} ms, 256 x 1024/1024 <= {GOALS['s256']} s, "
          f"1000 x 1000/1000 >= {GOALS['tok_s_1000']:,.0f} output tok/s")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="toy shape on the CPU (the default without a GPU)")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS | BLOCK_CONFIGS)}")
    ap.add_argument("--requests", type=int, default=None, help="default 256 (tiny: 6)")
    ap.add_argument("--input-len", type=int, default=None, help="default 1024 (tiny: 24)")
    ap.add_argument("--output-len", type=int, default=None, help="default 1024 (tiny: 12)")
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (default 64; tiny: 4)")
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--thousand", action="store_true", help="also 1000 x 1000/1000 output throughput")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    tiny = args.tiny or not torch.cuda.is_available()
    device = torch.device("cpu" if tiny else "cuda")
    defaults = (6, 24, 12, 4) if tiny else (256, 1024, 1024, 64)
    for key, value in zip(("requests", "input_len", "output_len", "steps"), defaults, strict=True):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if tiny:
        args.decode_prompt, args.warm = min(args.decode_prompt, 16), min(args.warm, 2)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if set(configs) - set(CONFIGS) - set(BLOCK_CONFIGS):
        ap.error(f"--configs: choose from {', '.join(CONFIGS | BLOCK_CONFIGS)}")
    shape = QWEN3_TINY if tiny else QWEN3_8B
    folder = Path(tempfile.mkdtemp(prefix="lockstep-fp8-engine-"))
    build_checkpoint(folder, shape, None if tiny else args.layers, device, weights=False)
    block_folder = Path(tempfile.mkdtemp(prefix="lockstep-fp8-block-engine-"))
    if set(configs) & set(BLOCK_CONFIGS):
        build_checkpoint(block_folder, shape, None if tiny else args.layers, device, weights=False)
        mark_fp8_block(block_folder)
    bandwidth = copy_bandwidth(device)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "args": vars(args),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "copy_bandwidth": bandwidth, "goals": GOALS, "results": []}  # fmt: skip
    for name in configs:
        where = block_folder if name in BLOCK_CONFIGS else folder
        r = run_config(name, where, args, device, shape["vocab_size"], bandwidth)
        report["results"].append(r)
        print(json.dumps(r), flush=True)
    print_table(report["results"], args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_engine.json").write_text(json.dumps(report, indent=1))
    bad = [r["config"] for r in report["results"] if not r["run"]["alone_equals_batched"]]
    bad += [r["config"] for r in report["results"] if r["graph_equals_eager"] is False]
    if bad:
        raise SystemExit(f"bits differ: {bad}")


if __name__ == "__main__":
    main()
