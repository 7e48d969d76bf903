"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

lockstep's own names (``lockstep_*``), and beside them the same figures under vLLM's names (``vllm:*``, labelled
``model_name`` as vLLM labels them) so that dashboards built for vLLM read them: ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (and the older ``vllm:gpu_cache_usage_perc``: the
fraction of KV blocks held, 0 to 1), ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:request_success_total``, ``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds`` and
``vllm:inter_token_latency_seconds``, and ``vllm:iteration_tokens_total`` (a histogram, despite its name: the
tokens each engine step ran, vLLM's buckets; lockstep's ``lockstep_iteration_tokens``).

Counters and histograms are updated from the event loop and the engine thread; gauges are set by the engine
thread after every step. Plain attribute updates are enough here: a scrape may be one step stale.
"""

import bisect
from dataclasses import dataclass, field

from lockstep.outputs import RequestStateStats
from lockstep.spec.stats import SpecDecodeStats

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        """The histogram's lines; ``labels``: more labels, as ``key="value"`` pairs joined by commas."""
        out, cumulative = [], 0
        more = f"{labels}," if labels else ""
        for le, c in zip(self.buckets, self.counts, strict=False):
            cumulative += c
            out.append(f'{name}_bucket{{{more}le="{le}"}} {cumulative}')
        out.append(f'{name}_bucket{{{more}le="+Inf"}} {self.count}')
        tail = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{tail} {self.total}")
        out.append(f"{name}_count{tail} {self.count}")
        return out


@dataclass
class Metrics:
    requests: dict[str, int] = field(default_factory=dict)  # by HTTP status code
    prompt_tokens: int = 0
    generation_tokens: int = 0
    aborted: int = 0
    running: int = 0
    waiting: int = 0
    grammar_cache_bytes: int = 0  # compiled structured-output constraints kept: what they are charged (limits.py)
    grammar_cache_entries: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    triton_compiles: int = 0  # since the engine started: each one stalled a step (engine/warmup.py)
    connections_open: int = 0  # served connections (connection.ConnectionLedger keeps these two)
    connections_refused: int = 0
    request_seconds: Histogram = field(default_factory=Histogram)
    first_token_seconds: Histogram = field(default_factory=Histogram)
    step_seconds: Histogram = field(default_factory=Histogram)
    inter_token_seconds: Histogram = field(default_factory=Histogram)  # a request's tokens, one from the next
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKEN_BUCKETS))  # per step
    info: dict[str, str] = field(default_factory=dict)  # what is served: kernel set, device, dtype, version
    model_name: str = ""  # the served model's name: the label of vLLM's metric names
    finished: dict[str, int] = field(default_factory=dict)  # requests ended, by finish reason (vLLM's)
    spec_decode: SpecDecodeStats | None = None  # the engine's, when it drafts (speculative_config)

    def count_request(self, status: int) -> None:
        key = str(status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def render(self) -> str:
        p = "lockstep_"
        lines = [
            f"# HELP {p}requests_total HTTP requests to the /v1 endpoints, by status code.",
            f"# TYPE {p}requests_total counter",
        ]
        lines += [f'{p}requests_total{{code="{k}"}} {v}' for k, v in sorted(self.requests.items())]
        if self.info:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(self.info.items()))
            lines += [f"# HELP {p}info What this server runs.", f"# TYPE {p}info gauge", f"{p}info{{{labels}}} 1"]
        for name, kind, value, doc in (
            ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens of accepted requests."),
            ("generation_tokens_total", "counter", self.generation_tokens, "Tokens generated."),
            ("requests_aborted_total", "counter", self.aborted, "Requests aborted (client gone) mid-generation."),
            ("num_requests_running", "gauge", self.running, "Sequences holding KV blocks."),
            ("num_requests_waiting", "gauge", self.waiting, "Sequences queued for admission."),
            ("grammar_cache_bytes", "gauge", self.grammar_cache_bytes, "Compiled grammars kept, bytes charged."),
            ("grammar_cache_entries", "gauge", self.grammar_cache_entries, "Compiled grammars kept."),
            ("kv_blocks_used", "gauge", self.kv_blocks_used, "KV cache blocks held by sequences."),
            ("kv_blocks_total", "gauge", self.kv_blocks_total, "KV cache blocks in all."),
            ("triton_compiles_after_start", "gauge", self.triton_compiles, "Kernels compiled while serving."),
            ("http_connections_open", "gauge", self.connections_open, "Connections being served."),
            ("http_connections_refused_total", "counter", self.connections_refused, "Connections past a cap."),
        ):
            lines += [f"# HELP {p}{name} {doc}", f"# TYPE {p}{name} {kind}", f"{p}{name} {value}"]
        for name, hist, doc in (
            ("request_latency_seconds", self.request_seconds, "Request latency, arrival to last token."),
            ("time_to_first_token_seconds", self.first_token_seconds, "Arrival to first generated token."),
            ("engine_step_seconds", self.step_seconds, "Duration of one engine step."),
            ("inter_token_latency_seconds", self.inter_token_seconds, "A request's time from one token to the next."),
            ("iteration_tokens", self.iteration_tokens, "Tokens (prompt and generated) one engine step ran."),
        ):
            lines += [f"# HELP {p}{name} {doc}", f"# TYPE {p}{name} histogram", *hist.lines(p + name)]
        if self.spec_decode is not None:
            lines += _spec_decode_lines(p + "spec_decode_", self.spec_decode)
        return "\n".join(lines + self.vllm_lines()) + "\n"

    def vllm_lines(self) -> list[str]:
        """The figures above under vLLM's metric names and label (the module docstring)."""
        label = 'model_name="{}"'.format(self.model_name.replace("\\", "\\\\").replace('"', '\\"'))
        usage = self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
        lines = []
        for name, kind, value, doc in (
            ("num_requests_running", "gauge", self.running, "Number of requests in model execution batches."),
            ("num_requests_waiting", "gauge", self.waiting, "Number of requests waiting to be processed."),
            ("kv_cache_usage_perc", "gauge", usage, "KV-cache usage. 1 means 100 percent usage."),
            ("gpu_cache_usage_perc", "gauge", usage, "KV-cache usage (vLLM's older name). 1 means 100 percent usage."),
            ("prompt_tokens_total", "counter", self.prompt_tokens, "Number of prefill tokens processed."),
            ("generation_tokens_total", "counter", self.generation_tokens, "Number of generation tokens processed."),
        ):
            lines += [f"# HELP vllm:{name} {doc}", f"# TYPE vllm:{name} {kind}", f"vllm:{name}{{{label}}} {value}"]
        lines += ["# HELP vllm:request_success_total Count of finished requests, by finish reason."]
        lines += ["# TYPE vllm:request_success_total counter"]
        lines += [
            f'vllm:request_success_total{{{label},finished_reason="{reason}"}} {count}'
            for reason, count in sorted(self.finished.items())
        ]
        for name, hist, doc in (
            ("time_to_first_token_seconds", self.first_token_seconds, "Histogram of time to first token in seconds."),
            ("e2e_request_latency_seconds", self.request_seconds, "Histogram of end to end request latency."),
            ("inter_token_latency_seconds", self.inter_token_seconds, "Histogram of inter-token latency."),
            ("iteration_tokens_total", self.iteration_tokens, "Histogram of number of tokens per engine_step."),
        ):
            lines += [f"# HELP vllm:{name} {doc}", f"# TYPE vllm:{name} histogram", *hist.lines(f"vllm:{name}", label)]
        return lines


def _spec_decode_lines(p: str, s: SpecDecodeStats) -> list[str]:
    """vLLM's spec_decode counters (drafts, draft tokens, accepted tokens, accepted per position), the verify
    chunks by how many drafts each accepted, and the acceptance rate so far."""
    lines = []
    for name, value, doc in (
        ("num_drafts_total", s.num_drafts, "Verify chunks: one sequence's drafts checked in one step."),
        ("num_draft_tokens_total", s.num_draft_tokens, "Drafted tokens."),
        ("num_accepted_tokens_total", s.num_accepted_tokens, "Drafted tokens accepted (equal to the sample)."),
    ):
        lines += [f"# HELP {p}{name} {doc}", f"# TYPE {p}{name} counter", f"{p}{name} {value}"]
    name = "num_accepted_tokens_per_pos_total"
    lines += [f"# HELP {p}{name} Verify chunks whose draft at this position was accepted.", f"# TYPE {p}{name} counter"]
    lines += [f'{p}{name}{{position="{i}"}} {v}' for i, v in enumerate(s.accepted_per_position)]
    name = "chunks_by_accepted_total"
    lines += [f"# HELP {p}{name} Verify chunks by how many drafts they accepted.", f"# TYPE {p}{name} counter"]
    lines += [f'{p}{name}{{accepted="{a}"}} {v}' for a, v in enumerate(s.chunks_by_accepted)]
    name = "acceptance_rate"
    lines += [f"# HELP {p}{name} Accepted over drafted tokens so far.", f"# TYPE {p}{name} gauge"]
    lines += [f"{p}{name} {s.acceptance_rate}"]
    return lines


def per_request_metrics(stats: RequestStateStats | None, num_generation_tokens: int) -> dict:
    """vLLM's per-request timing metrics (``--enable-per-request-metrics``, a reply's ``metrics``), in ms from the
    engine's monotonic timestamps: time to first token from the first scheduling, the decode time (first to last
    token), the queue time (queued to scheduled), the mean inter-token latency over the decode time, and the
    generated tokens per second from the first scheduling to the last token. A figure whose timestamps are missing
    (0.0) is None, as in vLLM."""
    out: dict[str, float | None] = dict.fromkeys(
        ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second")
    )
    if stats is None:
        return out
    queued, scheduled, first, last = stats.queued_ts, stats.scheduled_ts, stats.first_token_ts, stats.last_token_ts
    if scheduled > 0 and first > 0:
        out["time_to_first_token_ms"] = (first - scheduled) * 1000
    if first > 0 and last > 0:
        out["generation_time_ms"] = (last - first) * 1000
        if num_generation_tokens > 1:
            out["mean_itl_ms"] = (last - first) / (num_generation_tokens - 1) * 1000
    if queued > 0 and scheduled > 0:
        out["queue_time_ms"] = (scheduled - queued) * 1000
    if scheduled > 0 and last > scheduled:
        out["tokens_per_second"] = num_generation_tokens / (last - scheduled)
    return out
