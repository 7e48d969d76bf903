"""Run a function on N CPU processes joined in a gloo group, for the tensor-parallel tests, without ever hanging.

Each worker runs with one thread, joins the group through a file store, calls ``fn(group, *args)`` and saves
what it returns; a worker that raises exits at once (torch's process context then stops the others), a
collective that waits past ``COLLECTIVE_TIMEOUT`` raises in the worker, and the parent kills whatever is still
running at its own deadline.
"""

import datetime
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def _worker(rank: int, fn: Callable, size: int, folder: str, args: tuple) -> None:
    torch.set_num_threads(1)
    from lockstep.distributed import destroy_tp_group, init_tp_group

    group = init_tp_group(rank, size, f"file://{folder}/store", timeout=COLLECTIVE_TIMEOUT)
    try:
        result = fn(group, *args)
        torch.save(result, f"{folder}/rank{rank}.pt")
    finally:
        destroy_tp_group()


def run_ranks(fn: Callable, size: int, *args, timeout: float = 300.0) -> list:
    """``[fn(group, *args) for each rank]``, computed by ``size`` spawned processes (``fn`` must be importable:
    a module-level function). Raises if a worker fails or the whole run takes longer than ``timeout`` seconds."""
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(_worker, (fn, size, folder, args), nprocs=size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{size} tensor-parallel workers did not finish within {timeout:.0f} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        return [torch.load(Path(folder) / f"rank{rank}.pt") for rank in range(size)]
