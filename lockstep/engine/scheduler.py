"""Continuous batching: which tokens of which sequences each step computes.

One step, under ``max_num_batched_tokens`` and ``max_num_seqs``:

1. Every running sequence that is about to decode gets a KV slot for its next token. When none is free, the
   most recently arrived running sequence is preempted by recompute: its blocks are freed, its computed state
   dropped (its output tokens are kept) and it goes back to the front of the waiting queue, to be prefilled
   again over prompt + outputs on readmission.
2. The batch: running decodes (one token each), then running sequences part-way through a chunked prefill,
   then waiting sequences admitted first-in first-out while blocks, sequence slots and token budget allow. A
   prompt longer than the budget left is chunked; the rest follows in later steps. Speculative decoding: a
   decode row may carry drafted tokens (``schedule(drafts)``), out of the budget the decode rows leave and the
   free blocks, never preempting anything for them.

A vision-language request's prefill chunk that reaches image tokens encodes those images first, in the same step
(``ScheduledSeq.encode``), within the step's encoder budget (``max_num_encoder_tokens_per_step`` image tokens): a
chunk that reaches an image the budget cannot take ends before it, and the image waits for a later step (one larger
than the whole budget is encoded alone in a step of its own). Encoded features wait in the ``EncoderCache`` until
the image's tokens are all computed.

Everything is kept in lists and deques, and every choice is a function of the calls made so far, so the same
calls give the same batches. The batch layout never decides the result's bits; the kernels see to that.
"""

import bisect
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from lockstep.config import EngineConfig
from lockstep.engine.block_manager import BlockManager
from lockstep.engine.encoder_cache import EncoderCache
from lockstep.engine.sequence import PENDING_TOKEN, FinishReason, Sequence, SequenceStatus, TokenLogprobs


@dataclass(frozen=True)
class ScheduledSeq:
    """Compute tokens ``[start, start + num_new_tokens)`` of ``seq`` this step.

    ``sample`` is True when the chunk reaches the end of the sequence's tokens, so its last position's logits
    give the next token; a chunk that ends mid-prompt samples nothing. ``encode``: the indices of the images of
    ``seq.mm`` that the step encodes (into the ``EncoderCache``) before its forward. Valid until
    ``Scheduler.postprocess``.

    ``drafts`` (speculative decoding): a decoding sequence's drafted tokens, computed after its last token as one
    chunk of ``1 + len(drafts)`` tokens (``num_new_tokens`` counts them); every position of the chunk samples, and
    ``LLMEngine`` keeps the drafts that equal what was sampled (docs/design.md, "Speculative decoding").
    """

    seq: Sequence
    num_new_tokens: int
    start: int
    sample: bool
    encode: tuple[int, ...] = ()
    drafts: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def num_fed(self) -> int:
        """The chunk's tokens that are the sequence's own (not drafts)."""
        return self.num_new_tokens - len(self.drafts)

    @property
    def num_samples(self) -> int:
        """Tokens sampled from this entry's logits: one per position of a verify chunk, else one or none."""
        return (1 + len(self.drafts)) if self.sample else 0

    @property
    def token_ids(self) -> list[int]:
        ids = self.seq.token_ids[self.start : self.start + self.num_fed]
        return ids + list(self.drafts) if self.drafts else ids


@dataclass
class ScheduledBatch:
    """One step's work, in order. ``preempted`` lists the sequences this step sent back to waiting.
    ``prompt_logprobs`` is filled by the model runner: for each sequence that asked for prompt logprobs and got
    some computed this step, the new ones in order (``postprocess`` appends them)."""

    entries: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[tuple[Sequence, list[TokenLogprobs]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries)

    @property
    def num_samples(self) -> int:
        return sum(e.num_samples for e in self.entries)

    @property
    def has_drafts(self) -> bool:
        return any(e.drafts for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


class Scheduler:
    """Owns the waiting queue, the running set and the BlockManager.

    The engine loop: ``add`` requests, then repeat ``batch = schedule()``, run the model on it, and
    ``postprocess(batch, sampled_token_ids)``. ``abort`` or ``finish`` between steps. Not thread-safe. Async
    scheduling splits ``postprocess``: ``advance(batch)`` (tokens pending), the next ``schedule()``, then
    ``apply_tokens(batch, ...)`` once the tokens are read back.
    """

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        encoder_cache: EncoderCache | None = None,
    ) -> None:
        if config.num_kv_blocks is None or config.max_num_batched_tokens is None:
            raise ValueError("Scheduler needs config.num_kv_blocks and max_num_batched_tokens; resolve them first")
        self.config = config
        # The runner's cache (it holds the features); the scheduler decides what goes in and frees it.
        self.encoder_cache = encoder_cache if encoder_cache is not None else EncoderCache()
        self.encoder_budget = config.max_num_encoder_tokens_per_step or config.max_num_batched_tokens
        self._encoder_left = self.encoder_budget  # this step's
        self.eos_token_ids = tuple(eos_token_ids)
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival: decode order, and preemption takes the tail
        self._requests: dict[str, Sequence] = {}  # lookup only, never iterated
        self._next_arrival = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    # -- requests ----------------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request. Raises ValueError for one that could never run to completion."""
        rid = seq.request_id
        if seq.status is not SequenceStatus.WAITING or seq.arrival >= 0 or seq.num_output_tokens:
            raise ValueError(f"request {rid!r} was already scheduled once; build a new Sequence")
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in the scheduler")
        if seq.block_size != self.config.block_size:
            raise ValueError(f"request {rid!r}: block_size {seq.block_size} != config {self.config.block_size}")
        if seq.num_prompt_tokens == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        max_len = self.config.max_model_len
        if max_len is not None and seq.num_prompt_tokens >= max_len:
            raise ValueError(
                f"request {rid!r}: prompt of {seq.num_prompt_tokens} tokens leaves no room to generate "
                f"within max_model_len={max_len}"
            )
        # The longest context this request can reach; its last token is never fed back, so needs no KV.
        final_len = seq.num_prompt_tokens + seq.params.max_tokens
        if max_len is not None:
            final_len = min(final_len, max_len)
        bm = self.block_manager
        if bm.blocks_needed(final_len - 1) > bm.num_blocks:
            raise ValueError(
                f"request {rid!r}: {seq.num_prompt_tokens} prompt tokens + max_tokens={seq.params.max_tokens} "
                f"needs {bm.blocks_needed(final_len - 1)} KV blocks of {bm.block_size}, the cache has "
                f"{bm.num_blocks}"
            )
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        self._requests[rid] = seq
        self.waiting.append(seq)

    def finish(self, request_id: str, reason: FinishReason) -> Sequence | None:
        """Finish a request now (abort, or a stop string the engine found); frees its blocks. None if unknown."""
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self._release(seq, reason)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        return self.finish(request_id, FinishReason.ABORT)

    def _release(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.has_pending_token:  # async scheduling: ended before its pending token was read; it never comes
            seq.token_ids.pop()
        self.block_manager.free(seq)
        if seq.mm is not None:
            self.encoder_cache.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._requests[seq.request_id]

    # -- one step ----------------------------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if seq.mm is not None:
            self.encoder_cache.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self, drafts: Mapping[Sequence, list[int]] | None = None) -> ScheduledBatch:
        """Pick this step's work. Call ``postprocess`` with its results before the next ``schedule``.

        ``drafts`` (speculative decoding): drafted tokens of running sequences about to decode. A sequence's drafts
        join its decode row as far as the token budget left after every decode row and the free KV blocks allow
        (drafts never preempt anything); the rest are dropped."""
        batch = ScheduledBatch()
        bm = self.block_manager

        # 1. KV slots for the running decodes, oldest first; preempt from the newest end when out of blocks.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.num_pending_tokens == 1:
                while not bm.can_append(seq) and self.running[-1] is not seq:
                    victim = self.running.pop()
                    self._preempt(victim)
                    batch.preempted.append(victim)
                if not bm.can_append(seq):
                    # seq is the newest running sequence and nothing else can give way.
                    self.running.pop()
                    self._preempt(seq)
                    batch.preempted.append(seq)
                    break
                bm.append_slot(seq)
            i += 1

        # 2. The batch: decodes, then running prefill chunks, then admissions.
        budget = self.config.max_num_batched_tokens
        self._encoder_left = self.encoder_budget
        # Draft tokens come out of what the decode rows leave of the budget.
        spare = budget - sum(1 for s in self.running if s.num_pending_tokens == 1) if drafts else 0
        for seq in self.running:
            if seq.num_pending_tokens == 1 and budget > 0:
                if not seq.may_draft:  # the one token left may be an image's (a prompt that ends in one)
                    budget -= self._schedule_chunk(batch, seq, 1)
                    continue
                drafted = self._fit_drafts(seq, drafts.get(seq, ()), spare) if spare > 0 else ()
                spare -= len(drafted)
                batch.entries.append(ScheduledSeq(seq, 1 + len(drafted), seq.num_computed_tokens, True, (), drafted))
                budget -= 1 + len(drafted)
        for seq in self.running:
            if seq.num_pending_tokens > 1 and budget > 0:
                budget -= self._schedule_chunk(batch, seq, budget)

        # No admissions in a step that preempted: the freed blocks would only go round again.
        if not batch.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                if not bm.can_allocate(seq):
                    break  # strict FIFO: nobody overtakes the head of the queue
                self.waiting.popleft()
                bm.allocate(seq)
                seq.status = SequenceStatus.RUNNING
                bisect.insort(self.running, seq, key=lambda s: s.arrival)
                budget -= self._schedule_chunk(batch, seq, budget)
        return batch

    def _fit_drafts(self, seq: Sequence, drafts, spare: int) -> tuple[int, ...]:
        """The leading drafts of ``seq`` that ``spare`` budget tokens and the free blocks can take; blocks for them
        are added to its table (``trim_drafts`` gives back the ones rejected drafts leave unused)."""
        if not drafts:
            return ()
        n = min(len(drafts), spare)
        n = self.block_manager.reserve(seq, seq.num_tokens + n) - seq.num_tokens
        return tuple(drafts[: max(n, 0)])

    def _schedule_chunk(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        n = min(seq.num_pending_tokens, budget)
        encode: tuple[int, ...] = ()
        if seq.mm is not None:
            n, encode = self._fit_images(seq, n)
            if n == 0:
                return 0
        batch.entries.append(ScheduledSeq(seq, n, seq.num_computed_tokens, n == seq.num_pending_tokens, encode))
        return n

    def _fit_images(self, seq: Sequence, n: int) -> tuple[int, tuple[int, ...]]:
        """The next ``n`` tokens of ``seq`` cut short before the first image among them that is neither encoded
        nor within what is left of the step's encoder budget, and the images the chunk must encode. An image
        larger than the whole budget goes when nothing else was encoded this step, so it never waits forever. An
        image whose pixels another running request holds, or is encoding in this step, costs nothing: its
        features are shared (engine/encoder_cache.py)."""
        start = seq.num_computed_tokens
        encode = []
        cache = self.encoder_cache
        for k, image in seq.mm.overlapping(start, start + n):
            if cache.holds_content(seq.request_id, k, image):
                cache.claim(seq.request_id, k, image)  # no work: held, or encoded earlier in this step
                continue
            if image.num_tokens > self._encoder_left and self._encoder_left < self.encoder_budget:
                return max(0, image.offset - start), tuple(encode)
            self._encoder_left = max(0, self._encoder_left - image.num_tokens)
            cache.claim(seq.request_id, k, image)
            encode.append(k)
        return n, tuple(encode)

    def postprocess(
        self,
        batch: ScheduledBatch,
        token_ids: list[int],
        logprobs: list[TokenLogprobs] | None = None,
    ) -> list[Sequence]:
        """Apply a step's results and return the sequences it finished, in batch order: ``advance`` then
        ``apply_tokens``.

        ``token_ids`` (and ``logprobs`` when given) hold one entry per ``sample`` entry of the batch, in batch
        order. Sequences aborted since ``schedule`` are skipped. Stop strings are the engine's to detect (it
        detokenizes); it then calls ``finish(request_id, FinishReason.STOP)``.
        """
        _check_samples(batch, token_ids, logprobs)
        self.advance(batch, pending=False)
        return self.apply_tokens(batch, token_ids, logprobs)

    def advance(self, batch: ScheduledBatch, pending: bool = True) -> dict[Sequence, int]:
        """The part of a step's results known before its tokens are: every entry's KV is computed, and its
        prompt logprobs are in (``ScheduledBatch.prompt_logprobs``, filled when the step is launched). With
        ``pending`` (async scheduling) each sampling sequence also gets ``PENDING_TOKEN`` in the place of its
        token, so the next ``schedule`` gives it its decode step, unless the token ends it whatever it is
        (max_tokens, max_model_len). Returns those sequences, each with its place among the batch's samples.
        ``apply_tokens`` with the tokens must follow before anything reads the sequences' tokens. A verify step
        (drafts) is advanced only once its tokens are known: its accepted count decides the sequences' lengths."""
        if pending and batch.has_drafts:
            raise ValueError("advance: a verify step's tokens decide its sequences' lengths; read it back first")
        for seq, new in batch.prompt_logprobs:  # computed with the step, on the host already
            if not seq.is_finished:
                seq.computed_prompt_logprobs.extend(new)
        assumed: dict[Sequence, int] = {}
        k = -1
        for entry in batch.entries:
            seq = entry.seq
            k += entry.sample
            if seq.is_finished:
                continue
            if entry.start != seq.num_computed_tokens:
                raise RuntimeError(
                    f"postprocess: {seq.request_id!r} was scheduled from position {entry.start} but has "
                    f"{seq.num_computed_tokens} computed tokens (schedule called twice without postprocess?)"
                )
            self.block_manager.mark_computed(seq, entry.num_fed)  # a draft's KV counts once it is accepted
            if seq.mm is not None:
                self.encoder_cache.free_computed(seq)
            if pending and entry.sample and not self._ends_by_length(seq):
                seq.token_ids.append(PENDING_TOKEN)
                assumed[seq] = k
        return assumed

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether one more token finishes ``seq`` with "length"."""
        max_len = self.config.max_model_len
        return seq.num_output_tokens + 1 >= seq.params.max_tokens or (
            max_len is not None and seq.num_tokens + 1 >= max_len
        )

    def apply_tokens(
        self,
        batch: ScheduledBatch,
        token_ids: list[int],
        logprobs: list[TokenLogprobs] | None = None,
    ) -> list[Sequence]:
        """After ``advance(batch)``: append the sampled tokens (in the place of pending ones), check stop tokens
        and lengths, and return the sequences that finished. A sequence preempted since (async scheduling: the
        next step was scheduled first) gets its token too, and may finish from the waiting queue."""
        num_samples = _check_samples(batch, token_ids, logprobs)
        if batch.has_drafts:
            raise ValueError("apply_tokens: a batch with drafts is applied token by token (accept_token)")
        finished: list[Sequence] = []
        samples = (entry.seq for entry in batch.entries if entry.sample)
        for seq, token_id, token_logprobs in zip(samples, token_ids, logprobs or [None] * num_samples, strict=True):
            if seq.is_finished:
                continue
            seq.append_token(token_id, token_logprobs)
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                (self.waiting if seq.status is SequenceStatus.WAITING else self.running).remove(seq)
                self._release(seq, reason)
                finished.append(seq)
        return finished

    def accept_token(self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None, draft_computed: bool) -> bool:
        """Speculative decoding, after ``advance``: append one token of a verify chunk's accepted run, as
        ``apply_tokens`` appends a decode's, and return whether it finished ``seq``. ``draft_computed``: the token
        before it is an accepted draft, whose KV the step computed (now counted, and hashed once its block fills:
        a rejected draft's slot is never counted, so no block holding one is ever registered)."""
        if draft_computed:
            self.block_manager.mark_computed(seq, 1)
        seq.append_token(token_id, logprobs)
        reason = self._stop_reason(seq, token_id)
        if reason is not None:
            self.running.remove(seq)
            self._release(seq, reason)
            return True
        return False

    def trim_drafts(self, seq: Sequence) -> None:
        """After a verify chunk's accepted run: give back the blocks past ``seq``'s tokens (its rejected drafts'
        slots; their KV is overwritten when the positions are computed again)."""
        if not seq.is_finished and seq.status is SequenceStatus.RUNNING:
            self.block_manager.trim(seq)

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if self.config.max_model_len is not None and seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def check_integrity(self) -> None:
        """Raise AssertionError if the queues or the block manager are inconsistent (for tests and debugging)."""
        for seq in self.waiting:
            if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
                raise AssertionError(f"Scheduler integrity: waiting {seq!r} holds state")
        for seq in self.running:
            if seq.status is not SequenceStatus.RUNNING or seq.num_pending_tokens < 1:
                raise AssertionError(f"Scheduler integrity: running {seq!r} is not runnable")
        arrivals = [s.arrival for s in self.running]
        if arrivals != sorted(arrivals):
            raise AssertionError(f"Scheduler integrity: running not in arrival order: {arrivals}")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError(f"Scheduler integrity: {len(self.running)} running > max_num_seqs")
        if len(self._requests) != self.num_unfinished:
            raise AssertionError(
                f"Scheduler integrity: {len(self._requests)} known requests, {self.num_unfinished} queued"
            )
        live = {
            (s.request_id, k)
            for s in self.running
            if s.mm is not None
            for k, image in enumerate(s.mm.images)
            if image.end > s.num_computed_tokens
        }
        stale = [key for key in self.encoder_cache.keys() if key not in live]
        if stale:
            raise AssertionError(f"Scheduler integrity: the encoder cache holds {stale[:4]}, no running image's")
        self.encoder_cache.check_integrity()
        self.block_manager.check_integrity(self.running)


def _check_samples(batch: ScheduledBatch, token_ids: list[int], logprobs: list[TokenLogprobs] | None) -> int:
    """Raise ValueError unless there is one token (and logprob) per sampling entry; returns their number."""
    num_samples = batch.num_samples
    if len(token_ids) != num_samples:
        raise ValueError(f"postprocess: {len(token_ids)} token ids for {num_samples} sampling entries")
    if logprobs is not None and len(logprobs) != num_samples:
        raise ValueError(f"postprocess: {len(logprobs)} logprobs for {num_samples} sampling entries")
    return num_samples
