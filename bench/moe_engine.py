"""A mixture of experts through the whole engine: batch-1 decode step, a short invariance matrix and throughput,
with the invariant and the default kernels. The Qwen3-30B-A3B shape by default, or Mixtral-8x7B's.

    python bench/moe_engine.py --layers 8                   # H200, depth cut to 8 of 48 layers (10 GB)
    python bench/moe_engine.py --layers 48                  # full depth, 61 GB of random weights on the GPU
    python bench/moe_engine.py --model mixtral-8x7b --layers 32 --num-requests 64    # 93 GB
    python bench/moe_engine.py --layers 48 --tensor-parallel-size 2    # nvidia-h200-x2; compare the digest with
    python bench/moe_engine.py --layers 48 --tp-invariant              # TP 1's with the same numerics
    python bench/moe_engine.py --smoke                      # tiny shapes on the CPU, < 1 min

Qwen3-30B-A3B: hidden 2048, 48 layers, 128 experts, top 8 renormalised, expert width 768, 32 q / 4 kv heads of
128, vocab 151936. Mixtral-8x7B: hidden 4096, 32 layers, 8 experts, top 2, expert width 14336, 32 q / 8 kv heads
of 128, vocab 32000. Weights are random bf16, drawn by the engine (``--load-format dummy``, the default) or written
layer by layer as safetensors shards in the released per-expert layout (``--load-format auto``: as much disk in
``--workdir`` as the model has bytes), with a word-level tokenizer; prompts are token ids.

For each kernel set (``--modes``, default ``invariant,default``):
1. decode step: ``--decode-batches`` requests (default 1) of ``--decode-input`` random tokens prefilled, then the
   mean wall time of ``--steps`` whole engine steps, CUDA graphs replayed and again eagerly; the graph and eager
   steps must give the same tokens and logprob bits;
2. invariance matrix: bench/engine.py's targets alone, then again in a batch, alone once more, under chunked
   prefill, and under preemption by a tight KV cache, each compared bit for bit with the alone run (the invariant
   set must show no difference; the default set is the negative control);
3. throughput: ``--num-requests`` x ``--input-len`` / ``--output-len`` (default 64 x 512/512), greedy, ignore_eos.
JSON to ``--out`` (default $OUT or .), a table last. Exits 1 when the invariant set differs anywhere.
"""

import argparse
import gc
import hashlib
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the 2-core CPU machines

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # set before lockstep is imported

sys.path.insert(0, str(Path(__file__).parent))
from engine import (  # noqa: E402
    BLOCK,
    Plan,
    add_load_format_arg,
    bits,
    cell,
    fresh_scheduler,
    kv_blocks,
    matrix_cases,
    run_case,
    run_throughput,
    save_tokenizer,
    target_requests,
)

from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.layers.moe import MIXTRAL_NAMES, QWEN3_MOE_NAMES  # noqa: E402
from lockstep.outputs import OutputKind  # noqa: E402

# config.json values of Qwen/Qwen3-30B-A3B.
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=151643, eos_token_id=151645,
)  # fmt: skip
QWEN3_MOE_TINY = dict(
    QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
    max_position_embeddings=1024, bos_token_id=0, eos_token_id=511,
)  # fmt: skip
# config.json values of mistralai/Mixtral-8x7B-v0.1.
MIXTRAL_8X7B = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2,
)  # fmt: skip
MIXTRAL_TINY = dict(
    MIXTRAL_8X7B, vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=4, max_position_embeddings=1024, bos_token_id=0,
    eos_token_id=511,
)  # fmt: skip
# name -> (full shape, tiny shape, transformers config class name, architecture)
MODELS = {
    "qwen3-30b-a3b": (QWEN3_30B_A3B, QWEN3_MOE_TINY, "Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral-8x7b": (MIXTRAL_8X7B, MIXTRAL_TINY, "MixtralConfig", "MixtralForCausalLM"),
}
# The matrix: every target alone (the references), then these of bench/engine.py's cases; with --long also its
# two long-prompt cases (a long prompt inside a batch, two long prompts chunked).
CASES = ("rerun_alone", "batch_", "chunked_", "preemption")
LONG_CASES = ("long_in_batch_", "long_pair_chunked_")


# -- the checkpoint ----------------------------------------------------------------------------------------------


def layer_tensors(shape: dict, i: int, gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """Layer ``i``'s tensors by checkpoint name, random bf16 on the CPU: norms near 1, matrices scaled by fan-in
    (logits of order 1, router probabilities spread over the experts). Mixtral's names when ``shape`` is its."""
    mixtral = "num_local_experts" in shape
    width = shape["intermediate_size"] if mixtral else shape["moe_intermediate_size"]
    h, hd = shape["hidden_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    p = f"model.layers.{i}"

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(dims, generator=gen, device=device) / dims[-1] ** 0.5).to(torch.bfloat16).cpu()

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=gen, device=device)).to(torch.bfloat16).cpu()

    out = {
        f"{p}.input_layernorm.weight": norm(h),
        f"{p}.post_attention_layernorm.weight": norm(h),
        f"{p}.self_attn.q_proj.weight": rand(q, h),
        f"{p}.self_attn.k_proj.weight": rand(kv, h),
        f"{p}.self_attn.v_proj.weight": rand(kv, h),
        f"{p}.self_attn.o_proj.weight": rand(h, q),
    }
    if not mixtral:  # Qwen3's q/k norms; the MoE block's names are each family's (layers/moe.py)
        out[f"{p}.self_attn.q_norm.weight"] = norm(hd)
        out[f"{p}.self_attn.k_norm.weight"] = norm(hd)
    names = MIXTRAL_NAMES if mixtral else QWEN3_MOE_NAMES
    block, experts = f"{p}.{names.block}", shape["num_local_experts" if mixtral else "num_experts"]
    out[f"{block}.gate.weight"] = rand(experts, h)
    for e in range(experts):
        out[f"{block}.experts.{e}.{names.gate}.weight"] = rand(width, h)
        out[f"{block}.experts.{e}.{names.up}.weight"] = rand(width, h)
        out[f"{block}.experts.{e}.{names.down}.weight"] = rand(h, width)
    return out


def build_checkpoint(
    folder: Path,
    shape: dict,
    layers: int,
    device: torch.device,
    seed: int = 0,
    weights: bool = True,
    model: str = "qwen3-30b-a3b",
) -> dict:
    """Write a random-weight checkpoint of ``model``'s family at ``shape`` cut to ``layers`` layers: config.json, one
    safetensors shard per layer (plus one for the embeddings and head) with an index, and a tokenizer. Only one
    layer is ever in memory. Without ``weights``, config.json and the tokenizer only (``load_format="dummy"``)."""
    import transformers
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {**shape, "num_hidden_layers": layers}
    _, _, config_class, arch = MODELS[model]
    config = getattr(transformers, config_class)(**kwargs)
    config.architectures = [arch]
    config.dtype = torch.bfloat16
    config.save_pretrained(folder)
    if not weights:
        save_tokenizer(folder, shape["vocab_size"], shape["eos_token_id"])
        with torch.device("meta"):
            params = sum(p.numel() for p in getattr(transformers, arch)(config).parameters())
        return {"params": params, "bytes": 2 * params, "num_hidden_layers": layers, "load_format": "dummy"}
    gen = torch.Generator(device=device).manual_seed(seed)
    h, vocab = shape["hidden_size"], shape["vocab_size"]
    shards = [
        lambda: {
            "model.embed_tokens.weight": torch.randn(vocab, h, generator=gen, device=device).bfloat16().cpu(),
            "model.norm.weight": (1.0 + 0.1 * torch.randn(h, generator=gen, device=device)).bfloat16().cpu(),
            "lm_head.weight": (torch.randn(vocab, h, generator=gen, device=device) / h**0.5).bfloat16().cpu(),
        }
    ] + [lambda i=i: layer_tensors(shape, i, gen, device) for i in range(layers)]
    weight_map, total, params = {}, 0, 0
    for n, make in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = make()
        save_file(tensors, folder / name, metadata={"format": "pt"})
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
            params += t.numel()
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    save_tokenizer(folder, vocab, shape["eos_token_id"])
    return {"params": params, "bytes": total, "num_hidden_layers": layers, "load_format": "auto"}


# -- the three measurements --------------------------------------------------------------------------------------


def sync(llm: LLM) -> None:
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def decode_step(llm: LLM, batch: int, input_len: int, steps: int, graphs: bool, vocab: int) -> tuple[float, list]:
    """Mean seconds of a whole engine decode step at ``batch`` (graphs replayed or eager), and the outputs."""
    fresh_scheduler(llm)
    engine = llm.engine
    engine.runner.use_graphs = graphs and engine.runner.graphs is not None
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True, logprobs=0)
    for i in range(batch):
        engine.add_request(
            f"d{batch}-{graphs}-{i}",
            [rng.randrange(vocab) for _ in range(input_len)],
            params,
            output_kind=OutputKind.FINAL_ONLY,  # whole outputs, compared bit for bit
        )
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    engine.step()  # warm
    sync(llm)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(llm)
    per_step = (time.perf_counter() - t0) / steps
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    outs.sort(key=lambda o: int(o.request_id.rsplit("-", 1)[1]))
    return per_step, [bits(o) for o in outs]


def short_matrix(llm: LLM, plan: Plan, vocab: int, deadline: float, long: bool = False) -> dict:
    """The targets alone (references), then ``CASES`` of bench/engine.py's matrix (and ``LONG_CASES`` with
    ``long``), compared bit for bit."""
    tp = target_requests(plan, vocab, plan.long_len)
    n_short = len(plan.target_lens)
    cases = CASES + (LONG_CASES if long else ())
    refs = []
    for prompt, params in zip(*(t if long else t[:n_short] for t in tp), strict=True):
        fresh_scheduler(llm, max_num_batched_tokens=plan.large_budget)
        [out] = llm.generate([prompt], params, use_tqdm=False)
        refs.append(bits(out))
    rows = []
    for k, (name, overrides, targets, others) in enumerate(matrix_cases(plan, n_short, len(tp[0]) - n_short)):
        if not name.startswith(cases) or (not long and min(targets) >= n_short):
            continue
        if time.perf_counter() > deadline:
            rows.append({"case": name, "skipped": "time budget"})
            continue
        t0 = time.perf_counter()
        row = run_case(llm, name, overrides, targets, others, 100 + k, tp, refs, plan, vocab)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(f"    {name:24s} {cell(row):>14s}  {row['seconds']:6.2f} s", flush=True)
    distinct = len({tuple(r[0]) for r in refs})
    # The references' bits in one line: equal digests from two runs (TP 1 with --tp-invariant and TP 2, say) mean
    # the targets got the same token ids and logprob bits in both.
    digest = hashlib.sha256(repr(refs).encode()).hexdigest()[:16]
    print(f"    references digest {digest}", flush=True)
    return {"cases": rows, "distinct_target_outputs": distinct, "references_digest": digest}


# -- main --------------------------------------------------------------------------------------------------------


def make_plan(args: argparse.Namespace) -> Plan:
    if args.smoke:
        return Plan(
            target_lens=(13, 29, 41), target_out=12, other_prompt_max=40, other_out_max=24, batch_sizes=(8,),
            chunk_small=16, chunk_mid=64, long_len=48, long_out=2, long_chunk=32,
            tp_requests=args.num_requests or 6, tp_in=args.input_len or 24, tp_out=args.output_len or 8,
            tp_batched_tokens=256,
        )  # fmt: skip
    return Plan(
        target_lens=(37, 150, 301, 90), target_out=16, other_prompt_max=384, other_out_max=24,
        batch_sizes=(args.max_batch,), chunk_small=64, chunk_mid=512, long_len=args.long or 512, long_out=2,
        long_chunk=2048 if args.long else 256,
        tp_requests=args.num_requests or 64, tp_in=args.input_len or 512, tp_out=args.output_len or 512,
        tp_batched_tokens=8192,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b", help="the random model's shape")
    ap.add_argument("--layers", type=int, default=8, help="depth (full: 48 for Qwen3, 32 for Mixtral; default 8)")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs to shard the model over")
    ap.add_argument(
        "--tp-invariant", action="store_true", help="the chunk tree at TP 1 too: the bits every TP size gives"
    )
    ap.add_argument("--modes", default="invariant,default", help="kernel sets, comma separated")
    ap.add_argument("--decode-batches", default="1", help="decode-step batch sizes, comma separated")
    ap.add_argument("--decode-input", type=int, default=128, help="prompt tokens before the decode steps")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps")
    ap.add_argument("--max-batch", type=int, default=64, help="batch of the matrix's batched case")
    ap.add_argument("--long", type=int, default=None, help="add the long-prompt cases at this length (try 32768)")
    ap.add_argument("--num-requests", type=int, default=None, help="throughput requests (default 64)")
    ap.add_argument("--input-len", type=int, default=None, help="throughput prompt tokens (default 512)")
    ap.add_argument("--output-len", type=int, default=None, help="throughput output tokens (default 512)")
    ap.add_argument("--no-matrix", action="store_true")
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--budget", type=float, default=None, help="seconds per mode for matrix + throughput")
    ap.add_argument("--device", default=None, help="default: cuda if available (else cpu)")
    ap.add_argument("--workdir", default=None, help="where to write the checkpoint (default: a temp dir, removed)")
    add_load_format_arg(ap)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="JSON folder or .json path")
    args = ap.parse_args(argv)

    started = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    full, tiny, _, _ = MODELS[args.model]
    shape = tiny if args.smoke else full
    layers = shape["num_hidden_layers"] if args.smoke else args.layers
    if not 1 <= layers <= shape["num_hidden_layers"]:
        ap.error(f"--layers must be in [1, {shape['num_hidden_layers']}], got {layers}")
    budget = args.budget if args.budget is not None else (60.0 if args.smoke else 240.0)
    plan = make_plan(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    out_path = Path(args.out)
    out_path = out_path if out_path.suffix == ".json" else out_path / "moe_engine.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]) if argv is None else " ".join(argv),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "plan": vars(plan),
        "tensor_parallel_size": args.tensor_parallel_size,
        "modes": {},
    }
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="lockstep-moe-"))
    folder = workdir / f"{args.model}-shape"
    try:
        t0 = time.perf_counter()
        report["model"] = build_checkpoint(
            folder, shape, layers, device, weights=args.load_format != "dummy", model=args.model
        )
        report["model"]["name"] = args.model
        report["model"]["build_s"] = round(time.perf_counter() - t0, 1)
        print(f"built {folder}: {layers} layers, {report['model']['bytes'] / 1e9:.1f} GB, "
              f"{report['model']['build_s']} s", flush=True)  # fmt: skip
        cfg = {**shape, "num_hidden_layers": layers}
        longest = plan.long_len + plan.long_out if args.long else 0
        max_model_len = max(plan.tp_in + plan.tp_out, max(plan.target_lens) + 2 * plan.target_out, 512, longest) + BLOCK
        max_model_len = min(max_model_len, shape["max_position_embeddings"])
        # What one rank holds: its share of the weights and of the KV heads (at least one: replicated past their count).
        tp = args.tensor_parallel_size
        rank_cfg = {**cfg, "num_key_value_heads": max(1, cfg["num_key_value_heads"] // tp)}
        blocks = kv_blocks(report["model"]["bytes"] // tp, rank_cfg, plan, plan.long_len, max_model_len, device)
        for mode in modes:
            report["modes"][mode] = run_mode(mode, folder, args, plan, shape, device, blocks, max_model_len, budget)
            out_path.write_text(json.dumps(report, indent=1, default=str))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    report["failures"] = failures(report)
    out_path.write_text(json.dumps(report, indent=1, default=str))
    print_table(report)
    return report


def run_mode(mode, folder, args, plan, shape, device, blocks, max_model_len, budget) -> dict:
    vocab = shape["vocab_size"]
    t0 = time.perf_counter()
    llm = LLM(
        model=str(folder), kernels=mode, device=str(device), dtype="bfloat16", block_size=BLOCK,
        num_kv_blocks=blocks, max_model_len=max_model_len, max_num_batched_tokens=max(plan.large_budget, 8192),
        seed=0, load_format=args.load_format, tensor_parallel_size=args.tensor_parallel_size,
        tp_invariant=True if args.tp_invariant else None,
    )  # fmt: skip
    res: dict = {"load_s": round(time.perf_counter() - t0, 1), "kv_blocks": blocks, "decode": []}
    print(f"[{mode}] loaded in {res['load_s']} s, {blocks} KV blocks", flush=True)
    for batch in [int(b) for b in args.decode_batches.split(",") if b.strip()]:
        row = {"batch": batch}
        outs = {}
        for graphs in (True, False):
            per_step, outs[graphs] = decode_step(llm, batch, args.decode_input, args.steps, graphs, vocab)
            row["graphs_ms" if graphs else "eager_ms"] = per_step * 1e3
        row["graphs_captured"] = llm.engine.runner.graphs is not None
        row["graphs_equal_eager"] = outs[True] == outs[False]
        res["decode"].append(row)
        print(f"    decode batch {batch}: {row['graphs_ms']:.2f} ms graphs, {row['eager_ms']:.2f} ms eager, "
              f"same bits: {row['graphs_equal_eager']}", flush=True)  # fmt: skip
    deadline = time.perf_counter() + budget
    if not args.no_matrix:
        matrix_deadline = deadline if args.no_throughput else time.perf_counter() + budget / 2
        res["matrix"] = short_matrix(llm, plan, vocab, matrix_deadline, long=bool(args.long))
    if not args.no_throughput:
        tp = run_throughput(llm, plan, vocab, {"temperature": 0.0}, deadline)
        res["throughput"] = tp
        partial = " (partial)" if tp["partial"] else ""
        print(f"    throughput {plan.tp_requests} x {plan.tp_in}/{plan.tp_out}: {tp['full']['seconds']} s, "
              f"{tp.get('output_tok_s', 0):.0f} output tok/s{partial}", flush=True)  # fmt: skip
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def failures(report: dict) -> list[str]:
    """What breaks the contract for the invariant set (the default set is reported, not judged)."""
    res = report["modes"].get("invariant")
    if res is None:
        return []
    out = [f"decode batch {r['batch']}: graphs and eager differ" for r in res["decode"] if not r["graphs_equal_eager"]]
    for row in res.get("matrix", {}).get("cases", []):
        if "skipped" not in row and row["seqs_differing"]:
            out.append(f"matrix case {row['case']}: {cell(row)}")
    return out


def print_table(report: dict) -> None:
    modes = list(report["modes"])
    tp = report["tensor_parallel_size"]
    print(
        f"\n{report['model']['name']} shape, {report['model']['num_hidden_layers']} layers, TP {tp}, on "
        f"{report['gpu'] or report['device']}"
    )
    print("| | " + " | ".join(modes) + " |\n|---|" + "---|" * len(modes))
    decode_batches = [r["batch"] for r in report["modes"][modes[0]]["decode"]] if modes else []
    for i, b in enumerate(decode_batches):
        cells = [f"{report['modes'][m]['decode'][i]['graphs_ms']:.2f}" for m in modes]
        print(f"| decode step, batch {b} (ms, graphs) | " + " | ".join(cells) + " |")
    names = [r["case"] for r in report["modes"][modes[0]].get("matrix", {}).get("cases", [])] if modes else []
    for j, name in enumerate(names):
        print(f"| {name} | " + " | ".join(cell(report["modes"][m]["matrix"]["cases"][j]) for m in modes) + " |")
    if modes and "throughput" in report["modes"][modes[0]]:
        cells = [f"{report['modes'][m]['throughput'].get('output_tok_s', 0):.0f}" for m in modes]
        print("| throughput (output tok/s) | " + " | ".join(cells) + " |")
    if modes and "matrix" in report["modes"][modes[0]]:
        cells = [report["modes"][m]["matrix"]["references_digest"] for m in modes]
        print("| references digest | " + " | ".join(cells) + " |")
    print("FAILED: " + "; ".join(report["failures"]) if report["failures"] else "invariant set: no difference")


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
