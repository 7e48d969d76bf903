"""The tensor-parallel engine's worker processes: a worker killed between or during steps makes the engine raise a
clear error naming the rank, with no process left behind; an interrupted step stops the workers; ``close()`` stops
them cleanly; a killed or interrupted driver takes its workers with it. Real processes, real signals (gloo, CPU)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from lockstep.distributed.channel import INITIAL_CAPACITY
from lockstep.engine.tp_workers import WorkerError
from lockstep.llm import LLM
from lockstep.sampling_params import SamplingParams

PROMPTS = [[5, 17, 42, 8, 63], [12, 40, 40, 7, 91, 33]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_llm(folder: Path, size: int) -> LLM:
    return LLM(str(folder), tensor_parallel_size=size, block_size=4, num_kv_blocks=64)


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie waiting to be reaped counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] != "Z"


def wait_gone(pids: list[int], deadline: float = 60.0) -> list[int]:
    """The ``pids`` still running after up to ``deadline`` seconds (none, normally at once)."""
    end = time.monotonic() + deadline
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_a_worker_killed_between_calls(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir, 2)
    first = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    [pid] = llm.engine.workers.pids
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match=rf"rank 1 \(pid {pid}\) was killed by signal 9 \(SIGKILL\)"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    # The engine stays failed, says why, and has nothing left running; its requests were aborted.
    with pytest.raises(WorkerError, match="rank 1"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert wait_gone([pid]) == []
    llm.close()
    assert len(first) == 2


def test_a_worker_killed_mid_generate(tiny_model_dir: Path) -> None:
    llm = make_llm(tiny_model_dir, 4)
    pids = llm.engine.workers.pids
    victim = llm.engine.workers.workers[1]  # rank 2
    steps = []
    schedule = llm.engine.scheduler.schedule

    def kill_at_the_third_step():
        batch = schedule()
        steps.append(batch)
        if len(steps) == 3:
            os.kill(victim.process.pid, signal.SIGKILL)
            victim.process.join()  # dead before rank 0 sends this step
        return batch

    llm.engine.scheduler.schedule = kill_at_the_third_step
    with pytest.raises(WorkerError, match=r"rank 2 .* was killed by signal 9") as info:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert "rank 1 " not in str(info.value) and "rank 3 " not in str(info.value)  # the others were stopped
    assert len(steps) == 3
    assert wait_gone(pids) == []
    llm.close()


def test_an_interrupted_step_stops_the_workers(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C on rank 0 in the middle of a forward: the workers wait in a collective that rank 0 will never join,
    # so the engine stops them and cannot run further steps.
    llm = make_llm(tiny_model_dir, 2)
    pids = llm.engine.workers.pids

    def interrupt(hidden):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.engine.runner.model, "compute_logits", interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert wait_gone(pids) == []
    monkeypatch.undo()
    with pytest.raises(WorkerError, match="rank 0 stopped mid-step \\(KeyboardInterrupt"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.close()


@pytest.mark.parametrize("big_steps", [False, True])
def test_close_stops_the_workers_cleanly(tiny_model_dir: Path, big_steps: bool) -> None:
    # big_steps: step messages past the control channel's first buffer, which then grows inside the runner's
    # inference mode; the stop message written into it afterwards once failed, and the workers were killed.
    prompts = PROMPTS
    if big_steps:
        llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, max_num_batched_tokens=2048, num_kv_blocks=1024)
        prompts = [[(7 * i + j) % 90 for j in range(200)] for i in range(8)]
    else:
        llm = make_llm(tiny_model_dir, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed stop message is a RuntimeWarning
        with llm:
            llm.generate(prompts, PARAMS, use_tqdm=False)
            assert llm.engine.workers.channel.capacity > INITIAL_CAPACITY or not big_steps
            workers = llm.engine.workers.workers
    assert [w.process.exitcode for w in workers] == [0]  # left the group and returned, not killed
    with pytest.raises(RuntimeError, match="stopped \\(close\\(\\)\\)"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.close()  # again: nothing happens


def test_bad_tp_settings_fail_before_any_process_starts(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="num_attention_heads=4 cannot be split evenly over a tensor-parallel size"):
        LLM(str(tiny_model_dir), tensor_parallel_size=8)
    with pytest.raises(ValueError, match="tensor-parallel sizes dividing 8"):
        LLM(str(tiny_model_dir), tensor_parallel_size=3)


def test_settings_every_rank_rejects_raise_rank_0s_own_error(tiny_model_dir: Path) -> None:
    # Found once the workers load the model: the ValueError itself, not a worker failure, and the workers stopped.
    with pytest.raises(ValueError, match="max_model_len=999 exceeds the model's 256 positions"):
        LLM(str(tiny_model_dir), tensor_parallel_size=2, max_model_len=999)
    make_llm(tiny_model_dir, 2).close()  # the group was left: a new engine starts


DRIVER = textwrap.dedent(
    """
    import signal
    import sys
    from lockstep import LLM, SamplingParams

    if __name__ == "__main__":
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if started in background
        llm = LLM(sys.argv[1], tensor_parallel_size=2, block_size=4, num_kv_blocks=64)
        print("workers", *llm.engine.workers.pids, flush=True)
        params = SamplingParams(temperature=0, max_tokens=250, ignore_eos=True)
        while True:  # until a signal ends it
            llm.generate([[1, 2, 3]], params, use_tqdm=False)
    """
)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_a_driver_that_dies_takes_its_workers_along(tiny_model_dir: Path, tmp_path: Path, how: str) -> None:
    # SIGKILL: no cleanup runs in the driver; each worker sees its lifeline close and exits. SIGINT to the whole
    # process group, as Ctrl-C in a terminal: the workers ignore it, the driver's KeyboardInterrupt stops them.
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    # TMPDIR: a killed driver cannot remove its rendezvous folder; let it be the test's.
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"), TMPDIR=str(tmp_path))
    driver = subprocess.Popen(
        [sys.executable, str(script), str(tiny_model_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, like a terminal's foreground job
    )
    try:
        line = driver.stdout.readline()
        assert line.startswith("workers"), driver.stderr.read()
        pids = [int(p) for p in line.split()[1:]]
        assert pids and all(alive(p) for p in pids)
        time.sleep(1.0)  # well into a generate call
        if how == "SIGKILL":
            driver.kill()
        else:
            os.killpg(driver.pid, signal.SIGINT)
        driver.wait(timeout=120)
        assert wait_gone(pids) == [], "worker processes outlived their driver"
        if how == "SIGINT":
            assert "KeyboardInterrupt" in driver.stderr.read()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


LAUNCHED = textwrap.dedent(
    """
    import json
    import sys
    from lockstep import LLM, SamplingParams

    if __name__ == "__main__":
        # Every launched process builds the LLM; rank 1 serves rank 0 inside the constructor and exits when rank 0
        # closes, so only rank 0 gets here.
        llm = LLM(sys.argv[1], tensor_parallel_size=2, block_size=4, num_kv_blocks=64)
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)
        [out] = llm.generate([[5, 17, 42, 8, 63, 21, 3]], params, use_tqdm=False)
        print("RESULT", json.dumps([out.outputs[0].token_ids, out.outputs[0].token_logprobs]), flush=True)
        llm.close()
    """
)


def test_processes_launched_by_torchrun_join_through_env(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The multi-node path (README): torch.distributed's standard rendezvous, here on one machine.
    import json

    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    proc = subprocess.run([*cmd, str(tiny_model_dir)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    tokens, logprobs = json.loads(line.split(" ", 1)[1])
    llm = LLM(str(tiny_model_dir), tp_invariant=True, block_size=4, num_kv_blocks=64)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)
    [out] = llm.generate([[5, 17, 42, 8, 63, 21, 3]], params, use_tqdm=False)
    assert (tokens, logprobs) == (out.outputs[0].token_ids, out.outputs[0].token_logprobs)
