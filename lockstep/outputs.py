"""What a request gives back, shaped like vLLM's ``vllm.outputs``: a ``RequestOutput`` per prompt holding one
``CompletionOutput`` per generated sequence."""

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence: choice ``index`` of a request's ``SamplingParams.n`` (vLLM's ``CompletionOutput``).

    ``logprobs[i]`` is the logprob of ``token_ids[i]`` under the model's raw distribution (log_softmax of the
    logits, before penalties, temperature and filtering, like vLLM's default). ``top_logprobs`` is None unless the
    request asked for ``SamplingParams.logprobs``; then ``top_logprobs[i]`` maps the top-N token ids at step ``i``
    to their logprobs. ``seed`` is the seed the noise came from (drawn by the engine when the request gave none;
    None for greedy requests without one). ``text`` excludes special tokens and is cut before a stop string; it is
    complete once the sequence has finished (unfinished outputs of requests without stop strings leave it empty).
    ``error`` says why the engine aborted the sequence (``finish_reason`` "abort") for a fault of its own, such as
    a row it could not sample; it is None otherwise, a client's abort included.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    seed: int | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float:
        """The sum of ``logprobs``, in order (vLLM's field)."""
        return sum(self.logprobs)


@dataclass
class RequestOutput:
    """One request's result so far (``finished``) or in full: its prompt and ``outputs``, one per choice, as in
    vLLM. ``text``, ``token_ids``, ``logprobs``, ``top_logprobs``, ``finish_reason`` and ``seed`` are those of
    ``outputs[0]``: the whole answer when ``n == 1``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[float]:
        return self.outputs[0].logprobs

    @property
    def top_logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].top_logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def seed(self) -> int | None:
        return self.outputs[0].seed
