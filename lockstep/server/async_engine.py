"""The synchronous ``LLMEngine`` behind an asyncio front: one thread steps it, requests stream back per step.

The engine thread owns the engine and is the only thread that touches it. The event loop hands it commands
(add, abort) through a thread-safe queue; the thread applies them between steps, so every step batches all the
requests in flight (continuous batching), and it posts each step's outputs, as deltas, to the requests'
``RequestGroup`` with one ``call_soon_threadsafe`` a step. How requests happen to be batched never changes their
tokens; the kernels see to that.

What keeps one client from hurting the others (``ServingLimits`` holds the numbers):

- admission: a call's sequences (its ``n`` times its prompts) are capped, and so are the sequences and tokens
  waiting to be admitted; past those, ``submit`` raises ``EngineOverloadedError`` (429, Retry-After);
- a time limit per call, and a consumer that leaves its outputs unread too long (a stream whose client stopped
  reading) loses its requests: the engine stops them and frees their blocks;
- faults: a request's own fault finishes it alone (``LLMEngine.step``); a failed step fails the requests in flight
  and the engine carries on unless it cannot (its state is inconsistent, or steps keep failing). Then it is dead:
  every request gets ``EngineDeadError`` (503), ``status`` says so and ``on_fatal`` tells the server to exit;
- shutdown: ``drain`` refuses new calls and gives those in flight a deadline, after which they fail with
  ``ShuttingDownError`` (503).
"""

import asyncio
import hashlib
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from lockstep.engine.llm_engine import LLMEngine
from lockstep.outputs import CompletionOutput, OutputKind, RequestOutput, RequestStateStats
from lockstep.sampling_params import SamplingParams
from lockstep.server.metrics import Metrics

logger = logging.getLogger(__name__)

# Consecutive failed steps after which the engine is taken for broken (a sticky device error fails every step).
MAX_CONSECUTIVE_STEP_FAILURES = 3
# How often, at most, the engine thread checks deadlines while it is busy.
SWEEP_SECONDS = 0.1


class EngineError(RuntimeError):
    """Why the server cannot serve a request: the HTTP status, OpenAI error type and code to answer with, and
    seconds for a Retry-After header when trying again later makes sense."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(EngineError):
    """The engine thread failed for good; the server cannot serve requests any more."""

    status, code = 503, "engine_dead"


class EngineOverloadedError(EngineError):
    """The queue is full: try again after ``retry_after`` seconds."""

    status, type, code = 429, "rate_limit_error", "queue_full"


class EngineSleepingError(EngineError):
    """The engine is asleep (``/sleep``): no requests until ``/wake_up``."""

    status, code = 503, "engine_sleeping"


class ShuttingDownError(EngineError):
    """The server is shutting down: no new requests, and the drain deadline has passed for those in flight."""

    status, code = 503, "shutting_down"


class RequestTimeoutError(EngineError):
    """The call ran past ``ServingLimits.request_timeout``."""

    status, type, code = 504, "timeout_error", "request_timeout"


class SlowReaderError(EngineError):
    """The call's outputs went unread for too long (a client that stopped reading its stream)."""

    status, code = 408, "client_too_slow"


class RequestFailedError(EngineError):
    """The engine aborted one of the call's requests for a fault of its own (``detail`` says which; the server
    log has it too), or a whole step failed."""

    code = "request_failed"
    detail: str | None = None


def _check(name: str, value: object, minimum: float, kind: type = int, optional: bool = False) -> None:
    if optional and value is None:
        return
    ok = isinstance(value, kind if kind is int else (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name} must be {'an int' if kind is int else 'a number'} >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class ServingLimits:
    """How much work the server takes on, validated when built. The engine thread enforces them; the HTTP layer
    may read them too (``AsyncEngine.limits``), e.g. to refuse an oversized call before tokenizing it.

    The defaults protect one GPU serving up to 256 sequences at a time: a queue four times that deep, about a
    million prompt tokens waiting (some 30 s of prefill at docs/perf.md's 36k tokens/s, Qwen3-8B on an H200),
    ten minutes a call.
    """

    max_queued_seqs: int = 1024  # sequences waiting to be admitted, all calls together
    max_queued_tokens: int = 1 << 20  # their tokens still to prefill
    max_seqs_per_request: int | None = None  # one call's sequences, n x its prompts; None: min(256, max_queued_seqs)
    request_timeout: float | None = 600.0  # seconds from submit to the last output; None: no limit
    unread_timeout: float = 30.0  # seconds a call's outputs may wait unread before its requests are stopped
    max_unread_outputs: int = 1024  # outputs waiting unread before the same
    retry_after: float = 1.0  # seconds, the Retry-After of a 429

    def __post_init__(self) -> None:
        if self.max_seqs_per_request is None and isinstance(self.max_queued_seqs, int):
            object.__setattr__(self, "max_seqs_per_request", min(256, self.max_queued_seqs))
        for name in ("max_queued_seqs", "max_queued_tokens", "max_seqs_per_request", "max_unread_outputs"):
            _check(name, getattr(self, name), 1)
        _check("request_timeout", self.request_timeout, 0.001, float, optional=True)
        _check("unread_timeout", self.unread_timeout, 0.001, float)
        _check("retry_after", self.retry_after, 0, float)
        if self.max_seqs_per_request > self.max_queued_seqs:
            raise ValueError(
                f"max_seqs_per_request ({self.max_seqs_per_request}) must be <= max_queued_seqs "
                f"({self.max_queued_seqs}): a call that can never be queued should be refused as such"
            )


@dataclass
class _Add:
    group: "RequestGroup"
    requests: list[tuple]  # (request_id, prompt_token_ids, params[, mm])
    done: Future = field(default_factory=Future)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _EngineCall:
    """Run ``fn(engine)`` in the engine thread (weight updates, sleep): with ``wait_idle``, once no request is in
    flight, the commands that arrive meanwhile (but aborts) waiting behind it in order."""

    fn: Callable[[LLMEngine], object]
    wait_idle: bool
    done: Future = field(default_factory=Future)


_WAKE = object()  # a command that only wakes the thread (drain)
_STOP = object()


@dataclass
class _Delta:
    """What one step added to one request: new tokens (and their logprobs), and its text as ``text[:keep] +
    piece`` of the text before (the text only grows, except when a stop string cuts it at the end)."""

    request_id: str
    token_ids: list[int]
    token_logprobs: list[float]
    logprobs: list | None  # vLLM's Logprob dicts, when asked for
    keep: int
    piece: str
    finish_reason: str | None
    seed: int | None
    error: str | None
    prompt_logprobs: list | None = None  # vLLM's prompt logprob dicts, when asked for (the engine's list, shared)
    num_cached_tokens: int | None = None  # prefix-cache hits at its first step (vLLM's; usage's cached_tokens)
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    metrics: RequestStateStats | None = None  # the engine's timings of the request so far (per-request metrics)


def weights_hash(folder: str | Path) -> str:
    """blake2b over the checkpoint's safetensors files (in the loader's fixed order): the weights' identity."""
    from lockstep.models.loader import weight_files

    h = hashlib.blake2b(digest_size=16)
    for file in weight_files(folder):
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


class AsyncEngine:
    """Runs ``engine`` in a daemon thread; ``submit`` queues a call's requests and returns their ``RequestGroup``.

    ``limits`` may be replaced (by a new ``ServingLimits``) before serving starts. ``on_fatal``, when set, is
    called from the engine thread once the engine is dead. ``stop()`` ends the thread.
    """

    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None, limits: ServingLimits | None = None) -> None:
        self.engine = engine
        self.metrics = metrics if metrics is not None else Metrics()
        self.limits = limits if limits is not None else ServingLimits()
        self.on_fatal: Callable[[], None] | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Engine thread only: each live request's group, the groups with live requests, each request's text so far.
        self._groups: dict[str, RequestGroup] = {}
        self._active: dict[RequestGroup, None] = {}  # insertion-ordered
        self._texts: dict[str, str] = {}
        self._token_times: dict[str, float] = {}  # perf_counter() of each live request's latest tokens
        self._failures = 0  # consecutive failed steps
        self._next_sweep = 0.0
        self._dead: BaseException | None = None
        self._drain_deadline: float | None = None  # set by drain()
        self._held: deque = deque()  # engine thread: commands waiting behind an _EngineCall for the engine to be idle
        self._thread = threading.Thread(target=self._run, name="lockstep-engine", daemon=True)
        self._next_id = 0
        self._update_gauges()
        self._thread.start()

    @property
    def alive(self) -> bool:
        """True while the engine thread runs and can serve."""
        return self._dead is None and self._thread.is_alive()

    @property
    def status(self) -> str:
        """What /health reports: "ok", "shutting down", or why the engine cannot serve."""
        if not self.alive:
            return f"engine failed: {self._dead!r}" if self._dead is not None else "engine thread stopped"
        return "shutting down" if self._drain_deadline is not None else "ok"

    @property
    def draining(self) -> bool:
        """True once ``drain`` was called."""
        return self._drain_deadline is not None

    @property
    def idle(self) -> bool:
        """True while no call has requests in the engine (read from any thread: the engine thread's count of them
        may be a step stale)."""
        return not self._active

    def stop(self) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout=30)
        if self._dead is None:
            self._dead = EngineDeadError("the engine was stopped")

    def drain(self, timeout: float) -> None:
        """Stop admitting calls (``submit`` raises ``ShuttingDownError``); those in flight may finish within
        ``timeout`` seconds, after which they fail with ``ShuttingDownError``. Thread-safe."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + timeout
            self._commands.put(_WAKE)

    def new_request_id(self, prefix: str) -> str:
        self._next_id += 1
        return f"{prefix}-{self._next_id}"

    async def submit(self, requests: list[tuple]) -> "RequestGroup":
        """Queue one call's ``(request_id, prompt_token_ids, params)`` requests, each optionally with its images'
        ``MultimodalInputs`` as a fourth element (all, or none: a ValueError from the engine for any of them rejects
        the lot) and return the group whose outputs stream back together.

        Raises ValueError for a call that could never be queued, ``EngineOverloadedError`` when the queue is full
        now, ``ShuttingDownError`` while draining and ``EngineDeadError`` once the engine is dead."""
        self._check_serving()
        limit = self.limits.max_seqs_per_request
        if len(requests) > limit:
            raise ValueError(
                f"this request needs {len(requests)} sequences (n times the number of prompts); the server takes "
                f"at most {limit} per request"
            )
        timeout = self.limits.request_timeout
        deadline = time.monotonic() + timeout if timeout is not None else None
        group = RequestGroup(self, requests, asyncio.get_running_loop(), deadline)
        cmd = _Add(group, requests)
        self._commands.put(cmd)
        if self._dead is not None:  # died after the check: nobody will apply the command
            _fail_future(cmd.done, EngineDeadError("the engine failed; the server cannot serve requests"))
        try:
            await asyncio.wrap_future(cmd.done)
        except asyncio.CancelledError:
            group.abort()  # added or not, the engine forgets it (an unknown id is ignored)
            raise
        return group

    def _check_serving(self) -> None:
        if not self.alive:
            raise EngineDeadError("the engine failed; the server cannot serve requests")
        if self._drain_deadline is not None:
            raise ShuttingDownError("the server is shutting down", retry_after=self.limits.retry_after)
        if self.engine.is_sleeping:
            raise EngineSleepingError("the engine is sleeping: POST /wake_up first")

    async def run_on_engine(self, fn: Callable[[LLMEngine], object], wait_idle: bool = True) -> object:
        """``fn(engine)`` in the engine thread, between steps (with ``wait_idle``: once no request is in flight,
        calls submitted later waiting behind it); its result, or its exception raised here. Not refused while the
        engine sleeps (``wake_up`` comes this way)."""
        if not self.alive:
            raise EngineDeadError("the engine failed; the server cannot serve requests")
        cmd = _EngineCall(fn, wait_idle)
        self._commands.put(cmd)
        if self._dead is not None:
            _fail_future(cmd.done, EngineDeadError("the engine failed; the server cannot serve requests"))
        return await asyncio.wrap_future(cmd.done)

    # -- the engine thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug in the loop, or an engine left unusable: nothing can be served
            self._die(e)

    def _next_command(self, block: bool):
        """The next command: a held one once the engine is idle, else a new one (held too while others are)."""
        while True:
            if self._held and not self.engine.has_unfinished_requests():
                return self._held.popleft()
            cmd = self._commands.get(block=block)
            if not self._held or cmd is _STOP or isinstance(cmd, _Abort):
                return cmd
            self._held.append(cmd)  # behind a call waiting for the engine to be idle

    def _loop(self) -> None:
        while True:
            # Idle: block for the next command. Busy: take whatever arrived since the last step, then step.
            block = not self.engine.has_unfinished_requests() and not self._held
            queued: list[int] | None = None  # [sequences, tokens] waiting, counted once per batch of commands
            while True:
                try:
                    cmd = self._next_command(block)
                except queue.Empty:
                    break
                if cmd is _STOP:
                    for held in self._held:
                        if isinstance(held, (_Add, _EngineCall)):
                            _fail_future(held.done, EngineDeadError("the engine was stopped"))
                    return
                if isinstance(cmd, _Add):
                    if queued is None:
                        waiting = self.engine.scheduler.waiting
                        queued = [len(waiting), sum(seq.num_tokens for seq in waiting)]
                    self._add(cmd, queued)
                elif isinstance(cmd, _Abort):
                    self._abort(cmd.request_id)
                elif isinstance(cmd, _EngineCall):
                    if cmd.wait_idle and self.engine.has_unfinished_requests():
                        self._held.append(cmd)
                    else:
                        self._run_engine_call(cmd)
                block = False
            if self.engine.has_unfinished_requests():
                self._step()
                if time.monotonic() >= self._next_sweep:
                    self._sweep()
            self._update_gauges()

    def _run_engine_call(self, cmd: _EngineCall) -> None:
        if not cmd.done.set_running_or_notify_cancel():
            return
        try:
            result = cmd.fn(self.engine)
        except Exception as e:
            cmd.done.set_exception(e)
            workers = self.engine.workers
            if workers is not None and workers.failure is not None:  # the ranks are out of step for good
                raise RuntimeError(f"the engine cannot continue: {workers.failure}") from e
            return
        cmd.done.set_result(result)

    def _add(self, cmd: _Add, queued: list[int]) -> None:
        if not cmd.done.set_running_or_notify_cancel():
            return  # its submit was cancelled before the command got here: nothing was added, nobody waits
        limits, num_seqs = self.limits, len(cmd.requests)
        num_tokens = sum(len(request[1]) for request in cmd.requests)
        if self._drain_deadline is not None:
            cmd.done.set_exception(ShuttingDownError("the server is shutting down", retry_after=limits.retry_after))
            return
        if self.engine.is_sleeping:  # it fell asleep after the call's submit checked
            cmd.done.set_exception(EngineSleepingError("the engine is sleeping: POST /wake_up first"))
            return
        if num_tokens > limits.max_queued_tokens:
            cmd.done.set_exception(
                ValueError(
                    f"this request's prompts hold {num_tokens} tokens; the server queues at most "
                    f"{limits.max_queued_tokens}"
                )
            )
            return
        if queued[0] + num_seqs > limits.max_queued_seqs or queued[1] + num_tokens > limits.max_queued_tokens:
            cmd.done.set_exception(
                EngineOverloadedError(
                    f"the server is busy: {queued[0]} sequences with {queued[1]} tokens are waiting (at most "
                    f"{limits.max_queued_seqs} sequences and {limits.max_queued_tokens} tokens); try again later",
                    retry_after=limits.retry_after,
                )
            )
            return
        added = []
        try:
            for request_id, prompt_token_ids, params, *mm in cmd.requests:
                kind, mm_inputs = OutputKind.DELTA, mm[0] if mm else None
                self.engine.add_request(request_id, prompt_token_ids, params, output_kind=kind, mm=mm_inputs)
                added.append(request_id)
        except Exception as e:  # a rejected request: its handler answers 400
            for request_id in added:
                self.engine.abort(request_id)
            cmd.done.set_exception(e)
            return
        for request_id in added:
            self._groups[request_id] = cmd.group
        if added:
            self._active[cmd.group] = None
        cmd.group.num_live = len(added)
        queued[0] += num_seqs
        queued[1] += num_tokens
        self.metrics.prompt_tokens += num_tokens
        cmd.done.set_result(None)

    def _abort(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        if group is None:  # finished, aborted already, or never added
            return
        self._forget(request_id, group)
        if self.engine.abort(request_id) is not None:
            self.metrics.aborted += 1

    def _forget(self, request_id: str, group: "RequestGroup") -> None:
        del self._groups[request_id]
        self._texts.pop(request_id, None)
        self._token_times.pop(request_id, None)
        group.num_live -= 1
        if group.num_live == 0:
            self._active.pop(group, None)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._step_failed(e)
            return
        self._failures = 0
        now = time.perf_counter()
        self.metrics.step_seconds.observe(now - start)
        if self.engine.scheduled_tokens:
            self.metrics.iteration_tokens.observe(self.engine.scheduled_tokens)
        posts: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            group = self._groups.get(out.request_id)
            if group is None:
                continue
            delta = self._delta(out)
            if delta.token_ids:  # the time since this request's previous tokens (vLLM's inter-token latency)
                before = self._token_times.get(out.request_id)
                if before is not None:
                    self.metrics.inter_token_seconds.observe((now - before) / len(delta.token_ids))
                self._token_times[out.request_id] = now
            if out.finished:
                self._forget(out.request_id, group)
                reason = out.outputs[0].finish_reason or "abort"
                self.metrics.finished[reason] = self.metrics.finished.get(reason, 0) + 1
                if delta.error is not None:
                    logger.warning("lockstep: request %s aborted by the engine: %s", out.request_id, delta.error)
            posts.setdefault(group.loop, []).append((group, delta))
            self.metrics.generation_tokens += len(delta.token_ids)
        for loop, items in posts.items():
            _post(loop, items)

    def _delta(self, out: RequestOutput) -> _Delta:
        c = out.outputs[0]
        before = self._texts.get(out.request_id, "")
        if c.text is before or c.text == before:
            keep, piece = len(before), ""
        elif c.text.startswith(before):
            keep, piece = len(before), c.text[len(before) :]
        else:
            keep, piece = 0, c.text
        self._texts[out.request_id] = c.text
        return _Delta(
            out.request_id,
            c.token_ids,
            c.token_logprobs,
            c.logprobs,
            keep,
            piece,
            c.finish_reason,
            c.seed,
            c.error,
            out.prompt_logprobs,
            out.num_cached_tokens,
            c.stop_reason,
            out.metrics,
        )

    def _fail(self, group: "RequestGroup", error: EngineError) -> None:
        """Stop the group's live requests (freeing their blocks) and hand its consumer ``error``."""
        for request_id in group.request_ids:
            self._abort(request_id)
        _post(group.loop, [(group, error)])

    def _sweep(self) -> None:
        now = time.monotonic()
        self._next_sweep = now + SWEEP_SECONDS
        draining = self._drain_deadline is not None and now >= self._drain_deadline
        for group in list(self._active):
            if draining:
                self._fail(group, ShuttingDownError("the server shut down before the request finished"))
            elif group.deadline is not None and now >= group.deadline:
                limit = self.limits.request_timeout
                self._fail(group, RequestTimeoutError(f"the request ran past the server's time limit ({limit} s)"))

    def _step_failed(self, error: Exception) -> None:
        """A fault of the whole step: stop everything in flight; if the engine is whole again, fail those calls
        (500) and carry on, else raise, and the engine is dead (the calls get 503)."""
        self._failures += 1
        logger.error("lockstep: an engine step failed; the requests in flight are aborted", exc_info=error)
        failed = list(self._active)
        for group in failed:
            for request_id in group.request_ids:
                self._abort(request_id)
        broken = self._broken()
        if broken is not None:
            self._active.update(dict.fromkeys(failed))  # for _die to tell them
            raise RuntimeError(f"the engine cannot continue: {broken}") from error
        for group in failed:
            _post(group.loop, [(group, RequestFailedError("the engine step running this request failed"))])

    def _broken(self) -> str | None:
        """Why the engine cannot go on after a failed step whose requests were all aborted; None if it can."""
        if self._failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            return f"{self._failures} steps failed in a row"
        workers = self.engine.workers  # tensor parallelism: a dead worker leaves the ranks out of step for good
        if workers is not None and workers.failure is not None:
            return workers.failure
        scheduler = self.engine.scheduler
        try:
            scheduler.check_integrity()
        except AssertionError as e:
            return str(e)
        blocks = scheduler.block_manager
        if scheduler.has_unfinished() or blocks.num_free_blocks != blocks.num_blocks:
            return (
                f"it still holds {scheduler.num_unfinished} requests and "
                f"{blocks.num_blocks - blocks.num_free_blocks} KV blocks with nothing in flight"
            )
        return None

    def _die(self, error: BaseException) -> None:
        self._dead = error
        logger.critical("lockstep: the engine cannot continue; failing every request", exc_info=error)
        dead = "the engine failed; the server cannot serve requests"
        for group in list(self._active):
            _post(group.loop, [(group, EngineDeadError(dead))])
        self._active.clear()
        while True:  # calls submitted but not applied
            try:
                cmd = self._commands.get(block=False)
            except queue.Empty:
                break
            if isinstance(cmd, (_Add, _EngineCall)):
                _fail_future(cmd.done, EngineDeadError(dead))
        for cmd in self._held:
            if isinstance(cmd, (_Add, _EngineCall)):
                _fail_future(cmd.done, EngineDeadError(dead))
        self._held.clear()
        try:
            self._update_gauges()
        except Exception:  # the engine may be too broken to count its blocks
            pass
        if self.on_fatal is not None:
            self.on_fatal()

    def _update_gauges(self) -> None:
        s = self.engine.scheduler
        bm = s.block_manager
        self.metrics.running = len(s.running)
        self.metrics.waiting = len(s.waiting)
        self.metrics.kv_blocks_total = bm.num_blocks
        self.metrics.kv_blocks_used = bm.num_blocks - bm.num_free_blocks
        self.metrics.triton_compiles = self.engine.triton_compiles_after_start
        self.metrics.grammar_cache_bytes, self.metrics.grammar_cache_entries = self.engine.grammar_cache
        if self.engine.drafter is not None:
            self.metrics.spec_decode = self.engine.spec_stats


def _fail_future(future: Future, error: BaseException) -> None:
    if future.set_running_or_notify_cancel():
        future.set_exception(error)


def _post(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """Hand ``(group, item)`` pairs to their consumers on ``loop`` (from the engine thread)."""
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _deliver(items: list) -> None:
    for group, item in items:
        group._put(item)


class _Output:
    """One request's output so far, rebuilt from its deltas on the consumer's side."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], want_top: bool) -> None:
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.token_ids: list[int] = []
        self.token_logprobs: list[float] = []
        self.logprobs: list | None = [] if want_top else None
        self.text = ""
        self.finish_reason: str | None = None
        self.seed: int | None = None
        self.error: str | None = None
        self.prompt_logprobs: list | None = None
        self.num_cached_tokens: int | None = None
        self.stop_reason: int | str | None = None
        self.metrics: RequestStateStats | None = None

    def add(self, d: _Delta) -> None:
        self.token_ids += d.token_ids
        self.token_logprobs += d.token_logprobs
        if self.logprobs is not None and d.logprobs is not None:
            self.logprobs += d.logprobs
        self.text = self.text[: d.keep] + d.piece
        self.finish_reason, self.seed, self.error = d.finish_reason, d.seed, d.error
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.num_cached_tokens is not None:
            self.num_cached_tokens = d.num_cached_tokens
        self.stop_reason = d.stop_reason
        self.metrics = d.metrics

    def output(self) -> RequestOutput:
        logprobs = list(self.logprobs) if self.logprobs is not None else None
        c = CompletionOutput(
            index=0,
            text=self.text,
            token_ids=list(self.token_ids),
            token_logprobs=list(self.token_logprobs),
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            seed=self.seed,
            error=self.error,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            self.request_id,
            None,
            self.prompt_token_ids,
            [c],
            self.prompt_logprobs,
            self.num_cached_tokens,
            metrics=self.metrics,
        )


class RequestGroup:
    """The requests of one API call (its ``n`` choices, its prompts): their outputs, in the order steps made
    them, each whole so far (rebuilt from the deltas the engine thread sends). ``abort()`` (also on ``aclose`` or
    cancellation of the iteration) stops the unfinished ones. An ``EngineError`` ends the iteration: a request's
    own fault raises ``RequestFailedError``."""

    def __init__(
        self,
        engine: AsyncEngine,
        requests: list[tuple[str, list[int], SamplingParams]],
        loop: asyncio.AbstractEventLoop,
        deadline: float | None,
    ) -> None:
        self._engine = engine
        self.loop = loop
        self.deadline = deadline
        self.request_ids = [r[0] for r in requests]
        self.num_live = 0  # the engine thread's count of its unfinished requests
        self._outputs = {rid: _Output(rid, ids, p.logprobs is not None) for rid, ids, p, *_ in requests}
        self._unfinished = dict.fromkeys(self.request_ids)  # insertion-ordered
        self._items: deque = deque()  # delivered, not yet read: deltas, then maybe one EngineError
        self._ready = asyncio.Event()
        self._accepting = True  # False once the consumer left or its requests were stopped
        self._read_at = self._unread_since = time.monotonic()

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, item: "_Delta | EngineError") -> None:
        """Take one item from the engine thread (on the loop). A consumer that leaves outputs unread past the
        limits loses its requests."""
        if not self._accepting:
            return
        now = time.monotonic()
        if not self._items:
            self._unread_since = now
        self._items.append(item)
        self._ready.set()
        if not isinstance(item, _Delta):
            self._accepting = False  # an error ends the group
            return
        limits = self._engine.limits
        stalled = now - max(self._read_at, self._unread_since) > limits.unread_timeout
        if len(self._items) > limits.max_unread_outputs or stalled:
            self._stop_requests()
            self._items.clear()  # nobody reads them: free them now
            self._items.append(SlowReaderError("the client did not read the response in time; the request was stopped"))
            self._accepting = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while self._unfinished or self._items:
                while not self._items:
                    self._ready.clear()
                    await self._ready.wait()
                # Everything delivered since the last read, applied at once: a consumer that fell behind catches up
                # with one output per request.
                items, touched = list(self._items), {}
                self._items.clear()
                self._read_at = time.monotonic()
                for item in items:
                    if isinstance(item, BaseException):
                        self._unfinished.clear()  # the engine thread stopped them already
                        raise item
                    out = self._outputs[item.request_id]
                    out.add(item)
                    touched[item.request_id] = out
                for rid, out in touched.items():
                    if out.error is not None:
                        error = RequestFailedError("the engine could not complete the request (see the server log)")
                        error.detail = out.error
                        raise error
                    if out.finish_reason is not None:
                        self._unfinished.pop(rid, None)
                    yield out.output()
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop the unfinished requests (their blocks are freed) and drop what was not read."""
        self._stop_requests()
        self._accepting = False
        self._items.clear()

    def _stop_requests(self) -> None:
        for request_id in self._unfinished:
            self._engine._commands.put(_Abort(request_id))
        self._unfinished.clear()
