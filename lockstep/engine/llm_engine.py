"""The engine loop: requests in, one scheduled step at a time, ``RequestOutput`` out.

``add_request`` validates a request and queues it; ``step`` schedules a batch, runs it through the model, applies
the sampled tokens, detects stop strings (by detokenising) and reports every request that got a token or
finished. The engine never looks at how the batch was formed: the kernels make that irrelevant to the bits.

Under tensor parallelism (``config.tensor_parallel_size > 1``) the engine's process is rank 0: it starts the other
ranks' worker processes (``tp_workers.WorkerPool``) and runs every step with them; ``close()`` stops them. A
worker's death raises ``WorkerError`` naming the rank, and the engine cannot run further steps.

A vision-language model's requests bring their images preprocessed: ``process_images`` (the model folder's image
processor, placeholder expansion, M-RoPE positions; safe to call from other threads) gives the prompt's token ids
and the ``MultimodalInputs`` that ``add_request`` takes as ``mm``.

A fault that belongs to one request (a row the sampler could not sample, its detokenising or stop-string check
raising) finishes that request alone, with finish reason "abort" and ``CompletionOutput.error`` saying why; its
blocks are freed and every other request of the step carries on with the bits it would have had anyway. A fault
of the whole step (the model's forward) raises, for the caller to abort what is in flight.
"""

import dataclasses
import operator
import os
import random
import secrets
import time
from dataclasses import dataclass, field

from lockstep.config import EngineConfig
from lockstep.distributed import TPGroup
from lockstep.engine.detokenizer import IncrementalDetokenizer, decode, find_stop
from lockstep.engine.logprobs import LogprobDicts
from lockstep.engine.model_runner import ModelRunner
from lockstep.engine.multimodal import MultimodalInputs
from lockstep.engine.scheduler import ScheduledBatch, Scheduler
from lockstep.engine.sequence import FinishReason, Sequence
from lockstep.engine.token_feed import TokenFeed
from lockstep.engine.tp_workers import WorkerPool
from lockstep.engine.warmup import compiled_kernels, warm_up
from lockstep.layers.sampler import PendingSample, Sampled
from lockstep.layers.token_bans import bad_words_token_ids, needs_newest_token
from lockstep.multimodal.processor import placeholder_runs
from lockstep.outputs import CompletionOutput, Logprob, OutputKind, PromptLogprobs, RequestOutput, RequestStateStats
from lockstep.sampling_params import SamplingParams
from lockstep.spec.drafter import Drafter, DraftRequest
from lockstep.spec.factory import make_drafter
from lockstep.spec.stats import SpecDecodeStats
from lockstep.structured.grammar import GrammarCompiler, GrammarError
from lockstep.structured.limits import GrammarLimits


@dataclass
class _Request:
    seq: Sequence
    prompt: str | None
    prompt_token_ids: list[int]  # shared by every output of the request: no per-step copy of the prompt
    text: str = ""
    detokenizer: IncrementalDetokenizer | None = None  # made on the first stop-string check
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # vLLM's dicts, built as tokens arrive
    stop_from: int | None = None  # min_tokens: a stop string must end after this many characters of the text
    stop_checked: int = 0  # characters of the (growing) text already searched for stop strings
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's dicts, built once the prompt's are all computed
    kind: OutputKind = OutputKind.CUMULATIVE  # what its outputs hold (add_request)
    num_sent: int = 0  # output tokens already reported, for DELTA
    error: str | None = None  # why the engine aborted it, for a fault of its own
    metrics: RequestStateStats = field(default_factory=RequestStateStats)  # vLLM's RequestOutput.metrics
    num_cached_tokens: int | None = None  # prefix-cache hits at its first admission (vLLM's)
    stop_string: str | None = None  # the stop string that ended it
    num_steps: int = 0  # steps that gave it tokens (speculative decoding's accepted length per request)


@dataclass
class _InFlight:
    """A launched step whose samples the host has not read yet (async scheduling)."""

    batch: ScheduledBatch
    sample: PendingSample


def _may_run_ahead(batch: ScheduledBatch) -> bool:
    """Whether the step after ``batch`` may be launched before ``batch``'s tokens are on the host: not when a
    sequence that samples in it has penalties (they count the newest token) or a grammar (its mask follows the
    newest token), or a bad word of several tokens (whether it bans follows the newest token); nor after a verify
    step (speculative decoding), whose accepted count decides where each of its sequences goes on."""
    if batch.has_drafts:
        return False
    return not any(
        e.sample
        and not e.seq.is_finished
        and (
            e.seq.grammar is not None or e.seq.params.penalized or needs_newest_token(e.seq.params.bad_words_token_ids)
        )
        for e in batch.entries
    )


class LLMEngine:
    """Owns the ``ModelRunner``, the ``Scheduler`` and the tokenizer.

    ``config.model`` is a checkpoint folder or a Hugging Face model id, resolved through the local Hugging Face
    cache (``models.hub``; ``self.config.model`` is then the snapshot folder, whose name is the commit, and
    ``revision`` None); None: the embedded default model.
    ``config.seed`` seeds the draw of per-request seeds for sampled requests that bring none (default: fresh ones
    from the OS). ``default_sampling`` holds the ``SamplingParams`` keywords of ``config.generation_config`` (the
    model's ``generation_config.json`` by default): what the LLM and the server use where a request says nothing.
    """

    def __init__(self, config: EngineConfig) -> None:
        if config.model is None:
            from lockstep.models.embedded import default_model_path

            config = dataclasses.replace(config, model=str(default_model_path()))
        else:
            from lockstep.models.hub import resolve_model

            config = dataclasses.replace(config, model=resolve_model(config.model, config.revision), revision=None)
        self.default_sampling = _generation_defaults(config)  # read first: a bad file fails before the load
        self.tokenizer = None if config.skip_tokenizer_init else _load_tokenizer_or_none(config.model)
        self.workers: WorkerPool | None = None
        if config.tensor_parallel_size > 1:
            self.workers = _start_workers(config)
            if self.workers is None:  # a launched rank other than 0: it served rank 0 until it stopped
                raise SystemExit(0)
            try:
                self.runner = ModelRunner(config, self.workers.tp, self.workers.channel, self.workers.device)
            except (ValueError, FileNotFoundError) as e:  # settings every rank rejects alike: rank 0's own words
                self.workers.stop_now(f"the engine failed to start: {e}")
                raise
            except BaseException as e:
                self.workers.fail(e)
            self.workers.attach(self.runner)
        else:
            self.runner = ModelRunner(config)
        self.config = self.runner.config
        self.logprob_dicts = LogprobDicts(self.tokenizer)
        eos = tuple(self.runner.model.config.eos_token_ids)
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_token_ids = eos
        self.runner.sampler.eos_token_ids = eos  # what min_tokens holds back
        self.scheduler = Scheduler(self.config, eos_token_ids=eos, encoder_cache=self.runner.encoder_cache)
        self._image_processor = None
        seed = config.seed
        self._seed_rng = random.Random(seed) if seed is not None else random.SystemRandom(secrets.randbits(64))
        self._requests: dict[str, _Request] = {}  # lookup only; batch order comes from the scheduler
        self._grammars: GrammarCompiler | None = None
        self.grammar_limits = GrammarLimits()  # set before the first constraint (the server's options)
        self._in_flight: _InFlight | None = None  # async scheduling: the launched step not yet reported
        # Speculative decoding (docs/design.md): the drafter proposes, the verify chunk decides.
        self.drafter: Drafter | None = None
        self.spec_stats = SpecDecodeStats()
        self.scheduled_tokens = 0  # the last step's new tokens, 0 if it scheduled none (vllm:iteration_tokens_total)
        self._observe = None  # a drafter's view of every target step (EAGLE-3: the aux hidden states)
        if self.config.speculative_config is not None:
            self.drafter = make_drafter(self.config.speculative_config, self.config, self.runner)
            self._observe = getattr(self.drafter, "observe", None)
        if self.runner.device.type == "cuda":
            warm_up(self)  # prefill shapes compile now, not while serving (engine/warmup.py)
        self._compiles_at_start = len(compiled_kernels())

    @property
    def triton_compiles_after_start(self) -> int:
        """Triton kernels this process has compiled since the engine started (its warm-up done): each one stalled
        a step. Counts the whole process (rank 0's, under TP); 0 is the goal."""
        return len(self.triton_kernels_compiled_after_start)

    @property
    def triton_kernels_compiled_after_start(self) -> list[str]:
        """Which kernels ``triton_compiles_after_start`` counts (Triton's description of each: name, launch options,
        argument specialisations), in order."""
        return compiled_kernels()[self._compiles_at_start :]

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output constraints (cached; thread-safe: a server compiles a request's constraint
        in its own thread first, so ``add_request`` finds it compiled). GrammarError without a tokenizer."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids, self.grammar_limits)
        return self._grammars

    @property
    def grammar_cache(self) -> tuple[int, int]:
        """The compiled-grammar cache's charged bytes and entries; (0, 0) before the first constraint."""
        g = self._grammars
        return (0, 0) if g is None else (g.cache_bytes, g.cache_entries)

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def is_multimodal(self) -> bool:
        """Whether the model takes images."""
        return self.runner.is_multimodal

    @property
    def media_policy(self):
        """Where request images may come from and how large they may be (``multimodal.media.MediaPolicy``)."""
        from lockstep.multimodal.media import MediaPolicy

        c = self.config
        return MediaPolicy(c.allowed_local_media_path, tuple(c.allowed_media_domains or ()), c.max_image_pixels)

    @property
    def image_processor(self):
        """The model's preprocessing (``multimodal.processor.ImageProcessor``); ValueError for a text-only model."""
        if not self.is_multimodal:
            raise ValueError(f"the model ({self.runner.model.config.architecture}) is text-only: it takes no images")
        if self._image_processor is None:
            from lockstep.multimodal.processor import ImageProcessor

            limit = (self.config.limit_mm_per_prompt or {}).get("image")
            model = self.runner.model
            self._image_processor = ImageProcessor(self.config.model, model, limit, self.config.mm_processor_kwargs)
        return self._image_processor

    def process_images(
        self, prompt_token_ids: list[int], images: list, mm_processor_kwargs: dict | None = None
    ) -> tuple[list[int], MultimodalInputs]:
        """A prompt with one image placeholder per image, made ready for ``add_request(..., mm=...)``: the token ids
        with each placeholder expanded to its image's tokens, and the images' ``MultimodalInputs``. ``images`` are
        decoded PIL images (``multimodal.media.load_image``). Raises ValueError naming the problem."""
        return self.image_processor.process(prompt_token_ids, images, mm_processor_kwargs)

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
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        mm: MultimodalInputs | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (naming the request and the problem) for one that cannot run;
        nothing is queued then. ``mm``: the prompt's images (``process_images``), whose tokens the prompt holds.

        ``output_kind`` (``OutputKind``): the whole output at every step (the default), only what is new since the
        request's previous output in ``token_ids``, ``token_logprobs`` and ``logprobs`` (``DELTA``: a consumer that
        keeps them does not keep a copy of the output per step), or one output when it ends (``FINAL_ONLY``)."""
        params = params if params is not None else SamplingParams()
        if self.is_sleeping:
            raise RuntimeError(f"request {request_id!r}: the engine is sleeping; call wake_up() first")
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
        params = self._resolve_token_controls(request_id, params)
        params = self._resolve_logprobs(request_id, params)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {request_id!r}: stop strings need a tokenizer, and the model has none")
        ids = list(prompt_token_ids)
        if params.truncate_prompt_tokens is not None:  # vLLM's: keep the last k (-1: as many as can generate)
            k = params.truncate_prompt_tokens if params.truncate_prompt_tokens > 0 else self.max_model_len - 1
            ids = ids[-k:]
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
        if mm is not None or self.is_multimodal:
            self._check_images(request_id, ids, mm, params)
        if params.seed is None and not params.greedy:
            # The request's noise comes from its own seed alone (the output reports it).
            params = dataclasses.replace(params, seed=self._seed_rng.getrandbits(63))
        seq = Sequence(request_id, ids, params, block_size=self.config.block_size, mm=mm)
        if params.structured_outputs is not None:
            try:
                seq.grammar = self.grammars.start(params.structured_outputs)
            except GrammarError as e:
                raise GrammarError(f"request {request_id!r}: {e}") from None
        self.scheduler.add(seq)
        metrics = RequestStateStats(arrival_time=time.time(), queued_ts=time.monotonic())
        self._requests[request_id] = _Request(seq, prompt, ids, kind=output_kind, metrics=metrics)

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for per token (``config.max_logprobs``; -1 there: the vocabulary)."""
        return self.vocab_size if self.config.max_logprobs == -1 else self.config.max_logprobs

    def _resolve_logprobs(self, request_id: str, params: SamplingParams) -> SamplingParams:
        """``params`` with a logprobs count of -1 as the vocabulary size; ValueError past ``max_logprobs``."""
        changes = {}
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n == -1:
                n = changes[name] = self.vocab_size
            if n is not None and n > self.max_logprobs:
                raise ValueError(
                    f"request {request_id!r}: requested {name} of {n}, which is greater than max allowed: "
                    f"{self.max_logprobs} (max_logprobs; -1 allows the whole vocabulary)"
                )
        return dataclasses.replace(params, **changes) if changes else params

    def _resolve_token_controls(self, request_id: str, params: SamplingParams) -> SamplingParams:
        """``params`` with ``bad_words`` tokenized (unless given as ``bad_words_token_ids``); ValueError for a token
        id outside the vocabulary, or bad words without a tokenizer."""
        if params.bad_words and params.bad_words_token_ids is None:
            if self.tokenizer is None:
                raise ValueError(f"request {request_id!r}: bad_words need a tokenizer, and the model has none")
            try:
                params = dataclasses.replace(
                    params, bad_words_token_ids=bad_words_token_ids(params.bad_words, self.tokenizer)
                )
            except ValueError as e:
                raise ValueError(f"request {request_id!r}: {e}") from None
        for name, ids in (
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("bad_words", [t for w in params.bad_words_token_ids or () for t in w]),
        ):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"request {request_id!r}: {name} holds token id {bad[0]}, not a token id in [0, {self.vocab_size})"
                    " (out of the vocabulary)"
                )
        return params

    def _check_images(self, request_id: str, ids: list[int], mm: MultimodalInputs | None, params) -> None:
        """ValueError unless the prompt's image tokens are exactly its images' placeholders."""
        if not self.is_multimodal:
            raise ValueError(f"request {request_id!r}: the model is text-only; it takes no images")
        if mm is not None and params.truncate_prompt_tokens is not None:
            raise ValueError(f"request {request_id!r}: truncate_prompt_tokens would cut its images")
        image_token = self.runner.model.mm_config.image_token_id
        expected = [] if mm is None else [(im.offset, im.num_tokens) for im in mm.images]
        if image_token in ids or expected:
            if placeholder_runs(ids, image_token) != expected:
                raise ValueError(
                    f"request {request_id!r}: the prompt's image placeholder tokens ({image_token}) do not match its "
                    f"{len(expected)} image(s): every placeholder needs an image (process_images expands them)"
                )
            if mm is not None and mm.num_prompt_tokens != len(ids):
                raise ValueError(f"request {request_id!r}: its images were processed for another prompt")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its output so far (since its previous one, for DELTA), finished with reason
        "abort". None if it is unknown."""
        if self.scheduler.abort(request_id) is None:
            return None
        return self._forget(self._requests.pop(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def load_weights(self, weights) -> list[str]:
        """Update the model's weights in place (see ``ModelRunner.load_weights``) and forget the prefix cache,
        whose K/V the old weights computed. Only while no request is in flight."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("load_weights: requests are still running; finish or abort them first")
        loaded = self._on_every_rank(self.runner.load_weights, weights)
        self.scheduler.block_manager.reset_prefix_cache()
        return loaded

    # -- RL: weight updates from a trainer, the prefix cache, sleep mode ------------------------------------------

    def _require_idle(self, what: str) -> None:
        if self.scheduler.has_unfinished():
            raise RuntimeError(f"{what}: requests are still running; finish or abort them first")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Join the trainer's weight-update group on every rank (``engine.weight_updates``); blocks until the
        trainer has joined too."""
        self._on_every_rank(self.runner.join_weight_group, init_info)

    def update_weights(self, update_info: dict) -> list[str]:
        """Receive one update over the weight-update group (``engine.weight_updates``) and forget the prefix cache,
        like ``load_weights``. Only while no request is in flight."""
        self._require_idle("update_weights")
        loaded = self._on_every_rank(self.runner.update_weights, update_info)
        self.scheduler.block_manager.reset_prefix_cache()
        return loaded

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing done) while requests hold blocks, as vLLM's."""
        if self.scheduler.has_unfinished():
            return False
        self.scheduler.block_manager.reset_prefix_cache()
        return True

    @property
    def is_sleeping(self) -> bool:
        return self.runner.sleep_state is not None and self.runner.sleep_state.is_sleeping

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and, at level 2, the weights (level 1 offloads them to host memory) on every rank
        (``engine.sleep``). Only while no request is in flight; requests are refused until ``wake_up``."""
        self._require_idle("sleep")
        self.scheduler.block_manager.reset_prefix_cache()  # the cached K/V is discarded with the cache
        self._on_every_rank(self.runner.sleep, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what ``tags`` names (``"weights"``, ``"kv_cache"``; default both). ValueError after a level-2
        sleep whose weights were not all loaded since."""
        self._on_every_rank(self.runner.wake_up, tags)

    # -- one step ----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every request that got a token (a ``FINAL_ONLY`` one: that
        ended), in batch order.

        With ``config.async_scheduling`` a call launches the next batch and then reports the previous one (the
        first call reports nothing), see ``_step_overlapped``."""
        self.scheduled_tokens = 0
        if self.config.async_scheduling:
            return self._step_overlapped()
        batch = self._schedule()
        if not batch:
            return self._idle(batch)
        self._note_scheduled(batch)
        sampled = self._on_every_rank(self.runner.run, batch)
        if self._observe is not None:
            self._observe(batch, self.runner.aux_hidden)
        self.scheduler.advance(batch, pending=False)
        if batch.has_drafts:
            return self._report_verified(batch, sampled)
        return self._report(batch, sampled)

    def _schedule(self) -> ScheduledBatch:
        """The next step, with drafts for its decode rows when speculating (a preempted sequence is prefilled
        again: its drafter state goes)."""
        if self.drafter is None:
            return self.scheduler.schedule()
        batch = self.scheduler.schedule(self._propose())
        for seq in batch.preempted:
            self.drafter.release(seq.arrival)
        return batch

    def _propose(self) -> dict[Sequence, list[int]]:
        """Drafts for the running sequences about to decode: at most ``num_speculative_tokens`` each, and never
        more than the request can still add (max_tokens, max_model_len) less the target's own next token.
        Proposals are cut at the first value that is not a token id (a drafter may be wrong, not harmful).

        A sequence whose newest token is still on the device (async scheduling: the step that samples it is in
        flight) is drafted for one token behind: the drafter continues the tokens before the pending one by one
        more token, its guess of the pending token, which is dropped; the rest are the drafts after it (docs/
        design.md, "Async scheduling while speculating")."""
        k = self.config.speculative_config.num_speculative_tokens
        seqs: list[Sequence] = []
        requests: list[DraftRequest] = []
        for seq in self.scheduler.running:
            if seq.num_pending_tokens != 1 or not seq.may_draft:
                continue
            n = min(k, seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
            if n > 0:
                lag = int(seq.has_pending_token)
                seqs.append(seq)
                requests.append(DraftRequest(seq.arrival, seq.token_ids[: seq.num_tokens - lag], n + lag))
        if not requests:
            return {}
        proposals = self.drafter.propose(requests)
        if len(proposals) != len(requests):
            raise RuntimeError(f"the drafter answered {len(proposals)} proposals for {len(requests)} requests")
        drafts: dict[Sequence, list[int]] = {}
        vocab = self.vocab_size
        for seq, request, proposal in zip(seqs, requests, proposals, strict=True):
            valid: list[int] = []
            for t in list(proposal)[: request.num_tokens]:
                try:
                    t = operator.index(t)  # ints and numpy integers
                except TypeError:
                    break
                if not 0 <= t < vocab:
                    break
                valid.append(t)
            valid = valid[int(seq.has_pending_token) :]  # one behind: the guess of the pending token goes
            if valid:
                drafts[seq] = valid
        return drafts

    def _report_verified(self, batch: ScheduledBatch, sampled: Sampled) -> list[RequestOutput]:
        """``_report`` for a step with verify chunks, every sampling entry token by token: a verify chunk's row
        ``j`` sampled the token after its ``j`` drafts, so its drafts are kept while each equals the token sampled
        at its position, and the first token that differs (or follows the last draft) is the target's own. Each
        kept token then goes through exactly what a decode step does with its token (stop ids, lengths, the
        grammar, stop strings), so a run can end part-way; the rejected drafts' KV slots are given back."""
        outputs: list[RequestOutput] = []
        row = 0
        for entry in batch.entries:
            if not entry.sample:
                continue
            first, row = row, row + entry.num_samples
            seq = entry.seq
            request = self._live(seq)
            if request is None or seq.is_finished:
                continue
            tokens = sampled.token_ids[first:row]
            accepted = 0
            while accepted < len(entry.drafts) and entry.drafts[accepted] == tokens[accepted]:
                accepted += 1
            if entry.drafts:
                self.spec_stats.count_chunk(len(entry.drafts), accepted)
            request.num_steps += 1
            for j in range(accepted + 1):
                why = sampled.errors.get(first + j)
                if why is not None:
                    self._fail(request, why)
                    break
                self.scheduler.accept_token(seq, tokens[j], sampled.logprobs[first + j], j > 0)
                self._after_token(request)
                if seq.is_finished:
                    break
            self.scheduler.trim_drafts(seq)
            if seq.is_finished:
                del self._requests[seq.request_id]
                outputs.append(self._forget(request))
            elif request.kind is not OutputKind.FINAL_ONLY:
                outputs.append(self._output(request))
        return outputs

    def _idle(self, batch: ScheduledBatch) -> list[RequestOutput]:
        if batch.preempted or not self.scheduler.has_unfinished():
            return []
        raise RuntimeError("the scheduler made no progress with requests waiting (cache too small?)")

    def _step_overlapped(self) -> list[RequestOutput]:
        """Async scheduling (docs/design.md, "Async scheduling"): step N is on the device, its tokens unread.
        Its bookkeeping is applied with each sampling sequence's token pending, step N + 1 is scheduled and
        launched with those rows' input ids fed from step N's samples on the device, and only then are step N's
        results read back (the step's one sync) and reported; step N + 1 stays in flight. A drafter that observes
        the target's steps (EAGLE-3) sees step N + 1 right after its launch, on the device.

        When a sequence of step N samples with penalties or a grammar, step N + 1's sampling needs that token on
        the host, and after a verify step (speculative decoding) its accepted count decides step N + 1's
        positions: step N is read back first and step N + 1 follows as a synchronous step would."""
        prev, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if prev is not None and not _may_run_ahead(prev.batch):
            self.scheduler.advance(prev.batch, pending=False)
            outputs, prev = self._resolve(prev), None
        assumed = self.scheduler.advance(prev.batch) if prev is not None else None
        batch = None
        try:
            batch = self._schedule()
            if batch:
                self._note_scheduled(batch)
                feed = TokenFeed(prev.sample.tokens, assumed) if assumed else None
                self._in_flight = _InFlight(batch, self.runner.launch(batch, feed))
                if self._observe is not None:  # enqueued after the launch, before anything reads it back
                    self._observe(batch, self.runner.aux_hidden)
        finally:  # also when the launch failed: the pending tokens must become real ones
            if prev is not None:
                outputs = self._resolve(prev)
        if not batch and not outputs and prev is None:
            return self._idle(batch)
        return outputs

    def _note_scheduled(self, batch: ScheduledBatch) -> None:
        """A request's first step: when it came (metrics) and how much of its prompt the prefix cache held."""
        self.scheduled_tokens = batch.num_tokens
        now = time.monotonic()
        for e in batch.entries:
            request = self._live(e.seq)
            if request is not None and request.num_cached_tokens is None:
                request.num_cached_tokens = e.seq.num_cached_tokens
                request.metrics.scheduled_ts = now

    def _resolve(self, launched: _InFlight) -> list[RequestOutput]:
        """Read a launched step's samples back and report them (its ``Scheduler.advance`` already done)."""
        report = self._report_verified if launched.batch.has_drafts else self._report
        return report(launched.batch, launched.sample.result())

    def _report(self, batch: ScheduledBatch, sampled: Sampled) -> list[RequestOutput]:
        """Apply a step's samples (after ``Scheduler.advance``) and build the outputs. Under async scheduling a
        sequence may have finished or been aborted since its step was launched: its sample is dropped unseen."""
        sampling = [entry for entry in batch.entries if entry.sample]
        for entry in sampling:
            request = self._live(entry.seq)
            if request is not None:
                request.num_steps += 1
        for k, why in sampled.errors.items():
            request = self._live(sampling[k].seq)
            if request is not None:
                self._fail(request, why)  # apply_tokens skips finished sequences
        self.scheduler.apply_tokens(batch, sampled.token_ids, sampled.logprobs)
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for entry in sampling:
            request = self._live(entry.seq)
            if request is None:
                continue
            stats = request.metrics
            stats.first_token_ts = stats.first_token_ts or now
            stats.last_token_ts = now
            self._after_token(request)
            if request.seq.is_finished:
                del self._requests[entry.seq.request_id]
                outputs.append(self._forget(request))
            elif request.kind is not OutputKind.FINAL_ONLY:
                outputs.append(self._output(request))
        return outputs

    def _forget(self, request: _Request) -> RequestOutput:
        """The last output of a request that has ended, whose grammar state goes now: its matcher keeps the
        compiled grammar alive (the grammar cache's byte bound counts only what the cache holds), and finished
        sequences may stay referenced a while (a block-table row keeps its sequence until the row is reused)."""
        output = self._output(request)
        request.seq.grammar = None
        if self.drafter is not None:
            self.drafter.release(request.seq.arrival)
            self.spec_stats.count_finished(request.seq.num_output_tokens, request.num_steps)
        return output

    def _live(self, seq: Sequence) -> _Request | None:
        """The request ``seq`` belongs to, unless it has already reported its end (its id may be reused)."""
        request = self._requests.get(seq.request_id)
        return request if request is not None and request.seq is seq else None

    def _on_every_rank(self, fn, arg):
        """``fn(arg)`` on rank 0, which the workers follow; under TP a failure there (a worker's death, an
        interrupt) stops the workers and raises (``WorkerPool.fail``)."""
        if self.workers is None:
            return fn(arg)
        self.workers.check()
        try:
            return fn(arg)
        except BaseException as e:
            self.workers.fail(e)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot run steps afterwards). Idempotent."""
        if self.workers is not None:
            self.workers.close()

    def _after_token(self, request: _Request) -> None:
        """What every token a sequence takes goes through: its grammar advances, its text and stop checks update;
        a failure of either fails the request alone."""
        if request.seq.grammar is not None and request.error is None:
            self._advance_grammar(request)
        if request.error is None:
            try:
                self._update_text(request)
            except Exception as e:  # the request's own tokens broke detokenising or the stop check
                self._fail(request, f"detokenizing failed: {type(e).__name__}: {e}")

    def _advance_grammar(self, request: _Request) -> None:
        """Feed a structured request's new token to its grammar. A grammar that allows nothing more but EOS ends a
        request that may not sample EOS now (``ignore_eos``, or short of ``min_tokens``) with "stop"."""
        seq = request.seq
        if seq.is_finished:
            return
        try:
            seq.grammar.advance(seq.output_token_ids)
        except GrammarError as e:
            self._fail(request, str(e))
            return
        if seq.grammar.finished and (seq.params.ignore_eos or seq.num_output_tokens < seq.params.min_tokens):
            self.scheduler.finish(seq.request_id, FinishReason.STOP)

    def _fail(self, request: _Request, why: str) -> None:
        """Abort one request for a fault of its own; the output reports ``why``."""
        request.error = why
        seq = request.seq
        if seq.is_finished:  # finished this step, its blocks already freed: only the reason changes
            seq.finish_reason = FinishReason.ABORT
        else:
            self.scheduler.abort(seq.request_id)

    def _update_text(self, request: _Request) -> None:
        seq, params = request.seq, request.seq.params
        # Detokenise only where the text is needed: stop-string checks, and the final output.
        if self.tokenizer is None or not (params.stop or seq.is_finished):
            return
        options = (params.skip_special_tokens, params.spaces_between_special_tokens)
        if seq.is_finished:
            text = decode(self.tokenizer, seq.output_token_ids, *options)  # the exact text, once
        else:
            # Each step's stop check decodes only the newest tokens (with a little context), not the whole output.
            if request.detokenizer is None:
                request.detokenizer = IncrementalDetokenizer(self.tokenizer, *options)
            request.detokenizer.update(seq.output_token_ids)
            text = request.detokenizer.text
        stops = params.stop
        if stops and seq.finish_reason is not FinishReason.ABORT and seq.num_output_tokens > params.min_tokens:
            if request.stop_from is None:  # the text of the first min_tokens tokens cannot hold a stop
                request.stop_from = len(decode(self.tokenizer, seq.output_token_ids[: params.min_tokens], *options))
            # The earliest stop string ends the text (and the request), like vLLM; kept if the request says so.
            # The text only grows until the request finishes, and no stop ends in what was searched before: each
            # step searches the new characters (with the overlap a stop string needs), not the whole text.
            start = request.stop_from if seq.is_finished else max(request.stop_from, request.stop_checked)
            request.stop_checked = len(text)
            hit = find_stop(text, stops, start)
            if hit is not None:
                request.stop_string = hit[1]
                text = text[: hit[0] + (len(hit[1]) if params.include_stop_str_in_output else 0)]
                if not seq.is_finished:
                    self.scheduler.finish(seq.request_id, FinishReason.STOP)
                else:
                    seq.finish_reason = FinishReason.STOP
        request.text = text

    def _output(self, request: _Request) -> RequestOutput:
        seq = request.seq
        delta = request.kind is OutputKind.DELTA
        start = request.num_sent if delta else 0
        if delta:
            request.num_sent = seq.num_output_tokens
        logprobs = None
        if seq.params.logprobs is not None:
            self.logprob_dicts.extend(request.logprobs, seq.output_token_ids, seq.output_top_logprobs)
            logprobs = request.logprobs[start:]
        completion = CompletionOutput(
            index=0,
            text=request.text,
            token_ids=seq.token_ids[seq.num_prompt_tokens + start :],
            token_logprobs=seq.output_logprobs[start:],
            logprobs=logprobs,
            finish_reason=seq.finish_reason.value if seq.finish_reason is not None else None,
            seed=seq.params.seed,
            error=request.error,
            stop_reason=self._stop_reason(request),
        )
        prompt_logprobs = self._prompt_logprobs(request) if seq.params.prompt_logprobs is not None else None
        stats = dataclasses.replace(
            request.metrics,
            num_generation_tokens=seq.num_output_tokens,
            first_token_latency=request.metrics.first_token_ts - request.metrics.queued_ts
            if request.metrics.first_token_ts
            else 0.0,
            is_corrupted=request.error is not None,
        )
        return RequestOutput(
            seq.request_id,
            request.prompt,
            request.prompt_token_ids,
            [completion],
            prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens,
            metrics=stats,
        )

    def _stop_reason(self, request: _Request) -> int | str | None:
        """vLLM's ``stop_reason``: the stop string, or the stop token id (not EOS), that ended the request."""
        seq = request.seq
        if seq.finish_reason is not FinishReason.STOP:
            return None
        if request.stop_string is not None:
            return request.stop_string
        last = seq.token_ids[-1]
        if last in seq.params.stop_token_ids and (seq.params.ignore_eos or last not in self.eos_token_ids):
            return last
        return None

    def _prompt_logprobs(self, request: _Request) -> PromptLogprobs:
        """vLLM's prompt logprobs: None for the first token, then a dict per prompt token (built once; fewer only
        for a request aborted before its prefill ended)."""
        if request.prompt_logprobs is not None:
            return request.prompt_logprobs
        computed = request.seq.computed_prompt_logprobs
        tokens = request.prompt_token_ids[1 : len(computed) + 1]
        dicts = [None] + [self.logprob_dicts.entry(t, lp) for t, lp in zip(tokens, computed, strict=True)]
        if len(computed) == len(request.prompt_token_ids) - 1:
            request.prompt_logprobs = dicts
        return dicts


def _start_workers(config: EngineConfig) -> WorkerPool | None:
    """Rank 0's pool of workers: spawned here, or, in processes a launcher started (torchrun's ``RANK`` and
    ``WORLD_SIZE`` in the environment), joined through ``env://``; None on a launched rank other than 0."""
    from lockstep.models.loader import model_class, read_config

    size = config.tensor_parallel_size
    # Shapes the TP size cannot split fail here, before any process starts (a model on the meta device).
    model_config = read_config(config.model)
    model_class(model_config.architecture)(
        model_config, kernels=config.kernels, device="meta", tp=TPGroup(0, size), tp_invariant=config.tp_invariant,
    )  # fmt: skip
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(
                f"launched with WORLD_SIZE={world} but tensor_parallel_size={size}: the engine's tensor "
                "parallelism takes every launched process"
            )
        return WorkerPool.join_launched(config, int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)))
    return WorkerPool.spawn(config)


def _generation_defaults(config: EngineConfig) -> dict:
    """``SamplingParams`` keywords for what a request leaves out, from ``config.generation_config``."""
    from lockstep.models.loader import read_generation_defaults

    if config.generation_config == "vllm":
        return {}
    if config.generation_config == "auto":
        return read_generation_defaults(config.model)
    return read_generation_defaults(config.generation_config, required=True)


def _load_tokenizer_or_none(folder: str):
    from lockstep.models.loader import load_tokenizer

    try:
        return load_tokenizer(folder)
    except FileNotFoundError:
        return None
