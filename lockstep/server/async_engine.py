"""The synchronous ``LLMEngine`` behind an asyncio front: one thread steps it, requests stream back per step.

The engine thread owns the engine and is the only thread that touches it. The event loop hands it commands
(add, abort) through a thread-safe queue; the thread applies them between steps, so every step batches all the
requests in flight (continuous batching), and it posts each step's ``RequestOutput`` to the request's own
``asyncio.Queue`` with ``call_soon_threadsafe``. How requests happen to be batched never changes their tokens;
the kernels see to that.
"""

import asyncio
import hashlib
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from lockstep.engine.llm_engine import LLMEngine
from lockstep.outputs import RequestOutput
from lockstep.sampling_params import SamplingParams
from lockstep.server.metrics import Metrics


class EngineDeadError(RuntimeError):
    """The engine thread failed; the server cannot serve requests any more."""


@dataclass
class _Add:
    requests: list[tuple[str, list[int], SamplingParams]]
    out: "asyncio.Queue[RequestOutput | BaseException]"
    loop: asyncio.AbstractEventLoop
    done: Future = field(default_factory=Future)


@dataclass
class _Abort:
    request_id: str


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
    """Runs ``engine`` in a daemon thread; ``submit`` queues requests and returns their ``RequestGroup``.

    ``stop()`` ends the thread. If a step raises, every request in flight gets the exception and is aborted;
    the thread goes on serving later requests.
    """

    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics if metrics is not None else Metrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}  # engine-thread only
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lockstep-engine", daemon=True)
        self._next_id = 0
        self._update_gauges()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopping.set()
        self._commands.put(None)
        self._thread.join(timeout=30)

    def new_request_id(self, prefix: str) -> str:
        self._next_id += 1
        return f"{prefix}-{self._next_id}"

    async def submit(self, requests: list[tuple[str, list[int], SamplingParams]]) -> "RequestGroup":
        """Queue ``(request_id, prompt_token_ids, params)`` requests (all, or none: a ValueError from the
        engine for any of them rejects the lot) and return the group whose outputs stream back together."""
        if not self.alive:
            raise EngineDeadError("the engine thread is not running")
        cmd = _Add(requests, asyncio.Queue(), asyncio.get_running_loop())
        group = RequestGroup(self, [r[0] for r in requests], cmd.out)
        self._commands.put(cmd)
        try:
            await asyncio.wrap_future(cmd.done)
        except asyncio.CancelledError:
            group.abort()
            raise
        return group

    # -- the engine thread -------------------------------------------------------------------------------------

    def _apply(self, cmd: "_Add | _Abort") -> None:
        if isinstance(cmd, _Abort):
            if self._streams.pop(cmd.request_id, None) is not None and self.engine.abort(cmd.request_id):
                self.metrics.aborted += 1
            return
        added = []
        try:
            for request_id, prompt_token_ids, params in cmd.requests:
                self.engine.add_request(request_id, prompt_token_ids, params)
                added.append(request_id)
        except Exception as e:  # a rejected request: its handler answers 400
            for request_id in added:
                self.engine.abort(request_id)
            cmd.done.set_exception(e)
            return
        for request_id in added:
            self._streams[request_id] = cmd
        self.metrics.prompt_tokens += sum(len(r[1]) for r in cmd.requests)
        cmd.done.set_result(None)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            # Idle: block for the next command. Busy: take whatever arrived since the last step, then step.
            block = not self.engine.has_unfinished_requests()
            while True:
                try:
                    cmd = self._commands.get(block=block)
                except queue.Empty:
                    break
                if cmd is None:
                    return
                self._apply(cmd)
                block = False
            if not self.engine.has_unfinished_requests():
                self._update_gauges()
                continue
            start = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # fail the requests in flight, keep serving
                for rid, stream in list(self._streams.items()):
                    self.engine.abort(rid)
                    stream.loop.call_soon_threadsafe(stream.out.put_nowait, e)
                self._streams.clear()
                self._update_gauges()
                continue
            self.metrics.step_seconds.observe(time.perf_counter() - start)
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                stream.loop.call_soon_threadsafe(stream.out.put_nowait, out)
            self.metrics.generation_tokens += len(outputs)
            self._update_gauges()

    def _update_gauges(self) -> None:
        s = self.engine.scheduler
        bm = s.block_manager
        self.metrics.running = len(s.running)
        self.metrics.waiting = len(s.waiting)
        self.metrics.kv_blocks_total = bm.num_blocks
        self.metrics.kv_blocks_used = bm.num_blocks - bm.num_free_blocks


class RequestGroup:
    """The requests of one API call (its ``n`` choices, its prompts): their outputs, in the order steps made
    them. ``abort()`` (also on ``aclose`` or cancellation of the iteration) stops the unfinished ones."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], out: asyncio.Queue) -> None:
        self._engine = engine
        self.request_ids = request_ids
        self._unfinished = dict.fromkeys(request_ids)  # insertion-ordered
        self._out = out

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while self._unfinished:
                item = await self._out.get()
                if isinstance(item, BaseException):
                    self._unfinished.clear()
                    raise item
                if item.finished:
                    self._unfinished.pop(item.request_id, None)
                yield item
        finally:
            self.abort()

    def abort(self) -> None:
        for request_id in self._unfinished:
            self._engine._commands.put(_Abort(request_id))
        self._unfinished.clear()
