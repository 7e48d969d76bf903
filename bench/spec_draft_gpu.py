"""What drafting with a draft model costs: a Qwen3-0.6B-shaped draft for a Qwen3-8B-shaped target (issue 31).

    python bench/spec_draft_gpu.py                 # CUDA: batches 1,16, k = 1,3,7, and the target's decode step
    python bench/spec_draft_gpu.py --smoke         # tiny shapes on the CPU, seconds

Random bf16 weights (``load_format="dummy"``: config.json only). ``DraftModelDrafter`` runs the draft on the
invariant kernels with its CUDA graphs. For each batch and k, the batch's sequences (``--input-len`` random tokens)
are prefilled by a first ``propose`` call (timed apart), then ``--calls`` calls are timed after ``--warm-calls``,
each made as the engine would after a verify step: "accept" = every draft accepted plus the target's bonus token
(two new tokens a sequence), "reject" = the first draft rejected (one new token). Reported: ms per call, per
proposed token and per draft forward (a call is k forwards), how many of the forwards replayed a CUDA graph, the
first call's ms, and whether each case's last proposals equal plain greedy decoding of the draft checkpoint
(``LLM.generate``, the same bits).

``--e2e`` adds ``LLM.generate`` with the draft (k = 3) against plain decoding at each batch: output tok/s,
acceptance (near 0 with random weights: this prices drafting that fails), and the same ids and logprob bits.

``--target-step`` (default on CUDA) also times the target's plain decode step at each batch (graphs and async
scheduling, 128-token prompts, as bench/decode_step.py) and prints the tokens per second one sequence would get
at a per-token acceptance rate a: E = (1 - a^(k+1)) / (1 - a) tokens a step over (draft call + verify step), the
verify step taken as one plain decode step. A verify step of k + 1 tokens costs at least that, so these are upper
bounds; spec-core's bench measures the verify step itself. JSON to ``--out``.
"""

import argparse
import dataclasses
import gc
import json
import os
import random
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # set before lockstep is imported

sys.path.insert(0, str(Path(__file__).parent))
from engine import QWEN3_8B, QWEN3_TINY, build_checkpoint  # noqa: E402

from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.config import EngineConfig  # noqa: E402
from lockstep.outputs import OutputKind  # noqa: E402
from lockstep.spec.config import SpeculativeConfig  # noqa: E402
from lockstep.spec.draft_model import DraftModelDrafter  # noqa: E402
from lockstep.spec.drafter import DraftRequest  # noqa: E402

# Qwen/Qwen3-0.6B's config.json: 28 layers, hidden 1024, 16 q / 8 kv heads of 128, tied embeddings, Qwen3's vocab.
QWEN3_0_6B = dict(
    QWEN3_8B, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, tie_word_embeddings=True,
)  # fmt: skip
QWEN3_TINY_DRAFT = dict(QWEN3_TINY, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
ACCEPTANCE = (0.5, 0.7, 0.9, 1.0)  # per-token acceptance rates of the projection


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_graph_steps(drafter: DraftModelDrafter) -> dict:
    """Count the draft's forwards and how many replayed a CUDA graph (wraps the runner)."""
    counts = {"steps": 0, "graph": 0}
    execute = drafter.runner.execute
    graphs = drafter.runner.graphs

    def counting(step, fed=None):
        counts["steps"] += 1
        if graphs is not None and step.use_graphs and graphs.can_run(step.flat):
            counts["graph"] += 1
        return execute(step, fed)

    drafter.runner.execute = counting
    return counts


def time_drafter(drafter: DraftModelDrafter, batch: int, k: int, mode: str, args, rng: random.Random) -> dict:
    """Steady-state ``propose`` calls at ``batch`` sequences and ``k`` drafts each (see the module docstring)."""
    vocab = drafter.runner.vocab_size
    base = 1_000_000 * k + 1000 * batch + (0 if mode == "accept" else 500)  # seq ids of this case only
    tokens = {base + i: [rng.randrange(vocab) for _ in range(args.input_len)] for i in range(batch)}
    device = drafter.runner.device

    def call() -> list[list[int]]:
        return drafter.propose([DraftRequest(i, t, k) for i, t in tokens.items()])

    def advance(proposals: list[list[int]]) -> None:
        for t, p in zip(tokens.values(), proposals, strict=True):
            if mode == "accept":
                t += p + [rng.randrange(vocab)]
            else:
                t.append((p[0] + 1) % vocab if p else rng.randrange(vocab))

    sync(device)
    t0 = time.perf_counter()
    first = call()  # the prompt's prefill, then k - 1 decode steps
    sync(device)
    first_ms = (time.perf_counter() - t0) * 1e3
    advance(first)
    for _ in range(args.warm_calls):
        advance(call())
    counts = count_graph_steps(drafter)
    sync(device)
    elapsed, proposed = 0.0, 0
    for _ in range(args.calls):
        before = [list(t) for t in tokens.values()]
        t0 = time.perf_counter()
        proposals = call()
        sync(device)
        elapsed += time.perf_counter() - t0
        proposed += sum(len(p) for p in proposals)
        advance(proposals)
    del drafter.runner.execute  # the class's again
    for i in tokens:
        drafter.release(i)
    call_ms = elapsed / args.calls * 1e3
    full = proposed == args.calls * batch * k
    return {
        "batch": batch, "k": k, "mode": mode, "first_call_ms": first_ms, "call_ms": call_ms,
        "per_token_ms": call_ms / k,
        "per_forward_ms": call_ms * args.calls / max(1, counts["steps"]), "forwards": counts["steps"],
        "graph_forwards": counts["graph"], "all_proposed": full,
        "last_call": list(zip(before, proposals, strict=True)),  # checked against LLM.generate on the draft
    }  # fmt: skip


def target_step_ms(llm: LLM, batch: int, args, rng: random.Random) -> float:
    """Mean ms of one plain decode step of the whole engine at ``batch`` (bench/decode_step.py's method)."""
    engine = llm.engine
    steps = args.target_warm + args.target_steps
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    vocab = engine.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(args.input_len)]
        engine.add_request(f"t{batch}-{i}", prompt, params, output_kind=OutputKind.FINAL_ONLY)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(args.target_warm):
        engine.step()
    device = engine.runner.device
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.target_steps):
        engine.step()
    sync(device)
    ms = (time.perf_counter() - t0) / args.target_steps * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return ms


def end_to_end(target_dir: Path, draft_dir: Path, engine_args: dict, batches: list[int], args) -> list[dict]:
    """``LLM.generate`` with the draft model (k = 3) against plain decoding: output tok/s, acceptance, and whether
    the token ids and logprob bits are the same. Random weights: the draft and the target disagree, so this prices
    drafting when (almost) nothing is accepted."""
    import struct

    def bits(outs) -> list:
        return [(o.outputs[0].token_ids, [struct.pack("<d", x) for x in o.outputs[0].token_logprobs]) for o in outs]

    params = SamplingParams(temperature=0.0, max_tokens=args.e2e_tokens, ignore_eos=True, logprobs=0)
    rows: dict[int, dict] = {b: {"batch": b} for b in batches}
    results = {}
    spec = {"model": str(draft_dir), "num_speculative_tokens": 3}
    for name, extra in (("plain", {}), ("draft", {"speculative_config": spec})):
        llm = LLM(str(target_dir), gpu_memory_utilization=0.6, **engine_args, **extra)
        vocab = llm.engine.vocab_size
        for b in batches:
            rng = random.Random(b)
            prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(b)]
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm
            before = dataclasses.replace(llm.engine.spec_stats)
            sync(llm.engine.runner.device)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            sync(llm.engine.runner.device)
            wall = time.perf_counter() - t0
            results[name, b] = bits(outs)
            rows[b][f"{name}_tok_s"] = b * args.e2e_tokens / wall
            if name == "draft":
                stats = llm.engine.spec_stats
                drafted = stats.num_draft_tokens - before.num_draft_tokens
                accepted = stats.num_accepted_tokens - before.num_accepted_tokens
                rows[b]["acceptance"] = accepted / drafted if drafted else None
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"\nEnd to end, greedy, {args.input_len}-token prompts, {args.e2e_tokens} tokens each, k = 3:\n")
    print("| batch | plain tok/s | with the draft tok/s | acceptance | same ids and logprob bits |")
    print("|---|---|---|---|---|")
    for b, r in rows.items():
        r["same_bits"] = results["plain", b] == results["draft", b]
        acc = "-" if r.get("acceptance") is None else f"{r['acceptance']:.3f}"
        print(f"| {b} | {r['plain_tok_s']:.1f} | {r['draft_tok_s']:.1f} | {acc} | {r['same_bits']} |")
    return list(rows.values())


def expected_tokens(a: float, k: int) -> float:
    """Tokens a step adds at per-token acceptance rate ``a`` with ``k`` drafts: 1 + a + ... + a^k."""
    return sum(a**i for i in range(k + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--batches", default=None, help="default 1,16 (smoke 1,3)")
    ap.add_argument("--ks", default="1,3,7")
    ap.add_argument("--modes", default="accept,reject")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--calls", type=int, default=None, help="timed calls per case (default 30; smoke 3)")
    ap.add_argument("--warm-calls", type=int, default=None, help="default 5; smoke 1")
    ap.add_argument("--target-step", choices=["on", "off", "auto"], default="auto", help="auto: on on CUDA")
    ap.add_argument("--target-steps", type=int, default=32)
    ap.add_argument("--target-warm", type=int, default=4)
    ap.add_argument("--e2e", action="store_true", help="also LLM.generate with the draft against plain decoding")
    ap.add_argument("--e2e-tokens", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    batches = [int(b) for b in (args.batches or ("1,3" if args.smoke else "1,16")).split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    args.calls = args.calls or (3 if args.smoke else 30)
    args.warm_calls = args.warm_calls if args.warm_calls is not None else (1 if args.smoke else 5)
    if args.smoke:
        args.target_steps, args.target_warm, args.input_len = 4, 1, min(args.input_len, 24)
    target_on = args.target_step == "on" or (args.target_step == "auto" and device.type == "cuda")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    target_shape, draft_shape = (QWEN3_TINY, QWEN3_TINY_DRAFT) if args.smoke else (QWEN3_8B, QWEN3_0_6B)
    work = Path(tempfile.mkdtemp(prefix="lockstep-spec-draft-"))
    target_dir, draft_dir = work / "target", work / "draft"
    target_info = build_checkpoint(target_dir, target_shape, None, device, weights=False)
    draft_info = build_checkpoint(draft_dir, draft_shape, None, device, weights=False)
    max_len = args.input_len + 64 * (max(ks) + 2) + 64
    engine_args = dict(
        device=str(device), dtype=dtype, load_format="dummy", max_num_seqs=max(batches), max_model_len=max_len,
        enable_prefix_caching=False,
    )  # fmt: skip

    t0 = time.perf_counter()
    spec = SpeculativeConfig(num_speculative_tokens=max(ks), model=str(draft_dir))
    drafter = DraftModelDrafter(spec, EngineConfig(model=str(target_dir), **engine_args))
    startup = time.perf_counter() - t0
    rows = []
    rng = random.Random(0)
    for batch in batches:
        for k in ks:
            for mode in args.modes.split(","):
                rows.append(time_drafter(drafter, batch, k, mode, args, rng))
                r = rows[-1]
                print(f"batch {batch:3d} k {k} {mode:6s}: {r['call_ms']:8.3f} ms a call, {r['per_token_ms']:7.3f} "
                      f"ms a token, {r['graph_forwards']}/{r['forwards']} forwards graphed", flush=True)  # fmt: skip
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "args": vars(args),
        "draft": draft_info, "target": target_info, "draft_startup_s": startup,
        "draft_kv_blocks": drafter.num_kv_blocks, "drafts": rows, "target_step_ms": {},
    }  # fmt: skip
    del drafter
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # The proposals of each case's last call against plain greedy decoding of the draft checkpoint (the same
    # random weights: load_format="dummy" draws them from a fixed seed).
    draft_llm = LLM(str(draft_dir), **engine_args)
    params = {k: SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in ks}
    same = total = 0
    for r in rows:
        pairs = r.pop("last_call")
        outs = draft_llm.generate([t for t, _ in pairs], params[r["k"]], use_tqdm=False)
        r["same_as_generate"] = sum(list(o.outputs[0].token_ids) == p for o, (_, p) in zip(outs, pairs, strict=True))
        same, total = same + r["same_as_generate"], total + len(pairs)
    report["same_as_generate"] = [same, total]
    del draft_llm
    gc.collect()

    if target_on:
        llm = LLM(str(target_dir), gpu_memory_utilization=0.6, **engine_args)
        for batch in batches:
            report["target_step_ms"][batch] = target_step_ms(llm, batch, args, random.Random(batch))
        del llm
        gc.collect()

    print(f"\nDraft {'tiny' if args.smoke else 'Qwen3-0.6B'} shape for {'tiny' if args.smoke else 'Qwen3-8B'} shape, "
          f"{device}, {dtype}, {args.input_len}-token prompts; draft start-up {startup:.1f} s (on CUDA: graph "
          f"capture and warm-up)\n")  # fmt: skip
    print(
        "| batch | k | new tokens | call ms | ms per drafted token | ms per draft forward | graphed | first call ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        new = "2 (accept)" if r["mode"] == "accept" else "1 (reject)"
        print(f"| {r['batch']} | {r['k']} | {new} | {r['call_ms']:.3f} | {r['per_token_ms']:.3f} | "
              f"{r['per_forward_ms']:.3f} | {r['graph_forwards']}/{r['forwards']} | "
              f"{r['first_call_ms']:.2f} |")  # fmt: skip
    print(f"\nProposals equal to LLM.generate's greedy continuation on the draft checkpoint: {same} of {total}")
    if report["target_step_ms"]:
        print("\nTarget plain decode step (on CUDA: graphs, async scheduling): "
              + ", ".join(f"batch {b} {ms:.3f} ms" for b, ms in report["target_step_ms"].items()))  # fmt: skip
        print("\nUpper bound on one sequence's tok/s, verify step = one plain decode step (accept-mode call cost):\n")
        print("| batch | k | " + " | ".join(f"a = {a}" for a in ACCEPTANCE) + " | plain decoding |")
        print("|---|---|" + "---|" * (len(ACCEPTANCE) + 1))
        for batch in batches:
            step = report["target_step_ms"][batch]
            for k in ks:
                call = next(r["call_ms"] for r in rows if r["batch"] == batch and r["k"] == k)
                cells = [f"{expected_tokens(a, k) / (call + step) * 1e3:.0f}" for a in ACCEPTANCE]
                print(f"| {batch} | {k} | " + " | ".join(cells) + f" | {1e3 / step:.0f} |")
    if args.e2e:
        report["e2e"] = end_to_end(target_dir, draft_dir, engine_args, batches, args)
    out = Path(args.out) / "spec_draft_gpu.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
