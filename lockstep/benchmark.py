"""``lockstep bench latency`` and ``lockstep bench throughput``: what lockstep costs on your hardware, measured
like ``vllm bench latency`` / ``vllm bench throughput``.

Both send prompts of random token ids (drawn from the model's vocabulary without its special tokens, from
``seed``), each generating exactly ``output_len`` tokens (``ignore_eos``), greedy unless a temperature is given.
Every prompt is fresh, so no run hits the prefix cache of another. The engine is stepped here rather than through
``LLM.generate`` so each new token gets a timestamp: a request's time to first token (TTFT) runs from the
submission of its batch to the end of the step that produced that token, and its inter-token latencies (ITL) are
the gaps between the steps that produced its later tokens.

``latency`` submits one batch of ``num_requests`` requests and runs it to the end, ``num_iters`` times after
``num_iters_warmup`` untimed runs of the same shape. ``throughput`` submits ``num_requests`` requests at once and
steps them to completion, after ``num_iters_warmup`` untimed runs of the same requests cut to a few output tokens
(enough to compile the prefill and decode kernels without paying for a second full run).
"""

import dataclasses
import platform
import random
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from tqdm.auto import tqdm

import lockstep
from lockstep.llm import LLM
from lockstep.outputs import OutputKind
from lockstep.sampling_params import SamplingParams
from lockstep.spec.stats import SpecDecodeStats

Kind = Literal["latency", "throughput"]
PERCENTILES = (50, 90, 99)
THROUGHPUT_WARMUP_OUTPUT_LEN = 4


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: ``num_requests`` random prompts of ``input_len`` tokens submitted together, each generating
    exactly ``output_len`` tokens; ``num_iters`` timed runs (throughput: one) after ``num_iters_warmup`` untimed
    ones. ``seed`` draws the prompts and the engine's per-request sampling seeds."""

    kind: Kind
    num_requests: int
    input_len: int
    output_len: int
    num_iters: int = 1
    num_iters_warmup: int = 1
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("latency", "throughput"):
            raise ValueError(f"kind must be 'latency' or 'throughput', got {self.kind!r}")
        if self.kind == "throughput" and self.num_iters != 1:
            raise ValueError(f"throughput runs its requests once (num_iters=1), got num_iters={self.num_iters}")
        for name in ("num_requests", "input_len", "output_len", "num_iters", "num_iters_warmup"):
            value = getattr(self, name)
            least = 0 if name == "num_iters_warmup" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        self.params()  # validates the temperature

    def params(self, warmup: bool = False) -> SamplingParams:
        """The requests' sampling parameters (a throughput warm-up's cut to a few tokens)."""
        n = self.output_len
        if warmup and self.kind == "throughput":
            n = min(n, THROUGHPUT_WARMUP_OUTPUT_LEN)
        return SamplingParams(temperature=self.temperature, max_tokens=n, ignore_eos=True)


@dataclass
class Run:
    """One batch of requests submitted together and stepped to completion."""

    seconds: float
    prompt_tokens: int
    token_times: list[list[float]]  # per request: seconds from submission to the step that produced each token

    @property
    def output_tokens(self) -> int:
        return sum(len(times) for times in self.token_times)

    @property
    def ttfts(self) -> list[float]:
        return [times[0] for times in self.token_times if times]

    @property
    def itls(self) -> list[float]:
        return [b - a for times in self.token_times for a, b in zip(times[:-1], times[1:], strict=True)]


def percentiles(values: list[float]) -> dict[str, float] | None:
    """Mean, p50, p90 and p99 of ``values`` (linear interpolation, as numpy and vLLM); None when empty."""
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean())} | {f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES}


def prompt_token_pool(llm: LLM) -> list[int]:
    """The token ids random prompts draw from: the model's vocabulary (cut to the tokenizer's when that is
    smaller, as for padded embeddings) without the tokenizer's special tokens and the EOS ids."""
    engine = llm.engine
    size, special = engine.vocab_size, set(engine.eos_token_ids)
    if llm.tokenizer is not None:
        size = min(size, len(llm.tokenizer))
        special.update(llm.tokenizer.all_special_ids)
    pool = [t for t in range(size) if t not in special]
    return pool or list(range(engine.vocab_size))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str, progress: bool = False) -> Run:
    """Submit ``prompts`` at once and step the engine until all of them finish, timestamping each new token."""
    engine, device = llm.engine, llm.engine.runner.device
    ids = [f"bench-{tag}-{i}" for i in range(len(prompts))]
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    bar = tqdm(total=len(ids), desc="Requests", unit="req", dynamic_ncols=True) if progress else None
    _sync(device)
    start = time.perf_counter()
    now = 0.0
    try:
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_request(rid, prompt, params, output_kind=OutputKind.DELTA)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            _sync(device)
            now = time.perf_counter() - start
            for out in outputs:
                times[out.request_id].extend([now] * len(out.token_ids))
                if out.finished and bar is not None:
                    bar.update(1)
    except BaseException:
        for rid in ids:
            engine.abort(rid)
        raise
    finally:
        if bar is not None:
            bar.close()
    return Run(now, sum(map(len, prompts)), [times[rid] for rid in ids])


def check_fits(llm: LLM, cfg: BenchConfig) -> None:
    """ValueError when the engine cannot run ``cfg`` as asked: a request longer than the context, or a latency
    batch larger than the engine runs at once."""
    config = llm.engine.config
    if cfg.input_len + cfg.output_len > config.max_model_len:
        raise ValueError(
            f"input_len + output_len = {cfg.input_len} + {cfg.output_len} exceeds the context length "
            f"(max_model_len) {config.max_model_len}"
        )
    if cfg.kind == "latency" and cfg.num_requests > config.max_num_seqs:
        raise ValueError(
            f"batch size {cfg.num_requests} exceeds max_num_seqs {config.max_num_seqs}: the batch would not run "
            "at once; raise max_num_seqs"
        )


def run_benchmark(llm: LLM, cfg: BenchConfig, progress: bool = True) -> dict:
    """Warm up, run ``cfg`` and return the report: config, engine, environment and results."""
    check_fits(llm, cfg)
    rng = random.Random(cfg.seed)
    pool = prompt_token_pool(llm)
    prompts = lambda: [rng.choices(pool, k=cfg.input_len) for _ in range(cfg.num_requests)]
    for i in range(cfg.num_iters_warmup):
        if progress:  # the first runs compile the kernels: minutes on a CPU with nothing else to show
            print(f"warm-up {i + 1}/{cfg.num_iters_warmup} (untimed: compiles kernels)", file=sys.stderr, flush=True)
        run_batch(llm, prompts(), cfg.params(warmup=True), f"warmup{i}")
    llm.engine.spec_stats = SpecDecodeStats()  # the timed runs' acceptance only
    iters = range(cfg.num_iters)
    if progress and cfg.kind == "latency":
        iters = tqdm(iters, desc="Iterations", unit="iter", dynamic_ncols=True)
    request_bar = progress and cfg.kind == "throughput"
    runs = [run_batch(llm, prompts(), cfg.params(), f"iter{i}", request_bar) for i in iters]
    results = latency_results(runs) if cfg.kind == "latency" else throughput_results(runs[0])
    if llm.engine.drafter is not None:
        results["speculative"] = speculative_results(llm.engine.spec_stats)
    return {
        "benchmark": cfg.kind,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": dataclasses.asdict(cfg),
        "engine": dataclasses.asdict(llm.engine.config),
        "environment": environment(llm),
        "results": results,
    }


def _token_results(runs: list[Run]) -> dict:
    return {
        "requests": sum(len(r.token_times) for r in runs),
        "prompt_tokens": sum(r.prompt_tokens for r in runs),
        "output_tokens": sum(r.output_tokens for r in runs),
        "ttft_s": percentiles([t for r in runs for t in r.ttfts]),
        "itl_s": percentiles([t for r in runs for t in r.itls]),
    }


def latency_results(runs: list[Run]) -> dict:
    """Each run's end-to-end seconds and their statistics, and TTFT / ITL over all runs' requests."""
    latencies = [r.seconds for r in runs]
    return {"latencies_s": latencies, "latency_s": percentiles(latencies)} | _token_results(runs)


def throughput_results(run: Run) -> dict:
    """Requests and tokens per second of one run (total counts prompt and output tokens), and TTFT / ITL."""
    r = {"elapsed_s": run.seconds} | _token_results([run])
    r["total_tokens"] = r["prompt_tokens"] + r["output_tokens"]
    for key, count in (
        ("requests_per_s", "requests"),
        ("total_tok_s", "total_tokens"),
        ("output_tok_s", "output_tokens"),
    ):
        r[key] = r[count] / run.seconds if run.seconds > 0 else None
    return r


def speculative_results(s: SpecDecodeStats) -> dict:
    """The timed runs' acceptance: drafted and accepted tokens, the rate, tokens per verify chunk, and the mean
    over requests of the tokens each step gave them (their accepted length; 1.0 without drafting)."""
    return {
        "num_drafts": s.num_drafts,
        "num_draft_tokens": s.num_draft_tokens,
        "num_accepted_tokens": s.num_accepted_tokens,
        "accepted_per_position": s.accepted_per_position,
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_length": s.mean_accepted_length,
        "mean_request_accepted_length": s.mean_request_accepted_length,
    }


def environment(llm: LLM) -> dict:
    """What the figures were measured on: versions, the device and its name, the dtype and the kernel set."""
    runner = llm.engine.runner
    return {
        "lockstep": lockstep.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(runner.device),
        "device_name": device_name(runner.device),
        "dtype": str(runner.model.dtype).removeprefix("torch."),
        "kernels": runner.model.kernels.name,
    }


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name where the OS tells it."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def summary_lines(report: dict) -> list[str]:
    """The report as a short table for the terminal."""
    cfg, env, r = report["config"], report["environment"], report["results"]
    head = (
        f"lockstep bench {cfg['kind']}: {Path(report['engine']['model']).name}, kernels {env['kernels']}, "
        f"{env['device_name']} ({env['device']}), {env['dtype']}"
    )
    shape = f"{cfg['num_requests']} requests x {cfg['input_len']} in / {cfg['output_len']} out"
    if cfg["kind"] == "latency":
        lines = [head, f"batch of {shape}, {cfg['num_iters']} iterations after {cfg['num_iters_warmup']} warm-up"]
    else:
        rate = lambda key, unit: f"{r[key]:.2f} {unit}" if r[key] is not None else f"- {unit}"
        lines = [
            head,
            f"{shape}: {r['prompt_tokens']} prompt + {r['output_tokens']} output tokens in {r['elapsed_s']:.3f} s",
            f"throughput: {rate('requests_per_s', 'requests/s')}, {rate('total_tok_s', 'total tok/s')}, "
            f"{rate('output_tok_s', 'output tok/s')}",
        ]
    lines.append(f"{'':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    rows = [("latency (s)", "latency_s", 1.0)] if cfg["kind"] == "latency" else []
    for label, key, scale in rows + [("TTFT (ms)", "ttft_s", 1e3), ("ITL (ms)", "itl_s", 1e3)]:
        stats = r[key]
        cells = [f"{stats[k] * scale:>10.3f}" if stats else f"{'-':>10}" for k in ("mean", "p50", "p90", "p99")]
        lines.append(f"{label:<16}" + "".join(cells))
    spec = r.get("speculative")
    if spec is not None:
        lines.append(
            f"speculative: {spec['num_accepted_tokens']} of {spec['num_draft_tokens']} drafted tokens accepted "
            f"({spec['acceptance_rate']:.1%}), {spec['mean_accepted_length']:.2f} tokens per verify chunk, "
            f"{spec['mean_request_accepted_length']:.2f} tokens per step per request (mean accepted length)"
        )
    return lines
