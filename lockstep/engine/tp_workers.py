"""The worker processes of a tensor-parallel engine: started with it, stopped with it, never left behind.

The engine's process is rank 0, the driver: it keeps the scheduler, the block manager, the sampler and the
detokenizer. ``WorkerPool.spawn`` starts ranks 1..N-1 with torch.multiprocessing's spawn method; each joins the
process group (gloo on the CPU, NCCL on CUDA, device ``cuda:r``), loads only its shard of the checkpoint, builds
its ``ModelRunner`` with the same config and then serves the steps rank 0 sends (``ModelRunner.serve``).

Faults:
- a worker that dies (killed, or an exception: it reports the traceback on its pipe before exiting) makes the
  driver's next collective or health check fail; the driver then raises ``WorkerError`` naming the rank and why,
  and stops the other workers. The engine cannot go on after that: a step half done on some ranks has left the
  ranks out of step.
- a driver that dies closes the lifeline pipe each worker watches, and the worker exits at once.
- Ctrl-C reaches every process of the terminal's process group: workers ignore SIGINT and leave the decision to
  the driver (an interrupted step stops the workers; between steps nothing needs to happen).
- ``close()`` (``LLM.close``, ``__del__``, and an atexit hook for whatever is still open) sends the stop message,
  waits for the workers to leave the process group, and kills any that do not within ``STOP_TIMEOUT``.

Multi-node: ``WorkerPool.join_launched`` is the path for processes started by a launcher through torch.distributed's
standard rendezvous (torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``):
rank 0 becomes the driver and every other rank serves until rank 0 stops (README, "Tensor parallelism").
"""

import atexit
import datetime
import faulthandler
import os
import shutil
import signal
import tempfile
import threading
import traceback
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lockstep.config import EngineConfig
from lockstep.distributed import ControlChannel, TPGroup, destroy_tp_group, init_tp_group
from lockstep.engine.model_runner import ModelRunner, rank_device

# How long a collective of the model may wait for the other ranks (then it raises instead of hanging).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
# How long stopping waits for a worker to leave before killing it, and how long a failure waits to see which
# worker died (a collective that failed because a peer crashed returns about when the peer's process ends).
STOP_TIMEOUT = 10.0
LEAVE_TIMEOUT = 10.0  # how long close() waits for this process to leave the group
DEATH_GRACE = 3.0


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the engine cannot run further steps (create a new one)."""


@dataclass
class _Worker:
    rank: int
    process: mp.Process
    reports: Connection  # worker -> driver: ("joining",) once, ("failed", traceback) before dying of an exception
    lifeline: Connection  # driver -> worker: never written; its end closing tells the worker the driver is gone
    report: str | None = None


_open_pools: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


@atexit.register
def _close_open_pools() -> None:
    for pool in list(_open_pools):
        pool.close()


class WorkerPool:
    """Rank 0's handle on ranks 1..N-1: the group it shares with them and their processes (if it started them)."""

    def __init__(
        self, tp: TPGroup, channel: ControlChannel, device: torch.device, workers: list[_Worker], folder: str | None
    ):
        self.tp = tp
        self.channel = channel
        self.device = device  # rank 0's
        self.workers = workers
        self._folder = folder  # the rendezvous store's folder, removed on close
        self.closed = False
        self.failure: str | None = None  # why the pool can no longer run steps
        self._stop: Callable[[], None] = lambda: None  # sends the stop message (the runner's, once it exists)
        _open_pools.add(self)
        self._watch_end: Connection | None = None  # closing it ends the watcher
        if device.type == "cuda" and workers:
            # NCCL waits for a dead peer on the GPU, where no error arrives until the collective timeout (and then
            # the watchdog ends the process). A watcher aborts the group as soon as a worker dies, so rank 0's
            # pending collective fails now and ``fail`` names the rank. (Never run on a GPU in the tests.)
            watch_end, self._watch_end = mp.get_context("spawn").Pipe(duplex=False)
            threading.Thread(target=self._watch, args=(watch_end,), name="lockstep-tp-watch", daemon=True).start()

    def _watch(self, stop: Connection) -> None:
        ready = wait([w.process.sentinel for w in self.workers] + [stop])
        if stop in ready or self.closed or self.failure is not None:
            return
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None and dist.is_initialized():
            abort()

    # -- starting --------------------------------------------------------------------------------------------------

    @classmethod
    def spawn(cls, config: EngineConfig) -> "WorkerPool":
        """Start ``config.tensor_parallel_size - 1`` worker processes on this machine and join their group as
        rank 0. Returns once every worker has joined (their runners are then being built)."""
        if dist.is_initialized():
            raise RuntimeError(
                "this process already has a torch.distributed default group: a process drives one "
                "tensor-parallel engine at a time (close the other LLM first)"
            )
        size = config.tensor_parallel_size
        _check_devices(config, size)
        folder = tempfile.mkdtemp(prefix="lockstep-tp-")
        init_method = f"file://{folder}/store"
        threads = max(1, torch.get_num_threads() // size)
        context = mp.get_context("spawn")
        workers: list[_Worker] = []
        try:
            for rank in range(1, size):
                reports, report_end = context.Pipe(duplex=False)
                lifeline_end, lifeline = context.Pipe(duplex=False)
                process = context.Process(
                    target=_worker_main,
                    args=(rank, size, config, init_method, threads, report_end, lifeline_end),
                    name=f"lockstep-tp-rank{rank}",
                    daemon=True,
                )
                process.start()
                report_end.close()
                lifeline_end.close()
                workers.append(_Worker(rank, process, reports, lifeline))
            _wait_for_joining(workers)
            device = rank_device(config.device, 0, size)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            tp = init_tp_group(0, size, init_method, device, timeout=COLLECTIVE_TIMEOUT)
            channel = ControlChannel.create(0, size)
        except BaseException:
            _kill(workers)
            destroy_tp_group()
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return cls(tp, channel, device, workers, folder)

    @classmethod
    def join_launched(cls, config: EngineConfig, rank: int, local_rank: int) -> "WorkerPool | None":
        """Join the group a launcher (torchrun) started through ``env://``. Rank 0 gets its pool (with no processes
        of its own to manage); any other rank builds its runner, serves rank 0 until it stops, and returns None."""
        size = config.tensor_parallel_size
        # A node's ranks use its GPUs from cuda:0 (or the configured one) up, by local rank.
        device = rank_device(config.device, local_rank, size)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp = init_tp_group(rank, size, "env://", device, timeout=COLLECTIVE_TIMEOUT)
        channel = ControlChannel.create(rank, size)
        if rank == 0:
            return cls(tp, channel, device, [], None)
        try:
            ModelRunner(config, tp, channel, device=device).serve()
        finally:
            destroy_tp_group(abort=device.type == "cuda")
        return None

    # -- health --------------------------------------------------------------------------------------------------

    def attach(self, runner: ModelRunner) -> None:
        """The driver's runner, whose ``stop_workers`` ends the workers' loop on close."""
        self._stop = runner.stop_workers

    def check(self) -> None:
        """Raise ``WorkerError`` if the pool has failed or a worker has died (a cheap poll, once a step)."""
        if self.failure is not None:
            raise WorkerError(self.failure)
        if self.closed:
            raise RuntimeError("the engine's tensor-parallel workers were stopped (close()): create a new LLM")
        if self.workers and wait([w.process.sentinel for w in self.workers], timeout=0):
            self.fail(None)

    def fail(self, error: BaseException | None) -> None:
        """The driver's step, weight update or start failed with ``error`` (None: a worker was found dead). Stops
        every worker and raises: ``WorkerError`` naming the dead ranks if a worker died, else ``error`` itself."""
        if self.failure is not None:
            raise WorkerError(self.failure) from error
        # A collective that failed because a peer crashed returns about when the peer's process ends; an
        # interrupt (Ctrl-C) or a fault of rank 0's own does not wait.
        dead = self._dead_workers(DEATH_GRACE if isinstance(error, Exception) else 0.0)
        if dead:
            self.stop_now("; ".join(_describe(w) for w in dead) + "; the engine's other workers were stopped")
        else:
            what = f"{type(error).__name__}: {error}"
            self.stop_now(f"rank 0 stopped mid-step ({what}), leaving the workers out of step; they were stopped")
        if dead or error is None:
            raise WorkerError(self.failure) from error
        raise error

    def stop_now(self, why: str) -> None:
        """Kill the workers and leave the group: the pool has failed, and ``check`` raises ``why`` from now on."""
        self.failure = why
        _kill(self.workers)
        self._release()

    def _dead_workers(self, grace: float) -> list[_Worker]:
        sentinels = {w.process.sentinel: w for w in self.workers}
        ready = wait(list(sentinels), timeout=grace)
        if ready:
            ready = wait(list(sentinels), timeout=0.2)  # others that died of the same cause
        dead = [sentinels[s] for s in ready]
        for w in dead:
            w.process.join()
            w.report = _read_report(w.reports)
        return sorted(dead, key=lambda w: w.rank)

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids, rank 1 first."""
        return [w.process.pid for w in self.workers]

    # -- stopping ------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers (each leaves the group and exits; one that does not within ``STOP_TIMEOUT`` is killed)
        and leave the group. Safe to call more than once, and after a failure."""
        if self.closed:
            return
        self.closed = True
        _open_pools.discard(self)
        if self.failure is None:
            try:
                self._stop()
            except Exception as e:  # a worker already gone, say: every worker is killed below
                # Said aloud: a stop message that failed in silence once cost every close 20 s (docs/design.md).
                warnings.warn(f"stopping the tensor-parallel workers failed: {e!r}", RuntimeWarning, stacklevel=2)
            for w in self.workers:
                w.process.join(STOP_TIMEOUT)
        _kill(self.workers)
        self._release()

    def _release(self) -> None:
        if self._watch_end is not None:
            self._watch_end.close()  # the watcher returns
        # The workers have exited or been killed: nothing is pending, and an orderly NCCL destroy could wait on them.
        # Leaving has still been seen to hang on CUDA after steps with graphs (bench/tp.py, 2026-11-30, not yet
        # understood): a close that returns matters more than a clean group, so it waits LEAVE_TIMEOUT at most.
        left = threading.Event()

        def leave() -> None:
            destroy_tp_group(abort=self.device.type == "cuda")
            left.set()

        threading.Thread(target=leave, name="lockstep-tp-leave", daemon=True).start()
        if not left.wait(LEAVE_TIMEOUT):
            warnings.warn(
                f"leaving the tensor-parallel group did not finish within {LEAVE_TIMEOUT} s; going on",
                RuntimeWarning,
                stacklevel=2,
            )
        for w in self.workers:
            w.reports.close()
            w.lifeline.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


# -- the worker process ----------------------------------------------------------------------------------------


def _worker_main(
    rank: int,
    size: int,
    config: EngineConfig,
    init_method: str,
    threads: int,
    reports: Connection,
    lifeline: Connection,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where a stuck worker is
    threading.Thread(target=_exit_without_driver, args=(lifeline,), daemon=True).start()
    torch.set_num_threads(threads)
    try:
        device = rank_device(config.device, rank, size)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        reports.send(("joining",))
        tp = init_tp_group(rank, size, init_method, device, timeout=COLLECTIVE_TIMEOUT)
        channel = ControlChannel.create(rank, size)
        ModelRunner(config, tp, channel).serve()
    except BaseException:
        try:
            reports.send(("failed", traceback.format_exc()))
        finally:
            os._exit(1)  # without tearing down a group whose peers may be gone (that can hang)
    if device.type == "cuda":
        # This process ends here anyway: exit at once, graphs and group as they are, rather than free graphs that
        # captured collectives and leave an NCCL group (slow, and seen to hang: docs/design.md, "Tensor
        # parallelism").
        os._exit(0)
    destroy_tp_group()  # rank 0 stopped us: nothing is pending


def _exit_without_driver(lifeline: Connection) -> None:
    try:
        lifeline.recv()  # the driver never writes: this returns or raises only when its end closes
    except (EOFError, OSError):
        pass
    os._exit(1)


# -- helpers ---------------------------------------------------------------------------------------------------


def _check_devices(config: EngineConfig, size: int) -> None:
    last = rank_device(config.device, size - 1, size)
    if last.type == "cuda" and last.index >= torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size={size} needs GPUs {rank_device(config.device, 0, size)} to {last}, but "
            f"{torch.cuda.device_count()} are visible"
        )


def _wait_for_joining(workers: list[_Worker]) -> None:
    """Wait until every worker has started and is joining the group; raise ``WorkerError`` for one that died
    first (an import error, say), instead of waiting for the rendezvous to time out."""
    waiting = {w.reports: w for w in workers}
    sentinels = {w.process.sentinel: w for w in workers}
    while waiting:
        ready = wait(list(waiting) + list(sentinels), timeout=COLLECTIVE_TIMEOUT.total_seconds())
        if not ready:
            raise WorkerError(f"{len(waiting)} tensor-parallel worker(s) did not start within {COLLECTIVE_TIMEOUT}")
        for conn in ready:
            if conn in sentinels:
                w = sentinels[conn]
                w.process.join()
                w.report = _read_report(w.reports)
                raise WorkerError(_describe(w))
        for conn in ready:
            if conn in waiting:
                w = waiting.pop(conn)
                try:
                    conn.recv()
                except EOFError:
                    w.process.join()
                    raise WorkerError(_describe(w)) from None


def _read_report(reports: Connection) -> str | None:
    text = None
    try:
        while reports.poll():
            message = reports.recv()
            if message[0] == "failed":
                text = message[1]
    except (EOFError, OSError):
        pass
    return text


def _describe(w: _Worker) -> str:
    code = w.process.exitcode
    if code is not None and code < 0:
        how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
    else:
        how = f"exited with code {code}"
    text = f"tensor-parallel worker rank {w.rank} (pid {w.process.pid}) {how}"
    if w.report:
        last = w.report.strip().splitlines()[-1]
        text += f" after an error: {last}\n{w.report}"
    return text


def _kill(workers: list[_Worker]) -> None:
    for w in workers:
        if w.process.is_alive():
            w.process.kill()
    for w in workers:
        w.process.join()
