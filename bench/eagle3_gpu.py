"""What EAGLE-3 drafting costs: the draft step and the verify step at batch 1, 8B-shaped target (issue 31).

    python bench/eagle3_gpu.py                          # CUDA: Qwen3-8B shape, k = 1, 3, 7
    python bench/eagle3_gpu.py --shape llama            # Llama-3.1-8B shape (the published EAGLE-3 heads' target)
    python bench/eagle3_gpu.py --tiny --steps 4         # tiny shapes on the CPU, a smoke test

Random bf16 weights: the target from config.json only (``load_format="dummy"``), the head written as a checkpoint
of the real shape (hidden 4096, 32 / 8 heads, the target's intermediate size, a 32,000-token draft vocabulary with
``d2t`` / ``t2d``, no ``embed_tokens``: the target's embedding is shared). One engine with
``speculative_config={"method": "eagle3", ...}``; for each k the head drafts k tokens a step and the target
verifies them (with random weights nothing is accepted, so every step is a (k + 1)-token verify chunk). Each engine
step is split, each part synced: the head's ``propose`` call (the draft step: one forward over the new target
rows and k - 1 one-row forwards), ``observe`` (``fc`` over the step's aux hidden states) and the rest (the verify
forward, sampling, acceptance: "verify"). The plain decode step is the same engine with the drafter off (CUDA
graphs; the target still keeps its three aux streams, three adds a step). Each k is timed twice: with the head's
own CUDA graphs for its draft loop (``spec/eagle3_graphs.py``) and with its eager loop, and the draft cost of both
is printed side by side. Also printed: tok/s one sequence would get if each draft were accepted with probability
a, E(a) = (1 - a^(k+1)) / (1 - a) tokens per measured step (from the steps with the head's graphs), and whether
one greedy request's proposals and output are the same with the target's CUDA graphs on and off (the graphs hand
the head their own aux buffers), whether four requests (greedy and seeded) get the same proposals, call for call,
and the same bits with the head's graphs and with its eager loop (asserted), and whether four requests give the
same bits under async scheduling (the head observing each step as it is launched), synchronously and without the
drafter. On the CPU (``--tiny``) nothing is captured: the graph functions run uncaptured, over the same buffers.
JSON to ``--out``.
"""

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

if "--tiny" in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # set before lockstep is imported

sys.path.insert(0, str(Path(__file__).parent))
from engine import QWEN3_8B, QWEN3_TINY, build_checkpoint, write_report  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.outputs import OutputKind  # noqa: E402

# meta-llama/Llama-3.1-8B-Instruct's config.json (what yuhuili/EAGLE3-LLaMA3.1-Instruct-8B drafts for).
LLAMA31_8B = dict(
    arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128009,
)  # fmt: skip
LLAMA_TINY = dict(LLAMA31_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  bos_token_id=0, eos_token_id=511)  # fmt: skip
DRAFT_VOCAB = 32000  # the published heads' draft_vocab_size
ALPHAS = (0.0, 0.5, 0.7, 0.8, 0.9, 1.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_head(folder: Path, shape: dict, layers: int, draft_vocab: int, device: torch.device) -> dict:
    """Write a random EAGLE-3 head of ``shape``'s size (bf16, the published tensor names) to ``folder``."""
    H, inter, V = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    gen = torch.Generator(device=device).manual_seed(0)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen, device=device) / cols**0.5).to(torch.bfloat16).cpu()

    def norm() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(H, generator=gen, device=device)).to(torch.bfloat16).cpu()

    targets = torch.tensor(sorted(random.Random(0).sample(range(V), draft_vocab)))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[targets] = True
    tensors = {
        "fc.weight": mat(H, 3 * H), "norm.weight": norm(), "lm_head.weight": mat(draft_vocab, H),
        "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": mat(heads * d, 2 * H),
        "midlayer.self_attn.k_proj.weight": mat(kv * d, 2 * H),
        "midlayer.self_attn.v_proj.weight": mat(kv * d, 2 * H),
        "midlayer.self_attn.o_proj.weight": mat(H, heads * d),
        "midlayer.mlp.gate_proj.weight": mat(inter, H), "midlayer.mlp.up_proj.weight": mat(inter, H),
        "midlayer.mlp.down_proj.weight": mat(H, inter),
        "d2t": targets - torch.arange(draft_vocab), "t2d": t2d,
    }  # fmt: skip
    aux = [min(2, layers - 1), layers // 2, max(layers - 3, 0)]  # vLLM's (2, L // 2, L - 3), kept in range
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
        "num_hidden_layers": 1, "rms_norm_eps": shape["rms_norm_eps"], "vocab_size": V,
        "draft_vocab_size": draft_vocab, "max_position_embeddings": shape["max_position_embeddings"],
        "rope_theta": shape["rope_parameters"]["rope_theta"], "torch_dtype": "bfloat16",
        "eagle_aux_hidden_state_layer_ids": aux,
    }  # fmt: skip
    if shape["rope_parameters"]["rope_type"] != "default":
        config["rope_scaling"] = dict(shape["rope_parameters"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors")
    return {"params": sum(t.numel() for n, t in tensors.items() if n not in ("d2t", "t2d")), "aux_layers": aux}


class Timed:
    """Wraps the engine's drafter: synced seconds in ``propose`` and ``observe``, summed while ``on``."""

    def __init__(self, engine) -> None:
        self.engine, self.drafter = engine, engine.drafter
        self.device = engine.runner.device
        self.on, self.propose_s, self.observe_s, self.calls = False, 0.0, 0.0, 0

    def _timed(self, fn, field: str):
        def call(*args):
            if not self.on:
                return fn(*args)
            sync(self.device)
            t0 = time.perf_counter()
            out = fn(*args)
            sync(self.device)
            setattr(self, field, getattr(self, field) + time.perf_counter() - t0)
            self.calls += field == "propose_s"
            return out

        return call

    def install(self) -> None:
        self.engine.drafter = self.drafter
        self.drafter.propose = self._timed(type(self.drafter).propose.__get__(self.drafter), "propose_s")
        self.engine._observe = self._timed(type(self.drafter).observe.__get__(self.drafter), "observe_s")

    def reset(self) -> None:
        self.propose_s = self.observe_s = 0.0
        self.calls = 0


def time_steps(llm: LLM, timed: Timed | None, args, tag: str) -> dict:
    """ms per engine step at batch 1 (``timed`` None: plain decoding), with the draft and observe shares."""
    engine = llm.engine
    if timed is None:
        engine.drafter, engine._observe = None, None
    else:
        timed.install()
        timed.reset()
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=8 * (args.warm_steps + args.steps) + 8, ignore_eos=True)
    prompt = [rng.randrange(10, args.vocab - 10) for _ in range(args.input_len)]
    engine.add_request(tag, prompt, params, output_kind=OutputKind.FINAL_ONLY)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(args.warm_steps):
        engine.step()
    before = sum(s.num_output_tokens for s in sched.running)
    drafts_before = engine.spec_stats.num_draft_tokens
    if timed is not None:
        timed.on = True
    device = engine.runner.device
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync(device)
    step_s = (time.perf_counter() - t0) / args.steps
    if timed is not None:
        timed.on = False
    added = (sum(s.num_output_tokens for s in sched.running) - before) / args.steps
    drafted = (engine.spec_stats.num_draft_tokens - drafts_before) / args.steps
    for s in list(sched.running):
        engine.abort(s.request_id)
    row = {"step_ms": step_s * 1e3, "tokens_per_step": added, "drafts_per_step": drafted}
    if timed is not None:
        row["draft_ms"] = timed.propose_s / args.steps * 1e3
        row["observe_ms"] = timed.observe_s / args.steps * 1e3
        row["verify_ms"] = row["step_ms"] - row["draft_ms"] - row["observe_ms"]
    return row


def graphs_equal_eager(llm: LLM, timed: Timed, args) -> bool:
    """The head's proposals and the output of one greedy request with the target's CUDA graphs on and off: the same
    (the graphs' aux buffers hold the eager forward's bits; trivially so on the CPU, which has no graphs)."""
    engine = llm.engine
    timed.install()
    drafter = timed.drafter
    propose = drafter.propose
    rng = random.Random(2)
    prompt = [rng.randrange(10, args.vocab - 10) for _ in range(args.input_len)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = []
    for graphs in (True, False):
        engine.runner.use_graphs = graphs and engine.runner.graphs is not None
        calls = []

        def recorded(requests, calls=calls):
            out = propose(requests)
            calls.extend(out)
            return out

        drafter.propose = recorded
        [out] = llm.generate([prompt], params, use_tqdm=False)
        runs.append((list(out.outputs[0].token_ids), calls))
    drafter.propose = propose
    engine.runner.use_graphs = engine.runner.graphs is not None
    return runs[0] == runs[1] and len(runs[0][1]) > 0


def async_equal_sync(llm: LLM, timed: Timed, args) -> dict:
    """Four requests (greedy and seeded) with the head proposing at every other step, so that steps without drafts
    run ahead and the next ones draft one token behind: the output under async scheduling, synchronous, and with
    no drafter at all, compared token for token and logprob bit for bit (on CUDA through the graphs' aux buffers,
    observed as each step is launched)."""
    engine = llm.engine
    timed.install()
    drafter, observe = timed.drafter, engine._observe
    propose = drafter.propose
    rng = random.Random(3)
    prompts = [[rng.randrange(10, args.vocab - 10) for _ in range(args.input_len + i)] for i in range(4)]
    params = [SamplingParams(temperature=t, seed=7, top_k=50, max_tokens=32, ignore_eos=True, logprobs=1)
              for t in (0.0, 0.8, 0.0, 0.8)]  # fmt: skip
    calls = [0]

    def every_other(requests):
        calls[0] += 1
        return propose(requests) if calls[0] % 2 else [[] for _ in requests]

    runs, fed = {}, 0
    launch = engine.runner.launch

    def counted(batch, feed=None):
        nonlocal fed
        fed += feed is not None
        return launch(batch, feed)

    engine.runner.launch = counted
    for name, overlap, spec in (("plain", False, False), ("sync", False, True), ("async", True, True)):
        engine.config.async_scheduling = overlap
        engine.drafter, engine._observe = (drafter, observe) if spec else (None, None)
        drafter.propose = every_other
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[name] = [(list(o.outputs[0].token_ids), [x.hex() for x in o.outputs[0].token_logprobs]) for o in outs]
    engine.runner.launch, drafter.propose = launch, propose
    engine.config.async_scheduling = False
    engine.drafter, engine._observe = drafter, observe
    return {"equal": runs["async"] == runs["sync"] == runs["plain"], "fed_steps": fed}


def draft_graphs_equal_eager(llm: LLM, timed: Timed, args) -> dict:
    """Four requests (greedy and seeded, logprobs) with the head's draft loop replayed from its graphs, then run
    eagerly, then without a drafter: the proposals of every call and the output bits must be the same (asserted),
    and the graph run must have gone through the graphs."""
    engine = llm.engine
    timed.install()
    drafter = timed.drafter
    propose, run = drafter.propose, drafter.graphs.run
    rng = random.Random(4)
    prompts = [[rng.randrange(10, args.vocab - 10) for _ in range(args.input_len + 3 * i)] for i in range(4)]
    params = [SamplingParams(temperature=t, seed=11, top_k=50, max_tokens=32, ignore_eos=True, logprobs=1)
              for t in (0.0, 0.8, 0.0, 0.8)]  # fmt: skip
    graph_runs = [0]

    def counted(*a):
        graph_runs[0] += 1
        return run(*a)

    drafter.graphs.run = counted
    runs = {}
    for name, graphs in (("graphs", True), ("eager", False)):
        drafter.use_graphs = graphs
        calls = []

        def recorded(requests, calls=calls):
            out = propose(requests)
            calls.append(out)
            return out

        drafter.propose = recorded
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[name] = ([(list(o.outputs[0].token_ids), [x.hex() for x in o.outputs[0].token_logprobs]) for o in outs],
                      calls)  # fmt: skip
    drafter.propose, drafter.graphs.run, drafter.use_graphs = propose, run, True
    engine.drafter, observe = None, engine._observe
    engine._observe = None
    plain = llm.generate(prompts, params, use_tqdm=False)
    engine.drafter, engine._observe = drafter, observe
    plain = [(list(o.outputs[0].token_ids), [x.hex() for x in o.outputs[0].token_logprobs]) for o in plain]
    equal = runs["graphs"] == runs["eager"] and runs["graphs"][0] == plain
    calls = len(runs["graphs"][1])
    assert equal and calls > 0 and graph_runs[0] > 0, (equal, calls, graph_runs)
    return {"equal": equal, "calls": calls, "graph_runs": graph_runs[0]}


def expected_tokens(a: float, k: int) -> float:
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (fp32): a smoke test")
    ap.add_argument("--shape", choices=["qwen3", "llama"], default="qwen3", help="Qwen3-8B or Llama-3.1-8B")
    ap.add_argument("--layers", type=int, default=None, help="target depth (default: the shape's)")
    ap.add_argument("--ks", default="1,3,7")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warm-steps", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    cuda = not args.tiny
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny for the CPU smoke test")
    device = torch.device("cuda" if cuda else "cpu")
    shape = {"qwen3": QWEN3_TINY, "llama": LLAMA_TINY}[args.shape] if args.tiny else {
        "qwen3": QWEN3_8B, "llama": LLAMA31_8B}[args.shape]  # fmt: skip
    layers = args.layers or shape["num_hidden_layers"]
    args.vocab = shape["vocab_size"]
    ks = [int(k) for k in args.ks.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="lockstep-eagle3-"))
    target_dir, head_dir = workdir / "target", workdir / "head"
    target_dir.mkdir()
    build_checkpoint(target_dir, shape, layers, device, weights=False)  # load_format="dummy"
    draft_vocab = DRAFT_VOCAB if not args.tiny else 200
    head = build_head(head_dir, shape, layers, draft_vocab, device)
    spec = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": max(ks)}
    llm = LLM(
        str(target_dir), device=str(device), dtype="bfloat16" if cuda else "float32", max_num_seqs=4,
        max_model_len=4096 if cuda else 1024, enable_prefix_caching=False, gpu_memory_utilization=0.8,
        load_format="dummy", speculative_config=spec,
    )  # fmt: skip
    drafter = llm.engine.drafter
    if drafter.graphs is None:  # the CPU: no capture, the graph functions run uncaptured over the same buffers
        drafter.graphs, drafter.use_graphs = drafter.make_graphs(llm.engine.config.max_num_seqs), True
    timed = Timed(llm.engine)
    report = {"args": vars(args), "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "target_layers": layers, "head": head, "head_graphs_captured": bool(drafter.graphs.graphs),
              "rows": []}  # fmt: skip
    plain = time_steps(llm, None, args, "plain")
    report["plain"] = plain
    print(f"{args.shape} target, {layers} layers, head {head['params'] / 1e6:.0f}M params, batch 1, "
          f"{args.input_len}-token prompt; plain decode step {plain['step_ms']:.2f} ms")  # fmt: skip
    report["head_graph_error"] = drafter.graph_error
    print(f"head's draft-loop graphs captured: {report['head_graphs_captured']}"
          + (f" (capture failed: {drafter.graph_error})" if drafter.graph_error else ""))  # fmt: skip
    print("\n| k | step ms | draft ms, graphs (per draft) | draft ms, eager (per draft) | eager / graphs | observe ms "
          "| verify ms | verify vs plain | drafts/step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for k in ks:
        llm.engine.config.speculative_config.num_speculative_tokens = k
        drafter.use_graphs = False
        eager = time_steps(llm, timed, args, f"k{k}-eager")
        drafter.use_graphs = True
        row = {"k": k} | time_steps(llm, timed, args, f"k{k}")
        row |= {"draft_ms_eager": eager["draft_ms"], "step_ms_eager": eager["step_ms"]}
        report["rows"].append(row)
        print(f"| {k} | {row['step_ms']:.2f} | {row['draft_ms']:.2f} ({row['draft_ms'] / k:.2f}) | "
              f"{eager['draft_ms']:.2f} ({eager['draft_ms'] / k:.2f}) | {eager['draft_ms'] / row['draft_ms']:.2f}x | "
              f"{row['observe_ms']:.2f} | {row['verify_ms']:.2f} | {row['verify_ms'] / plain['step_ms']:.2f}x | "
              f"{row['drafts_per_step']:.1f} |", flush=True)  # fmt: skip
    print("\ntok/s at batch 1 from the measured steps, each draft accepted with probability a")
    print("| k | plain | " + " | ".join(f"a={a}" for a in ALPHAS) + " |")
    print("|---|---|" + "---|" * len(ALPHAS))
    for row in report["rows"]:
        k = row["k"]
        row["tok_s_by_acceptance"] = {str(a): expected_tokens(a, k) / row["step_ms"] * 1e3 for a in ALPHAS}
        cells = " | ".join(f"{row['tok_s_by_acceptance'][str(a)]:.1f}" for a in ALPHAS)
        print(f"| {k} | {1e3 / plain['step_ms']:.1f} | {cells} |")
    report["graphs_equal_eager"] = graphs_equal_eager(llm, timed, args)
    print(f"\nproposals and output with the target's CUDA graphs == without: {report['graphs_equal_eager']}")
    d = report["draft_graphs_equal_eager"] = draft_graphs_equal_eager(llm, timed, args)
    print(
        f"head's graphs == its eager loop (4 requests, greedy and seeded: every proposal, ids and logprob bits) "
        f"== plain decoding: {d['equal']} ({d['calls']} calls, {d['graph_runs']} through the graphs)"
    )
    report["async_equal_sync"] = async_equal_sync(llm, timed, args)
    a = report["async_equal_sync"]
    print(f"async scheduling + EAGLE-3 (4 requests, drafts at every other step) == synchronous == plain decoding: "
          f"{a['equal']} ({a['fed_steps']} steps fed on the device)")  # fmt: skip
    write_report(report, args.out, "eagle3_gpu.json")
    return report


if __name__ == "__main__":
    main()
