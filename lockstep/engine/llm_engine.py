"""The engine loop: requests in, one scheduled step at a time, ``RequestOutput`` out.

``add_request`` validates a request and queues it; ``step`` schedules a batch, runs it through the model, applies
the sampled tokens, detects stop strings (by detokenising) and reports every request that got a token or
finished. The engine never looks at how the batch was formed: the kernels make that irrelevant to the bits.

A fault that belongs to one request (a row the sampler could not sample, its detokenising or stop-string check
raising) finishes that request alone, with finish reason "abort" and ``CompletionOutput.error`` saying why; its
blocks are freed and every other request of the step carries on with the bits it would have had anyway. A fault
of the whole step (the model's forward) raises, for the caller to abort what is in flight.
"""

import dataclasses
import random
import secrets
from dataclasses import dataclass

from lockstep.config import EngineConfig
from lockstep.engine.detokenizer import IncrementalDetokenizer
from lockstep.engine.model_runner import ModelRunner
from lockstep.engine.scheduler import Scheduler
from lockstep.engine.sequence import FinishReason, Sequence
from lockstep.outputs import CompletionOutput, RequestOutput
from lockstep.sampling_params import SamplingParams


@dataclass
class _Request:
    seq: Sequence
    prompt: str | None
    prompt_token_ids: list[int]  # shared by every output of the request: no per-step copy of the prompt
    text: str = ""
    detokenizer: IncrementalDetokenizer | None = None  # made on the first stop-string check
    deltas: bool = False  # outputs hold only the tokens since the previous one (add_request)
    num_sent: int = 0  # output tokens already reported, when deltas
    error: str | None = None  # why the engine aborted it, for a fault of its own


class LLMEngine:
    """Owns the ``ModelRunner``, the ``Scheduler`` and the tokenizer.

    ``config.model`` is a checkpoint folder (None: the embedded default model). ``config.seed`` seeds the draw of
    per-request seeds for sampled requests that bring none (default: fresh ones from the OS).
    """

    def __init__(self, config: EngineConfig) -> None:
        if config.model is None:
            from lockstep.models.embedded import default_model_path

            config = dataclasses.replace(config, model=str(default_model_path()))
        self.runner = ModelRunner(config)
        self.config = self.runner.config
        self.tokenizer = _load_tokenizer_or_none(config.model)
        eos = tuple(self.runner.model.config.eos_token_ids)
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_token_ids = eos
        self.scheduler = Scheduler(self.config, eos_token_ids=eos)
        seed = config.seed
        self._seed_rng = random.Random(seed) if seed is not None else random.SystemRandom(secrets.randbits(64))
        self._requests: dict[str, _Request] = {}  # lookup only; batch order comes from the scheduler

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # -- requests ----------------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        prompt: str | None = None,
        deltas: bool = False,
    ) -> None:
        """Queue a request. Raises ValueError (naming the request and the problem) for one that cannot run;
        nothing is queued then.

        ``deltas=True``: each of the request's outputs holds in ``token_ids``, ``logprobs`` and ``top_logprobs``
        only what is new since its previous output (``text`` stays whole), so a consumer that keeps them does not
        keep a copy of the output per step; the default gives the whole output each time."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {request_id!r}: sampling params must be a SamplingParams, got {params!r}")
        if params.n != 1:
            raise ValueError(
                f"request {request_id!r}: the engine runs one sequence per request; LLM.generate expands n={params.n}"
                " into requests of their own (SamplingParams.for_choice)"
            )
        if params.max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {params.max_tokens}")
        bad_bias = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bad_bias:
            raise ValueError(
                f"request {request_id!r}: logit_bias token {bad_bias[0]} is not a token id in [0, {self.vocab_size})"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need a tokenizer, and the model has none")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"request {request_id!r}: prompt token {t!r} at index {i} is not a token id in "
                    f"[0, {self.vocab_size}) (the model's vocabulary size)"
                )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(ids)} tokens but the context length "
                f"(max_model_len) is {self.max_model_len}; at most {self.max_model_len - 1} leave room to generate"
            )
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.seed is None and not params.greedy:
            # The request's noise comes from its own seed alone (the output reports it).
            params = dataclasses.replace(params, seed=self._seed_rng.getrandbits(63))
        seq = Sequence(request_id, ids, params, block_size=self.config.block_size)
        self.scheduler.add(seq)
        self._requests[request_id] = _Request(seq, prompt, ids, deltas=deltas)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its output so far (since its previous one, for deltas), finished with reason
        "abort". None if it is unknown."""
        if self.scheduler.abort(request_id) is None:
            return None
        return self._output(self._requests.pop(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def load_weights(self, weights) -> list[str]:
        """Update the model's weights in place (see ``ModelRunner.load_weights``) and forget the prefix cache,
        whose K/V the old weights computed. Only while no request is in flight."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("load_weights: requests are still running; finish or abort them first")
        loaded = self.runner.load_weights(weights)
        self.scheduler.block_manager.reset_prefix_cache()
        return loaded

    # -- one step ----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every request that got a token, in batch order."""
        batch = self.scheduler.schedule()
        if not batch:
            if batch.preempted or not self.scheduler.has_unfinished():
                return []
            raise RuntimeError("the scheduler made no progress with requests waiting (cache too small?)")
        sampled = self.runner.run(batch)
        sampling = [entry for entry in batch.entries if entry.sample]
        for k, why in sampled.errors.items():
            self._fail(self._requests[sampling[k].seq.request_id], why)  # postprocess skips finished sequences
        self.scheduler.postprocess(batch, sampled.token_ids, sampled.logprobs)
        outputs: list[RequestOutput] = []
        for entry in sampling:
            request = self._requests[entry.seq.request_id]
            if request.error is None:
                try:
                    self._update_text(request)
                except Exception as e:  # the request's own tokens broke detokenising or the stop check
                    self._fail(request, f"detokenizing failed: {type(e).__name__}: {e}")
            outputs.append(self._output(request))
            if request.seq.is_finished:
                del self._requests[entry.seq.request_id]
        return outputs

    def _fail(self, request: _Request, why: str) -> None:
        """Abort one request for a fault of its own; the output reports ``why``."""
        request.error = why
        seq = request.seq
        if seq.is_finished:  # finished this step, its blocks already freed: only the reason changes
            seq.finish_reason = FinishReason.ABORT
        else:
            self.scheduler.abort(seq.request_id)

    def _update_text(self, request: _Request) -> None:
        seq = request.seq
        # Detokenise only where the text is needed: stop-string checks, and the final output.
        if self.tokenizer is None or not (seq.params.stop or seq.is_finished):
            return
        if seq.is_finished:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)  # the exact text, once
        else:
            # Each step's stop check decodes only the newest tokens (with a little context), not the whole output.
            if request.detokenizer is None:
                request.detokenizer = IncrementalDetokenizer(self.tokenizer)
            request.detokenizer.update(seq.output_token_ids)
            text = request.detokenizer.text
        stops = seq.params.stop
        if stops and seq.finish_reason is not FinishReason.ABORT:
            # The earliest stop string ends the text (and the request), like vLLM; it is not included.
            hits = [i for i in (text.find(s) for s in stops) if i >= 0]
            if hits:
                text = text[: min(hits)]
                if not seq.is_finished:
                    self.scheduler.finish(seq.request_id, FinishReason.STOP)
                else:
                    seq.finish_reason = FinishReason.STOP
        request.text = text

    def _output(self, request: _Request) -> RequestOutput:
        seq = request.seq
        start = request.num_sent if request.deltas else 0
        if request.deltas:
            request.num_sent = seq.num_output_tokens
        want_top = seq.params.logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=request.text,
            token_ids=seq.token_ids[seq.num_prompt_tokens + start :],
            logprobs=seq.output_logprobs[start:],
            top_logprobs=seq.output_top_logprobs[start:] if want_top else None,
            finish_reason=seq.finish_reason.value if seq.finish_reason is not None else None,
            seed=seq.params.seed,
            error=request.error,
        )
        return RequestOutput(seq.request_id, request.prompt, request.prompt_token_ids, [completion])


def _load_tokenizer_or_none(folder: str):
    from lockstep.models.loader import load_tokenizer

    try:
        return load_tokenizer(folder)
    except FileNotFoundError:
        return None
