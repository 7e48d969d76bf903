"""What a request gives back, shaped like vLLM's ``vllm.outputs``: a ``RequestOutput`` per prompt holding one
``CompletionOutput`` per generated sequence, with logprobs as vLLM's ``Logprob`` dicts."""

from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True)
class Logprob:
    """One token's logprob at one position (vLLM's ``Logprob``). ``rank`` is its place, from 1, in the position's
    distribution sorted by descending logprob, ties to the lower token id (the order the top N are listed in);
    ``decoded_token`` is ``tokenizer.decode([token_id])``, None without a tokenizer."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's aliases: one dict per generated token; for a prompt, None for its first token (nothing predicts it).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence: choice ``index`` of a request's ``SamplingParams.n`` (vLLM's ``CompletionOutput``).

    ``token_logprobs[i]`` is the logprob of ``token_ids[i]`` as a plain float, always filled: what RL code
    compares with its trainer (``lockstep.rl.token_logprobs``). ``logprobs`` is vLLM's: None unless the request
    asked for ``SamplingParams.logprobs = N``; then ``logprobs[i]`` maps the sampled token and the top N at step
    ``i`` to their ``Logprob`` (N or N + 1 entries, the sampled token first), read as
    ``logprobs[i][token_id].logprob``. Both are of the model's raw distribution (log_softmax of the logits, before
    penalties, temperature and filtering, like vLLM's default), and ``token_logprobs[i]`` has the bits of
    ``logprobs[i][token_ids[i]].logprob``. ``seed`` is the seed the noise came from (drawn by the engine when the
    request gave none; None for greedy requests without one). ``text`` is cut at a stop string (kept with
    ``include_stop_str_in_output``) and decoded as ``skip_special_tokens`` says; it is complete once the sequence
    has finished (unfinished outputs of requests without stop strings leave it empty).
    ``error`` says why the engine aborted the sequence (``finish_reason`` "abort") for a fault of its own, such as
    a row it could not sample; it is None otherwise, a client's abort included. ``stop_reason`` is vLLM's: the stop
    string or the ``stop_token_ids`` id that ended it (None for EOS, a length limit, or while it runs).
    ``cumulative_logprob`` (vLLM's field, a keyword here) is the sum of ``token_logprobs`` in order when not given.
    """

    index: int
    text: str
    token_ids: list[int]
    token_logprobs: list[float] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    seed: int | None = None
    error: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    def __post_init__(self) -> None:
        if self.cumulative_logprob is None:
            self.cumulative_logprob = sum(self.token_logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestStateStats:
    """When a request reached each stage (vLLM's ``RequestStateStats``, ``RequestOutput.metrics``): ``arrival_time``
    is wall-clock (``time.time()`` when ``add_request`` took it); ``queued_ts``, ``scheduled_ts`` (its first step),
    ``first_token_ts`` and ``last_token_ts`` are ``time.monotonic()`` (0.0 until they happen);
    ``first_token_latency`` is ``first_token_ts - queued_ts``. ``num_generation_tokens`` counts its output tokens.
    ``is_corrupted``: the engine aborted it for a fault of its own (``CompletionOutput.error``; vLLM: NaN logits).
    Timings are observations of the run; they are no part of the output the contract covers."""

    num_generation_tokens: int = 0
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0
    is_corrupted: bool = False


@dataclass
class RequestOutput:
    """One request's result so far (``finished``) or in full: its prompt and ``outputs``, one per choice, as in
    vLLM. ``prompt_logprobs`` is None unless the request asked for ``SamplingParams.prompt_logprobs = N``; then
    entry ``i`` maps prompt token ``i`` and the top N at its position to their ``Logprob`` (entry 0 is None), the
    values a decode step would report for the same tokens. ``text``, ``token_ids``, ``token_logprobs``,
    ``logprobs``, ``finish_reason`` and ``seed`` are those of ``outputs[0]``: the whole answer when ``n == 1``.
    ``num_cached_tokens`` (vLLM's) is how many prompt tokens the prefix cache held when the request was first
    scheduled (None before), ``metrics`` its ``RequestStateStats`` (of choice 0, for ``n > 1``). ``finished``
    (vLLM's field, a keyword here) is whether every output has finished when not given."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int | None = None
    metrics: RequestStateStats | None = None
    finished: bool | None = None

    def __post_init__(self) -> None:
        if self.finished is None:
            self.finished = all(o.finished for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def token_logprobs(self) -> list[float]:
        return self.outputs[0].token_logprobs

    @property
    def logprobs(self) -> SampleLogprobs | None:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def seed(self) -> int | None:
        return self.outputs[0].seed


class OutputKind(Enum):
    """What a request's outputs hold, step by step (vLLM's ``RequestOutputKind``): ``CUMULATIVE``, the whole output
    so far at every step; ``DELTA``, only the tokens since the previous output (``text`` stays whole);
    ``FINAL_ONLY``, one output, when the request ends. A cumulative output copies the request's tokens every step,
    which over long outputs costs O(length) a step per request: ``LLM.generate`` asks for ``FINAL_ONLY``."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"
