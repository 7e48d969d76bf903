"""The whole engine on a GPU: the invariance matrix and throughput, batch_invariant=True vs False.

    python bench/engine.py          # H200 default: Qwen3-8B shape cut to 4 layers, SmolLM2-135M shape; < 4 min
    python bench/engine.py --smoke  # tiny shapes on the CPU (no GPU needed), < 1 min; add --device cuda for a
                                    # quick GPU sanity run of the same tiny shapes
    # Scaled up (each < 10 min): the full-depth matrix, then the standard throughput workload.
    python bench/engine.py --layers 36 --max-batch 256 --long 32768 --no-throughput --budget 480
    python bench/engine.py --layers 36 --models qwen3 --no-matrix --num-requests 256 --input-len 1024 \
        --output-len 1024 --budget 480

Random-weight checkpoints with real model shapes are written with transformers' ``save_pretrained`` (bf16) into a
temp dir, with a word-level tokenizer covering the vocabulary; prompts are token-id lists.

Invariance matrix: target requests (greedy; seeded temperature 0.8; seeded 0.8 with top-k/top-p; seeded 0.8 with
min-p, a repetition penalty and a logit bias; plus a long greedy and a long sampled prompt) are first run alone,
each on a fresh scheduler. Each case then runs them again among random other requests, or under other engine
settings (chunked prefill budgets, max_num_seqs, a prefix-cache hit, no prefix caching, preemption by a tight KV
cache, each decode step re-run as a fresh prefill, the completion read back as prompt logprobs of prompt +
completion, chunked among others), and compares token ids, logprob bits and top-5 logprob bits (with ranks) with
the alone run. Cases share the loaded model and
its KV cache tensors but get a fresh scheduler each (what a fresh ``LLM`` would have, minus the reload). The
same harness then runs with ``batch_invariant=False`` (torch's kernels): the negative control, which should see
differences on a GPU.

Throughput (the Qwen3 shape unless ``--tp-models``): N fresh random prompts x input tokens, fixed output length
(ignore_eos), greedy unless ``--tp-temperature``; a warm-up run, a prefill-only run (max_tokens=1) and a full
run, timed with the engine loop ``LLM.generate`` uses (stepped here so a run can stop at the time budget; a cut
run is marked partial). Prefix caching is off for these runs. On CUDA, decode replays CUDA graphs (kernel sets that
can be captured; the ``eager_vs_graphs`` case checks them against eager steps).

Time: ``--budget`` seconds for everything after start-up (checkpoints included); each (model, mode) section gets
a weighted share of what is left (invariance cases first, then throughput in the section's last third; time a
section leaves passes on). A case starts only before its section's deadline; the ones that do not are reported as
skipped: raise ``--budget`` to run them. The table is printed last; JSON goes to ``--out``.
"""

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import random
import shutil
import struct
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

if "--smoke" in sys.argv:
    # The 2-core CPU machines: OpenMP threads that spin while waiting slow everything down.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the engine's CPU path needs no Triton; set before lockstep

from lockstep.config import EngineConfig  # noqa: E402
from lockstep.engine.scheduler import Scheduler  # noqa: E402
from lockstep.llm import LLM  # noqa: E402
from lockstep.outputs import OutputKind, RequestOutput  # noqa: E402
from lockstep.sampling_params import SamplingParams  # noqa: E402

START = time.perf_counter()
BLOCK = 16
SECTION_WEIGHTS = {("qwen3", "invariant"): 3.0, ("qwen3", "default"): 2.0, ("qwen3", "torch-linear"): 2.0,
                   ("smollm2", "invariant"): 2.0, ("smollm2", "default"): 1.5,
                   ("smollm2", "torch-linear"): 1.5}  # fmt: skip
# How the table names the modes (kernel sets): batch_invariant=True, False, the bench-only mix (torch's matmul,
# norm and activation kernels with lockstep's attention) that prices invariance outside attention, torch's own ops.
LABELS = {"invariant": "on", "default": "off", "torch-linear": "lin", "torch": "tch"}
TOP = 5  # top logprobs asked for by the targets

# Real shapes (config.json values of Qwen/Qwen3-8B and HuggingFaceTB/SmolLM2-135M-Instruct).
QWEN3_8B = dict(
    arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
)  # fmt: skip
# Qwen3's generation_config.json sampling defaults (what a chat server applies): --tp-chat-sampling.
CHAT_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
# Qwen3-32B: a model that needs several GPUs at long context (65.5 GB of bf16 weights).
QWEN3_32B = dict(QWEN3_8B, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                 num_key_value_heads=8)  # fmt: skip
SMOLLM2_135M = dict(
    arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
# --smoke: the same two families at toy sizes.
QWEN3_TINY = dict(QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                  bos_token_id=0, eos_token_id=511)  # fmt: skip
SMOLLM2_TINY = dict(SMOLLM2_135M, vocab_size=384, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                    max_position_embeddings=1024)  # fmt: skip


# -- checkpoints -----------------------------------------------------------------------------------------------


def save_tokenizer(folder: Path, vocab_size: int, eos: int) -> None:
    """A word-level tokenizer with one word ``<i>`` per token id, so every id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", eos_token=f"<{eos}>").save_pretrained(folder)


def add_load_format_arg(ap: argparse.ArgumentParser) -> None:
    """``--load-format``: dummy (config.json only, the engine draws the weights) or auto (a checkpoint written and
    read), for ``build_checkpoint(weights=...)`` and ``LLM(load_format=...)``."""
    ap.add_argument(
        "--load-format", default="dummy", choices=["dummy", "auto"],
        help="dummy (default): config.json only, weights drawn by the engine; auto: write and read a checkpoint",
    )  # fmt: skip


def build_checkpoint(
    folder: Path, shape: dict, layers: int | None, device: torch.device, seed: int = 0, weights: bool = True
) -> dict:
    """Save a random-weight bf16 HF checkpoint of ``shape`` (depth cut to ``layers``) and a tokenizer. Without
    ``weights``, config.json and the tokenizer only: for ``LLM(..., load_format="dummy")``, which draws the weights
    itself (minutes less on a 16-65 GB model)."""
    import transformers

    kwargs = {k: v for k, v in shape.items() if k != "arch"}
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    cls_config, cls_model = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[shape["arch"]]
    config = cls_config(**kwargs)
    with torch.device(device if weights else "meta"):
        model = cls_model._from_config(config, dtype=torch.bfloat16).eval()
    num_params = sum(p.numel() for p in model.parameters())
    info = {"params": num_params, "num_hidden_layers": kwargs["num_hidden_layers"], "weight_bytes": 2 * num_params}
    save_tokenizer(folder, kwargs["vocab_size"], kwargs["eos_token_id"])
    if not weights:
        config.architectures = [cls_model.__name__]
        config.dtype = torch.bfloat16
        config.save_pretrained(folder)
        return info | {"load_format": "dummy"}
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, device=device)
            # Norm weights near 1, matrices with fan-in scaling: logits of order 1, no degenerate ties.
            p.copy_(1.0 + 0.1 * noise if "norm" in name else noise / p.shape[-1] ** 0.5)
            del noise
    model.save_pretrained(folder)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info | {"load_format": "auto"}


# Qwen3-FP8's quantization_config: 128 x 128 block weight scales, activations per token and 128 columns.
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}  # fmt: skip


def mark_fp8_block(folder: Path) -> None:
    """Make a ``build_checkpoint(weights=False)`` folder a Qwen3-FP8-style checkpoint: its dummy weights are then
    drawn and quantized in that layout (the FP8 linear with per-128-column activations), not online FP8's."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = FP8_BLOCK_CONFIG
    path.write_text(json.dumps(config, indent=2))


# -- comparing outputs -------------------------------------------------------------------------------------------


def write_report(report: dict, folder: str | Path, name: str) -> Path:
    """``report``, dated now (UTC), as ``folder/name`` (JSON); prints where it went."""
    report["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out = Path(folder) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")
    return out


def bits(out: RequestOutput) -> tuple:
    """Token ids, logprob bit patterns and top-logprob bit patterns (with ranks), per step."""
    lps = [struct.pack("<d", x) for x in out.token_logprobs]
    tops = [tuple((t, struct.pack("<d", v.logprob), v.rank) for t, v in d.items()) for d in out.logprobs or []]
    return list(out.token_ids), lps, tops


def prompt_bits(out: RequestOutput, start: int) -> tuple:
    """``bits`` of prompt tokens ``start..`` from their prompt logprobs (what the decode steps that generated them
    reported, if the contract holds)."""
    ids, dicts = out.prompt_token_ids[start:], out.prompt_logprobs[start:]
    lps = [struct.pack("<d", d[t].logprob) for d, t in zip(dicts, ids, strict=True)]
    tops = [tuple((t, struct.pack("<d", v.logprob), v.rank) for t, v in d.items()) for d in dicts]
    return list(ids), lps, tops


def compare(got: tuple, ref: tuple) -> dict:
    """``tok``: 1 if the token ids differ; ``lp``: steps of the shared token prefix whose logprob or top-logprob
    bits differ; ``steps``: steps compared."""
    ids, lps, tops = got
    rids, rlps, rtops = ref
    same = 0
    while same < min(len(ids), len(rids)) and ids[same] == rids[same]:
        same += 1
    lp = sum(lps[i] != rlps[i] or tops[i : i + 1] != rtops[i : i + 1] for i in range(same))
    return {"tok": int(ids != rids), "lp": lp, "steps": len(rids)}


# -- workloads ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    """Sizes of everything the bench runs; ``--smoke`` shrinks them."""

    target_lens: tuple[int, ...]
    target_out: int
    other_prompt_max: int
    other_out_max: int
    batch_sizes: tuple[int, ...]
    chunk_small: int
    chunk_mid: int
    long_len: int
    long_out: int
    long_chunk: int
    tp_requests: int
    tp_in: int
    tp_out: int
    tp_batched_tokens: int

    @property
    def large_budget(self) -> int:
        return max(8192 if self.long_len > 1024 else 1024, self.long_len + 64)


def target_requests(plan: Plan, vocab: int, long_len: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(1000)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in plan.target_lens]
    common = dict(max_tokens=plan.target_out, logprobs=TOP, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, **common),
        SamplingParams(temperature=0.8, seed=1234, **common),
        SamplingParams(temperature=0.8, seed=99, top_k=50, top_p=0.9, **common),
        # Penalties that depend on prompt and output alike, so a fresh prefill (decode_vs_prefill) agrees.
        SamplingParams(temperature=0.8, seed=5, min_p=0.05, repetition_penalty=1.2, logit_bias={7: 3.0}, **common),
    ][: len(prompts)]
    long_common = dict(max_tokens=plan.long_out, logprobs=TOP, ignore_eos=True)
    for params_long in (
        SamplingParams(temperature=0, **long_common),
        SamplingParams(temperature=0.8, seed=7, **long_common),
    ):
        prompts.append([rng.randrange(vocab) for _ in range(long_len)])
        params.append(params_long)
    return prompts, params


def other_requests(rng: random.Random, n: int, plan: Plan, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = [], []
    for _ in range(n):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randrange(1, plan.other_prompt_max + 1))])
        t = rng.choice([0, 0.7, 1.0])
        params.append(
            SamplingParams(temperature=t, seed=rng.randrange(1 << 30), max_tokens=rng.randint(1, plan.other_out_max))
        )
    return prompts, params


def resolve_overrides(base: EngineConfig, overrides: dict, plan: Plan) -> dict:
    """A case's scheduler settings, made valid for ``EngineConfig``."""
    overrides = dict(overrides)
    budget = overrides.get("max_num_batched_tokens")
    if budget is not None and "max_num_seqs" not in overrides:
        # The engine requires max_num_batched_tokens >= max_num_seqs.
        overrides["max_num_seqs"] = min(budget, base.max_num_seqs)
    if overrides.get("num_kv_blocks") == -1:
        # Room for the largest single request and a bit more: the batch has to take turns.
        biggest = max(max(plan.target_lens) + plan.target_out, plan.other_prompt_max + plan.other_out_max)
        overrides["num_kv_blocks"] = 2 * math.ceil(biggest / BLOCK) + 2
    if "num_kv_blocks" in overrides:  # a smaller cache caps the context, as it does in a fresh LLM
        overrides["max_model_len"] = min(base.max_model_len, overrides["num_kv_blocks"] * base.block_size + 1)
    return overrides


def fresh_scheduler(llm: LLM, **overrides) -> Scheduler:
    """Give the engine a new scheduler (a new, empty block manager) with some settings changed; the model and
    its KV cache tensors stay. What a fresh ``LLM(**overrides)`` gives, without reloading the weights."""
    engine = llm.engine
    overrides.setdefault("async_scheduling", False)  # the matrix's references run synchronously (its cases say)
    config = dataclasses.replace(engine.runner.config, **overrides)
    engine.config = config
    engine.scheduler = Scheduler(config, eos_token_ids=engine.eos_token_ids)
    engine._in_flight = None  # async scheduling: a finished run's last launched step belongs to the old scheduler
    engine.runner.use_graphs = engine.runner.graphs is not None and not config.enforce_eager
    return engine.scheduler


def run_mixed(llm: LLM, targets: list[int], tp: tuple, num_others: int, seed: int, plan: Plan, vocab: int) -> list:
    """Run the chosen targets among ``num_others`` random requests at random positions; the targets' outputs."""
    rng = random.Random(seed)
    prompts, params = other_requests(rng, num_others, plan, vocab)
    slots = sorted(rng.sample(range(num_others + len(targets)), len(targets)))
    for slot, t in zip(slots, targets, strict=True):
        prompts.insert(slot, tp[0][t])
        params.insert(slot, tp[1][t])
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [outs[s] for s in slots]


def matrix_cases(plan: Plan, n_short: int, n_long: int) -> list[tuple[str, dict, list[int], int]]:
    """(name, scheduler overrides, targets, number of other requests), most telling first."""
    short = list(range(n_short))
    longs = list(range(n_short, n_short + n_long))
    big = max(plan.batch_sizes)
    cases = [
        ("rerun_alone", {}, short, -1),
        (f"batch_{big}", {}, short, big - n_short),
        (
            f"chunked_{plan.chunk_small}",
            {"max_num_batched_tokens": plan.chunk_small, "max_num_seqs": plan.chunk_small},
            short,
            13,
        ),
        ("prefix_hit", {}, short, 8),
        (f"long_in_batch_{plan.long_chunk}", {"max_num_batched_tokens": plan.long_chunk}, longs, 16),
        ("decode_vs_prefill", {"enable_prefix_caching": False}, short, -2),
        (
            "prompt_logprobs",
            {"max_num_batched_tokens": plan.chunk_small, "max_num_seqs": plan.chunk_small},
            short,
            -3,
        ),
    ]
    cases += [(f"batch_{b}", {}, short, b - n_short) for b in plan.batch_sizes if b != big]
    cases += [
        (f"chunked_{plan.chunk_mid}", {"max_num_batched_tokens": plan.chunk_mid}, short, 16),
        ("max_num_seqs_1", {"max_num_seqs": 1}, short, 3),
        ("max_num_seqs_4", {"max_num_seqs": 4}, short, 9),
        ("no_prefix_caching", {"enable_prefix_caching": False}, short, 8),
        ("eager_vs_graphs", {"enforce_eager": True}, short, 8),  # on CUDA the references replay CUDA graphs
        ("async_scheduling", {"async_scheduling": True}, short, 8),  # the references run synchronously
        (
            "async_chunked_preemption",
            {"async_scheduling": True, "num_kv_blocks": -1, "max_num_batched_tokens": 256, "max_num_seqs": 64},
            short,
            16,
        ),
        ("preemption", {"num_kv_blocks": -1, "max_num_batched_tokens": 256, "max_num_seqs": 64}, short, 16),
        (f"long_pair_chunked_{plan.long_chunk // 2}", {"max_num_batched_tokens": plan.long_chunk // 2}, longs, 0),
    ]
    return cases


def run_case(llm, name, overrides, targets, num_others, seed, tp, refs, plan, vocab) -> dict:
    overrides = resolve_overrides(llm.engine.runner.config, overrides, plan)
    row: dict = {"case": name, "settings": dict(overrides), "targets": len(targets)}
    sched = fresh_scheduler(llm, **overrides)
    seqs, preempted = {}, []
    add, schedule = sched.add, sched.schedule

    def spy_add(seq):
        add(seq)
        seqs[seq.request_id] = seq

    def spy_schedule():
        batch = schedule()
        preempted.extend(batch.preempted)
        return batch

    sched.add, sched.schedule = spy_add, spy_schedule
    if num_others == -1:  # each target alone again, each on a fresh scheduler
        outs = []
        for t in targets:
            fresh_scheduler(llm)
            outs += llm.generate([tp[0][t]], tp[1][t], use_tqdm=False)
        got = [bits(o) for o in outs]
    elif num_others == -2:  # step i of the completion, recomputed by a prefill of prompt + completion[:i]
        prompts, params, index = [], [], []
        for t in targets:
            ids = refs[t][0]
            for i in range(len(ids)):
                prompts.append(tp[0][t] + ids[:i])
                params.append(dataclasses.replace(tp[1][t], max_tokens=1))
                index.append((t, i))
        outs = llm.generate(prompts, params, use_tqdm=False)
        steps = {t: ([], [], []) for t in targets}
        for (t, _), o in zip(index, outs, strict=True):
            for acc, part in zip(steps[t], bits(o), strict=True):
                acc += part
        got = [steps[t] for t in targets]
    elif num_others == -3:  # prompt + completion as the prompt, among others: the completion's prompt logprobs
        ext = (
            [tp[0][t] + refs[t][0] for t in targets],
            [dataclasses.replace(tp[1][t], max_tokens=1, prompt_logprobs=TOP) for t in targets],
        )
        outs = run_mixed(llm, list(range(len(targets))), ext, 8, seed, plan, vocab)
        got = [prompt_bits(o, len(tp[0][t])) for o, t in zip(outs, targets, strict=True)]
    else:
        if name == "prefix_hit":
            warm = [tp[0][t] + [1, 2, 3] for t in targets]
            llm.generate(warm, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        outs = run_mixed(llm, targets, tp, num_others, seed, plan, vocab)
        got = [bits(o) for o in outs]
        if name == "prefix_hit":
            row["cached_tokens"] = [seqs[o.request_id].num_cached_tokens for o in outs]
        row["batch"] = num_others + len(targets)
    if overrides.get("num_kv_blocks"):
        row["preemptions"] = len(preempted)
    diffs = [compare(g, refs[t]) for g, t in zip(got, targets, strict=True)]
    row.update(
        seqs_differing=sum(d["tok"] > 0 or d["lp"] > 0 for d in diffs),
        token_mismatch=sum(d["tok"] for d in diffs),
        logprob_mismatch=sum(d["lp"] for d in diffs),
        steps=sum(d["steps"] for d in diffs),
    )
    return row


def run_matrix(llm: LLM, plan: Plan, vocab: int, long_len: int, deadline: float) -> dict:
    tp = target_requests(plan, vocab, long_len)
    n_short = len(plan.target_lens)
    t0 = time.perf_counter()
    refs = []
    for prompt, params in zip(*tp, strict=True):
        fresh_scheduler(llm, max_num_batched_tokens=plan.large_budget)
        [out] = llm.generate([prompt], params, use_tqdm=False)
        refs.append(bits(out))
    result = {
        "reference_s": round(time.perf_counter() - t0, 2),
        # Sanity of the random weights: the targets do not all collapse onto one repeated token.
        "distinct_target_outputs": len({tuple(r[0]) for r in refs[:n_short]}),
        "distinct_tokens_per_target": [len(set(r[0])) for r in refs],
        "cases": [],
    }
    print(f"    references: {result['reference_s']} s", flush=True)
    for k, (name, overrides, targets, num_others) in enumerate(matrix_cases(plan, n_short, len(tp[0]) - n_short)):
        if time.perf_counter() > deadline:
            result["cases"].append({"case": name, "skipped": "time budget"})
            continue
        t1 = time.perf_counter()
        row = run_case(llm, name, overrides, targets, num_others, 100 + k, tp, refs, plan, vocab)
        row["seconds"] = round(time.perf_counter() - t1, 2)
        result["cases"].append(row)
        note = f"cached tokens {row['cached_tokens']}" if "cached_tokens" in row else ""
        note += f"preemptions {row['preemptions']}" if "preemptions" in row else ""
        print(f"    {name:24s} {cell(row):>14s}  {row['seconds']:6.2f} s  {note}", flush=True)
    return result


# -- throughput --------------------------------------------------------------------------------------------------


def timed_run(llm: LLM, prompts: list[list[int]], params: SamplingParams, deadline: float, tag: str) -> dict:
    """``LLM.generate``'s loop, stepped by hand so it can stop at ``deadline`` (the rest is then aborted)."""
    engine = llm.engine
    cuda = engine.runner.device.type == "cuda"
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params, output_kind=OutputKind.DELTA)
    out_tokens = steps = 0
    started: set[str] = set()
    partial = False
    # Seconds of each step, split by whether some request got its first token in it (a step with prefill work).
    prefill_steps: list[float] = []
    decode_steps: list[float] = []
    while engine.has_unfinished_requests():
        t_step = time.perf_counter()
        outs = engine.step()
        before = len(started)
        steps += 1
        out_tokens += len(outs)
        started.update(o.request_id for o in outs)
        (prefill_steps if len(started) > before else decode_steps).append(time.perf_counter() - t_step)
        if time.perf_counter() > deadline and engine.has_unfinished_requests():
            partial = True
            for rid in ids:
                engine.abort(rid)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    prefill = len(started) * len(prompts[0])
    return {
        "seconds": round(seconds, 3),
        "steps": steps,
        "output_tokens": out_tokens,
        "prefill_tokens": prefill,
        "partial": partial,
        "prefill_steps": {"count": len(prefill_steps), "seconds": round(sum(prefill_steps), 3)},
        "decode_steps": {
            "count": len(decode_steps),
            "seconds": round(sum(decode_steps), 3),
            # mean ms a step in each quarter of the decode steps (the context grows along them)
            "quarter_ms": [round(sum(q) / max(len(q), 1) * 1e3, 2) for q in quarters(decode_steps)],
        },
    }


def quarters(xs: list[float]) -> list[list[float]]:
    n = len(xs)
    return [xs[i * n // 4 : (i + 1) * n // 4] for i in range(4)]


def run_throughput(
    llm: LLM,
    plan: Plan,
    vocab: int,
    sampling: dict,
    deadline: float,
    async_scheduling: bool | None = None,
) -> dict:
    """The throughput workload; ``sampling``: the requests' SamplingParams settings (temperature, top_p, ...)."""
    fresh_scheduler(
        llm,
        max_num_seqs=max(plan.tp_requests, 1),
        enable_prefix_caching=False,
        max_num_batched_tokens=max(plan.tp_batched_tokens, plan.tp_requests),
        async_scheduling=llm.engine.runner.config.async_scheduling if async_scheduling is None else async_scheduling,
    )
    rng = random.Random(7)
    fresh = lambda: [[rng.randrange(vocab) for _ in range(plan.tp_in)] for _ in range(plan.tp_requests)]
    sp = lambda n: SamplingParams(**sampling, seed=0, max_tokens=n, ignore_eos=True)
    warm = timed_run(llm, fresh(), sp(min(4, plan.tp_out)), deadline, "warm")
    prefill = timed_run(llm, fresh(), sp(1), deadline, "prefill")
    full = timed_run(llm, fresh(), sp(plan.tp_out), deadline, "full")
    r = {"warmup": warm, "prefill_only": prefill, "full": full, "partial": full["partial"] or prefill["partial"]}
    if full["seconds"] > 0:
        r["total_tok_s"] = (full["prefill_tokens"] + full["output_tokens"]) / full["seconds"]
        r["output_tok_s"] = full["output_tokens"] / full["seconds"]
    if prefill["seconds"] > 0 and not prefill["partial"]:
        r["prefill_tok_s"] = prefill["prefill_tokens"] / prefill["seconds"]
        decode_s = full["seconds"] - prefill["seconds"]
        decode_tokens = full["output_tokens"] - full["prefill_tokens"] // max(plan.tp_in, 1)
        if decode_s > 0 and not full["partial"]:
            r["decode_tok_s"] = decode_tokens / decode_s
    return r


# -- reporting ---------------------------------------------------------------------------------------------------


def cell(row: dict) -> str:
    if "skipped" in row:
        return "skip"
    if row["seqs_differing"] == 0:
        return "same"
    tok = f" t{row['token_mismatch']}" if row["token_mismatch"] else ""
    return f"{row['seqs_differing']}/{row['targets']}{tok} lp{row['logprob_mismatch']}"


def fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def print_table(report: dict) -> None:
    sections = [(m, mode) for m in report["matrix"] for mode in report["matrix"][m]]
    heads = [f"{m.split('-')[0]} {LABELS[mode]}" for m, mode in sections]
    names: list[str] = []
    for m, mode in sections:
        for row in report["matrix"][m][mode]["cases"]:
            if row["case"] not in names:
                names.append(row["case"])
    w = 15
    print()
    print("=" * 100)
    hw = report["gpu"] or report["device"]
    print(f"lockstep engine bench | {hw} | torch {report['torch']} triton {report['triton']} | {report['date']}")
    for name, info in report["models"].items():
        print(
            f"  {name}: {info['num_hidden_layers']}/{info['full_layers']} layers, {info['params'] / 1e9:.2f}B params"
            + (" (depth cut: --layers N)" if info["num_hidden_layers"] < info["full_layers"] else "")
        )
    if sections:
        print("invariance matrix vs. each target alone: 'same' = all bits equal, else targets differing/targets,")
        print("  tN = N targets with different token ids, lpN = N steps with different logprob/top-5 bits:")
        print(f"  {'case':26s}" + "".join(f"{h:>{w}s}" for h in heads))
        for name in names:
            cells = []
            for m, mode in sections:
                row = next((r for r in report["matrix"][m][mode]["cases"] if r["case"] == name), None)
                cells.append("-" if row is None else cell(row))
            print(f"  {name:26s}" + "".join(f"{c:>{w}s}" for c in cells))
        totals = []
        for m, mode in sections:
            rows = [r for r in report["matrix"][m][mode]["cases"] if "skipped" not in r]
            bad = sum(r["seqs_differing"] > 0 for r in rows)
            totals.append(f"{bad}/{len(rows)} differ")
        print(f"  {'cases with a difference':26s}" + "".join(f"{c:>{w}s}" for c in totals))
    if report["throughput"]:
        p = report["plan"]
        print(
            f"throughput ({p['tp_requests']} req x {p['tp_in']} in / {p['tp_out']} out, "
            f"T={report['args']['tp_temperature']}, tok/s):"
        )
        print(f"  {'':22s}{'total':>12s}{'output':>12s}{'prefill':>12s}{'decode':>12s}{'wall s':>9s}")
        for m, modes in report["throughput"].items():
            for mode, r in modes.items():
                tag = f"{m.split('-')[0]} {LABELS[mode]}" + (" PARTIAL" if r.get("partial") else "")
                if "skipped" in r:
                    print(f"  {tag:22s} skipped ({r['skipped']})")
                    continue
                print(
                    f"  {tag:22s}"
                    + "".join(
                        f"{fmt_rate(r.get(k)):>12s}"
                        for k in ("total_tok_s", "output_tok_s", "prefill_tok_s", "decode_tok_s")
                    )
                    + f"{r['full']['seconds']:9.1f}"
                )
                ps, ds = r["full"]["prefill_steps"], r["full"]["decode_steps"]
                print(f"  {'':22s}steps with prefill: {ps['count']} in {ps['seconds']:.1f} s; decode-only: "
                      f"{ds['count']} in {ds['seconds']:.1f} s, ms a step by quarter {ds['quarter_ms']}")  # fmt: skip
            on = modes.get("invariant", {})
            for other in ("default", "torch-linear"):
                off = modes.get(other, {})
                if on.get("total_tok_s") and off.get("total_tok_s"):
                    ratios = [
                        f"{k.split('_')[0]} {on[k] / off[k]:.2f}x"
                        for k in ("total_tok_s", "prefill_tok_s", "decode_tok_s")
                        if on.get(k) and off.get(k)
                    ]
                    print(f"  {m.split('-')[0]} speed on/{LABELS[other]}: " + ", ".join(ratios))
    print(f"verdict: {report['verdict']}")
    print(f"elapsed {report['elapsed_s']:.0f} s; JSON: {report['json']}")


def verdict(report: dict) -> str:
    if not report["matrix"]:
        return "invariance matrix not run"
    on = off = skipped = ran_on = ran_off = 0
    for modes in report["matrix"].values():
        for mode, res in modes.items():
            for r in res["cases"]:
                if "skipped" in r:
                    skipped += 1
                    continue
                ran_on += mode == "invariant"
                ran_off += mode == "default"
                if r["seqs_differing"]:
                    on += mode == "invariant"
                    off += mode == "default"
    s = "FAIL" if on else "PASS" if ran_on else "NO DATA"
    s += f": batch_invariant=True {on}/{ran_on} case(s) with a difference"
    s += f"; negative control (False): {off}/{ran_off} case(s) differ"
    if off == 0 and ran_off:
        s += " (the harness saw no batch effect in torch's kernels)"
    if skipped:
        s += f"; {skipped} case(s) skipped for time (raise --budget)"
    return s


# -- main --------------------------------------------------------------------------------------------------------


def build_llm(mode: str, **kwargs) -> LLM:
    return LLM(kernels=mode, **kwargs)  # every mode is a kernel set registered by name (layers.kernels)


def make_plan(args: argparse.Namespace) -> Plan:
    if args.smoke:
        return Plan(
            target_lens=(13, 29, 41, 23),
            target_out=6,
            other_prompt_max=40,
            other_out_max=8,
            batch_sizes=(4, 12),
            chunk_small=16,
            chunk_mid=64,
            long_len=args.long or 160,
            long_out=4,
            long_chunk=64,
            tp_requests=args.num_requests or 8,
            tp_in=args.input_len or 32,
            tp_out=args.output_len or 16,
            tp_batched_tokens=256,
        )
    sizes = tuple(b for b in (4, 16, 64, 256) if b < args.max_batch) + (args.max_batch,)
    return Plan(
        target_lens=(37, 150, 301, 90),
        target_out=16,
        other_prompt_max=384,
        other_out_max=24,
        batch_sizes=sizes,
        chunk_small=64,
        chunk_mid=512,
        long_len=args.long or 4096,
        long_out=8,
        long_chunk=2048,
        tp_requests=args.num_requests or 64,
        tp_in=args.input_len or 256,
        tp_out=args.output_len or 128,
        tp_batched_tokens=args.tp_batched_tokens,
    )


def kv_blocks(weight_bytes: int, cfg: dict, plan: Plan, long_len: int, max_model_len: int, device: torch.device) -> int:
    tokens = max(
        max(plan.batch_sizes) * (plan.other_prompt_max + plan.other_out_max)
        + 3 * (max(plan.target_lens) + plan.target_out),
        2 * (long_len + plan.long_out) + 16 * (plan.other_prompt_max + plan.other_out_max),
        plan.tp_requests * (plan.tp_in + plan.tp_out + BLOCK),
        len(plan.target_lens) * plan.target_out * (max(plan.target_lens) + plan.target_out),  # decode_vs_prefill
    )
    need = math.ceil(1.1 * tokens / BLOCK) + 64
    floor = math.ceil(max_model_len / BLOCK) + 1
    if device.type == "cuda":
        per_block = 2 * cfg["num_hidden_layers"] * BLOCK * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
        free, _ = torch.cuda.mem_get_info(device)
        cap = int(0.9 * (free - weight_bytes - (8 << 30)) / per_block)
        need = min(need, max(cap, floor))
    return max(need, floor)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, < 1 min")
    ap.add_argument("--layers", type=int, default=4, help="Qwen3-8B-shape depth (full: 36; default 4)")
    ap.add_argument("--models", default="qwen3,smollm2", help="comma list of qwen3, smollm2")
    ap.add_argument("--max-batch", type=int, default=64, help="largest batch in the matrix (default 64; try 256)")
    ap.add_argument("--long", type=int, default=None, help="long-prompt length (default 4096; try 32768)")
    ap.add_argument("--num-requests", type=int, default=None, help="throughput requests (default 64; standard 256)")
    ap.add_argument("--input-len", type=int, default=None, help="throughput prompt tokens (default 256; std 1024)")
    ap.add_argument("--output-len", type=int, default=None, help="throughput output tokens (default 128; std 1024)")
    ap.add_argument("--tp-batched-tokens", type=int, default=8192, help="throughput max_num_batched_tokens")
    ap.add_argument("--tp-temperature", type=float, default=0.0, help="throughput sampling temperature")
    ap.add_argument(
        "--tp-chat-sampling", action="store_true",
        help="throughput with Qwen3's chat defaults instead: temperature 0.6, top_p 0.95, top_k 20",
    )  # fmt: skip
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="throughput with async scheduling or without (default: the engine's; the matrix has its own cases)",
    )
    ap.add_argument(
        "--modes", default="invariant,default", help="comma list of invariant, default, torch-linear (bench only)"
    )
    ap.add_argument("--tp-models", default="qwen3", help="models to time (comma list; default qwen3)")
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--no-matrix", action="store_true", help="throughput only")
    ap.add_argument("--budget", type=float, default=None, help="seconds for all the work (default 200; smoke 45)")
    ap.add_argument("--device", default=None, help="default: cuda if available (else cpu)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="fp8: online FP8 linear layers (issue 30)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: an e4m3 KV cache")
    ap.add_argument("--workdir", default=None, help="where to write the checkpoints (default: a temp dir, removed)")
    add_load_format_arg(ap)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="JSON folder or .json path (default $OUT or .)")
    args = ap.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    budget = args.budget if args.budget is not None else (45.0 if args.smoke else 200.0)
    plan = make_plan(args)
    out_path = Path(args.out)
    out_path = out_path if out_path.suffix == ".json" else out_path / "engine_bench.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import transformers

    report: dict = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]),
        "args": vars(args),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "plan": dataclasses.asdict(plan),
        "budget_s": budget,
        "models": {},
        "matrix": {},
        "throughput": {},
        "json": str(out_path),
    }

    def save() -> None:
        report["elapsed_s"] = time.perf_counter() - START
        out_path.write_text(json.dumps(report, indent=1, default=str))

    shapes = {
        "qwen3": ("qwen3-8b-shape", QWEN3_TINY if args.smoke else QWEN3_8B, None if args.smoke else args.layers),
        "smollm2": ("smollm2-135m-shape", SMOLLM2_TINY if args.smoke else SMOLLM2_135M, None),
    }
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for key, allowed in ((wanted, shapes), (modes, tuple(LABELS))):
        if not key or set(key) - set(allowed):
            ap.error(f"choose from {', '.join(allowed)}, got {key}")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="lockstep-bench-"))
    print(f"lockstep bench/engine.py on {report['gpu'] or device}; budget {budget:.0f} s; checkpoints in {workdir}")
    folders = {}
    try:
        for key in wanted:
            name, shape, layers = shapes[key]
            t0 = time.perf_counter()
            folder = workdir / name
            info = build_checkpoint(folder, shape, layers, device, weights=args.load_format != "dummy")
            info.update(full_layers=shape["num_hidden_layers"], build_s=round(time.perf_counter() - t0, 1))
            report["models"][name] = info
            folders[name] = (folder, shape, info)
            print(
                f"  built {name}: {info['num_hidden_layers']} layers, {info['params'] / 1e9:.2f}B params, "
                f"{info['build_s']} s",
                flush=True,
            )

        end = START + budget
        sections = [(name, mode) for name in folders for mode in modes]
        # Shares of the time left: the first section also pays for most Triton compiles; time a section does
        # not use passes on to the next.
        weights = [SECTION_WEIGHTS.get((name.split("-")[0], mode), 2.0) for name, mode in sections]
        for i, (name, mode) in enumerate(sections):
            folder, shape, info = folders[name]
            now = time.perf_counter()
            section_end = now + max(0.0, end - now) * weights[i] / sum(weights[i:])
            with_tp = not args.no_throughput and name.split("-")[0] in args.tp_models.split(",")
            if args.no_matrix and not with_tp:
                continue
            long_len = min(plan.long_len, shape["max_position_embeddings"] - plan.long_out - 2 * BLOCK)
            max_model_len = min(
                shape["max_position_embeddings"],
                max(
                    long_len + plan.long_out,
                    plan.tp_in + plan.tp_out,
                    plan.other_prompt_max + plan.other_out_max,
                    max(plan.target_lens) + 2 * plan.target_out,
                )
                + BLOCK,
            )
            cfg = {**shape, "num_hidden_layers": info["num_hidden_layers"]}
            blocks = kv_blocks(info["weight_bytes"], cfg, plan, long_len, max_model_len, device)
            print(
                f"[{name} | {mode}] {blocks} KV blocks, max_model_len "
                f"{max_model_len}, section ends at {section_end - START:.0f} s",
                flush=True,
            )
            t0 = time.perf_counter()
            llm = build_llm(
                mode,
                model=str(folder),
                device=str(device),
                dtype=args.dtype,
                block_size=BLOCK,
                num_kv_blocks=blocks,
                max_model_len=max_model_len,
                max_num_batched_tokens=plan.large_budget,
                seed=0,
                load_format=args.load_format,
                quantization=args.quantization,
                kv_cache_dtype=args.kv_cache_dtype,
            )
            print(f"    loaded in {time.perf_counter() - t0:.1f} s", flush=True)
            if not args.no_matrix:
                matrix_end = now + (section_end - now) * 2 / 3 if with_tp else section_end
                res = run_matrix(llm, plan, shape["vocab_size"], long_len, matrix_end)
                res.update(kv_blocks=blocks, max_model_len=max_model_len, long_len=long_len)
                report["matrix"].setdefault(name, {})[mode] = res
                save()
            if with_tp:
                if time.perf_counter() < section_end:
                    sampling = CHAT_SAMPLING if args.tp_chat_sampling else {"temperature": args.tp_temperature}
                    tp = run_throughput(llm, plan, shape["vocab_size"], sampling, section_end, args.async_scheduling)
                    print(
                        f"    throughput: {fmt_rate(tp.get('total_tok_s'))} tok/s total, "
                        f"{fmt_rate(tp.get('output_tok_s'))} out" + (" (partial)" if tp["partial"] else ""),
                        flush=True,
                    )
                else:
                    tp = {"skipped": "time budget"}
                tp["compiles_after_start"] = llm.engine.triton_compiles_after_start  # while serving: the goal is 0
                tp["compiled_after_start"] = llm.engine.triton_kernels_compiled_after_start
                print(f"    Triton compiles after start-up: {tp['compiles_after_start']}", flush=True)
                for kernel in tp["compiled_after_start"]:
                    print(f"      {kernel[:300]}", flush=True)
                report["throughput"].setdefault(name, {})[mode] = tp
            del llm
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            save()
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report["verdict"] = verdict(report)
    save()
    print_table(report)


if __name__ == "__main__":
    main()
