"""The RL trainer over an FP8 mixture-of-experts sampler on a GPU: the trainer's logprobs against the sampler's bits,
and the time of a trainer step, at Qwen3-30B-A3B's shape cut to a few layers (random weights).

    python bench/fp8_moe_rl.py --out DIR             # H200: Qwen3-30B-A3B shape, 2 of 48 layers (a few minutes)
    python bench/fp8_moe_rl.py --tiny --out DIR      # toy shape; without a GPU on the CPU path (what CI runs)

A random bf16 checkpoint of the shape (bench/moe_engine.py's ``build_checkpoint``: hidden 2048, 128 experts of 768,
top 8, 32 q / 4 kv heads of 128, vocab 151936) and the same weights as a Qwen3-FP8 block checkpoint (128 x 128
block scales; tests/fp8_checkpoints.py). Cases: online FP8, online FP8 with the chunk tree, the block checkpoint,
and the block checkpoint with the tree (its experts' chunks of 96 columns cut the 128-column blocks: computed in
pieces). For each, the engine samples ``--requests`` random prompts (temperature 1, seeded), is dropped, and a
``load_policy`` trainer of the same folder (full-precision masters, FP8 layers and FP8 experts quantized in the
forward, ``models.quantization.train_fp8``) recomputes their logprobs; every logprob must have the sampler's bits.
A trainer step (``token_logprobs`` + backward of their sum) is timed ``--reps`` times, and the experts' masters
must get finite, nonzero gradients. Negative control: the bf16 trainer of the same weights against the online-FP8
samples must differ. Prints a table; writes fp8_moe_rl.json to ``--out``. Exits 1 if a check fails.
"""

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # set before lockstep is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fp8_checkpoints import save_fp8  # noqa: E402
from moe_engine import MODELS, build_checkpoint  # noqa: E402

from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.layers.moe import SparseMoeBlock  # noqa: E402
from lockstep.rl import load_policy, token_logprobs  # noqa: E402

CASES = {
    "online": ("full", {"quantization": "fp8"}),
    "online-tree": ("full", {"quantization": "fp8", "tp_invariant": True}),
    "fp8-block": ("fp8-block", {}),
    "fp8-block-tree": ("fp8-block", {"tp_invariant": True}),
}
FAILURES: list[str] = []


def fail(msg: str) -> None:
    FAILURES.append(msg)
    print("FAIL:", msg)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def requests(args, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len + 7 * i)] for i in range(args.requests)]
    params = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=args.output_len, ignore_eos=True)
        for i in range(args.requests)
    ]
    return prompts, params


def sample(folder: Path, kwargs: dict, args, prompts, params) -> tuple[list, float]:
    llm = LLM(
        str(folder), device=args.device, dtype=args.dtype, max_model_len=args.input_len + 8 * args.requests
        + args.output_len, max_num_seqs=args.requests, gpu_memory_utilization=0.35, seed=0, **kwargs,
    )  # fmt: skip
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    del llm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs) for o in outs], seconds


def compare(policy, prompts, samples, micro_batch_size: int) -> tuple[int, float, list]:
    """(sequences whose every logprob has the sampler's bits, the largest difference, the logprobs)."""
    lps = token_logprobs(policy, prompts, [t for t, _ in samples], micro_batch_size=micro_batch_size)
    same, worst = 0, 0.0
    for lp, (_, ref) in zip(lps, samples, strict=True):
        ref = torch.tensor(ref, dtype=torch.float32)
        got = lp.detach().float().cpu()
        same += int(torch.equal(got, ref))
        worst = max(worst, (got - ref).abs().max().item())
    return same, worst, lps


def run_case(name: str, folders: dict, args, prompts, params) -> dict:
    which, kwargs = CASES[name]
    samples, sample_s = sample(folders[which], kwargs, args, prompts, params)
    policy = load_policy(folders[which], device=args.device, dtype=getattr(torch, args.dtype), **kwargs)
    blocks = [m for m in policy.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks or any(b.fp8_train is None for b in blocks):
        fail(f"{name}: the trainer's experts are not FP8 experts")
    same, worst, _ = compare(policy, prompts, samples, args.micro_batch_size)
    if same != len(samples):
        fail(f"{name}: {len(samples) - same} of {len(samples)} sequences differ from the sampler (max {worst:.3g})")
    times = []
    for _ in range(args.reps):
        policy.zero_grad(set_to_none=True)
        sync(args.device)
        t0 = time.perf_counter()
        lps = token_logprobs(policy, prompts, [t for t, _ in samples], micro_batch_size=args.micro_batch_size)
        sum(lp.sum() for lp in lps).backward()
        sync(args.device)
        times.append(time.perf_counter() - t0)
    grads_ok = all(
        p.grad is not None and bool(torch.isfinite(p.grad).all()) and p.grad.abs().sum().item() > 0
        for b in blocks
        for p in (b.w13, b.w2)
    )
    if not grads_ok:
        fail(f"{name}: an expert master has no finite, nonzero gradient")
    tokens = sum(len(p) + len(t) for p, (t, _) in zip(prompts, samples, strict=True))
    del policy, blocks, lps
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {
        "case": name, "sequences": len(samples), "bitwise_equal": same, "max_abs_diff": worst, "grads_ok": grads_ok,
        "tokens": tokens, "sample_s": round(sample_s, 3), "step_s": round(min(times), 4),
        "step_s_all": [round(t, 4) for t in times], "samples": samples,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="toy shape (the default without a GPU)")
    ap.add_argument("--layers", type=int, default=2, help="depth of the Qwen3-30B-A3B shape (of 48)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--requests", type=int, default=None, help="default 8 (tiny: 3)")
    ap.add_argument("--input-len", type=int, default=None, help="default 256 (tiny: 12)")
    ap.add_argument("--output-len", type=int, default=None, help="default 64 (tiny: 5)")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--reps", type=int, default=None, help="timed trainer steps (default 3; tiny: 1)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    args.tiny = args.tiny or not cuda
    args.device, args.dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    for key, full, tiny in (("requests", 8, 3), ("input_len", 256, 12), ("output_len", 64, 5), ("reps", 3, 1)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    full_shape, tiny_shape, _, _ = MODELS["qwen3-30b-a3b"]
    # tiny: 16 heads of 64, so o_proj's K of 1024 lets the block layout run the chunk tree (8 chunks of 128 columns)
    shape = dict(tiny_shape, num_attention_heads=16, head_dim=64) if args.tiny else full_shape
    layers = tiny_shape["num_hidden_layers"] if args.tiny else args.layers
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "tiny": args.tiny, "layers": layers}
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "bf16"
        build_checkpoint(full, shape, layers, torch.device(args.device))
        folders = {"full": full}
        if any(CASES[c][0] == "fp8-block" for c in args.cases.split(",")):
            folders["fp8-block"] = save_fp8(full, Path(tmp) / "fp8-block", "fp8-block")
        prompts, params = requests(args, shape["vocab_size"])
        rows = [run_case(name, folders, args, prompts, params) for name in args.cases.split(",")]
        # Negative control: the bf16 trainer of the same weights is another model than the FP8 sampler.
        reference = next((r for r in rows if r["case"].startswith("online")), None)
        if reference is not None:
            tree = reference["case"] == "online-tree"
            plain = load_policy(full, device=args.device, dtype=getattr(torch, args.dtype), tp_invariant=tree)
            same, worst, _ = compare(plain, prompts, reference["samples"], args.micro_batch_size)
            report["negative_control"] = {"bitwise_equal": same, "max_abs_diff": worst}
            if same == len(prompts) or worst == 0:
                fail("negative control: the bf16 trainer matched the FP8 sampler: the check proves nothing")
    for r in rows:
        r.pop("samples")
    report["cases"] = rows
    print(f"{'case':<12} {'equal':>7} {'max diff':>9} {'grads':>6} {'tokens':>7} {'sample s':>9} {'step s':>8}")
    for r in rows:
        equal = f"{r['bitwise_equal']}/{r['sequences']}"
        print(f"{r['case']:<12} {equal:>7} {r['max_abs_diff']:>9.3g} {str(r['grads_ok']):>6} {r['tokens']:>7} "
              f"{r['sample_s']:>9.3f} {r['step_s']:>8.4f}")  # fmt: skip
    if "negative_control" in report:
        nc = report["negative_control"]
        print(f"negative control (bf16 trainer vs FP8 sampler): {nc['bitwise_equal']} equal, max diff "
              f"{nc['max_abs_diff']:.3g} (expected > 0)")  # fmt: skip
    report["failures"] = FAILURES
    (out / "fp8_moe_rl.json").write_text(json.dumps(report, indent=1))
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
