"""AsyncEngine in-process (no HTTP): a cancelled submit, a poisoned request, failed steps and a dead engine,
admission limits, deltas, unread outputs, time limits and the drain. (Over HTTP: test_reliability.py.)"""

import asyncio
import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from lockstep.config import EngineConfig
from lockstep.engine.llm_engine import LLMEngine
from lockstep.sampling_params import SamplingParams
from lockstep.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    RequestTimeoutError,
    ServingLimits,
    ShuttingDownError,
    SlowReaderError,
    _Delta,
)


def make_engine(model_dir: Path, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=256, **config))


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return make_engine(tiny_model_dir)


def reqs(prefix: str, n: int = 1, prompt: tuple = (1, 2, 3), **params) -> list:
    p = SamplingParams(**({"temperature": 0, "max_tokens": 4, "ignore_eos": True} | params))
    return [(f"{prefix}-{i}", list(prompt), p) for i in range(n)]


async def finals(group) -> dict:
    return {out.request_id: out async for out in group if out.finished}


def bits(out) -> tuple:
    return out.token_ids, [x.hex() for x in out.token_logprobs], out.finish_reason


def assert_idle(engine: LLMEngine) -> None:
    deadline = time.monotonic() + 10
    blocks = engine.scheduler.block_manager
    while engine.has_unfinished_requests() or blocks.num_free_blocks != blocks.num_blocks:
        assert time.monotonic() < deadline, "requests or KV blocks still held"
        time.sleep(0.02)
    engine.scheduler.check_integrity()


def run(engine: LLMEngine, main, limits: ServingLimits | None = None):
    """``main(async_engine)`` on a fresh AsyncEngine over ``engine``, stopped afterwards."""

    async def go():
        ae = AsyncEngine(engine, limits=limits)
        try:
            return await main(ae)
        finally:
            ae.stop()

    return asyncio.run(go())


class Gate:
    """Holds the engine thread before it applies the next call, until ``open()``."""

    def __init__(self, ae: AsyncEngine) -> None:
        self.event, self.add = threading.Event(), ae._add
        ae._add = self._held

    def _held(self, cmd, queued) -> None:
        self.event.wait(10)
        self.add(cmd, queued)

    def open(self) -> None:
        self.event.set()


def test_a_submit_cancelled_before_the_engine_applies_it_leaves_the_thread_alive(engine: LLMEngine) -> None:
    # Issue 13, reproducer 6: set_result on the cancelled future raised InvalidStateError in the engine thread,
    # which died; every later request hung or got 500.
    async def main(ae: AsyncEngine):
        gate = Gate(ae)
        task = asyncio.ensure_future(ae.submit(reqs("cancelled")))
        await asyncio.sleep(0.1)  # queued; the engine thread waits at the gate
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.open()
        out = await finals(await ae.submit(reqs("after")))
        assert ae.alive and ae.status == "ok" and list(out) == ["after-0"]
        assert engine.scheduler.get("cancelled-0") is None

    run(engine, main)
    assert_idle(engine)


def test_a_poisoned_request_fails_its_call_alone(engine: LLMEngine) -> None:
    solo = {
        "greedy-0": bits(run(engine, lambda ae: _one(ae, reqs("greedy", logprobs=1)))["greedy-0"]),
        "sampled-0": bits(run(engine, lambda ae: _one(ae, reqs("sampled", temperature=0.9, seed=5)))["sampled-0"]),
    }

    async def main(ae: AsyncEngine):
        poison = reqs("poison", temperature=0.9, seed=1)
        poison[0][2].temperature = float("nan")  # past validation, as a bug would be
        gate = Gate(ae)  # the three calls reach the engine together and share their steps
        tasks = [asyncio.ensure_future(_one(ae, r)) for r in (reqs("greedy", logprobs=1), poison)]
        tasks.append(asyncio.ensure_future(_one(ae, reqs("sampled", temperature=0.9, seed=5))))
        await asyncio.sleep(0.1)
        gate.open()
        return await asyncio.gather(*tasks, return_exceptions=True)

    greedy, poisoned, sampled = run(engine, main)
    assert isinstance(poisoned, RequestFailedError) and "NaN or -inf" in poisoned.detail
    assert {"greedy-0": bits(greedy["greedy-0"]), "sampled-0": bits(sampled["sampled-0"])} == solo
    assert_idle(engine)


async def _one(ae: AsyncEngine, requests: list) -> dict:
    return await finals(await ae.submit(requests))


def test_failed_steps_fail_their_calls_then_a_broken_engine_is_dead(tiny_model_dir: Path) -> None:
    # A fault of a whole step fails the calls in flight (500) and the engine carries on; after
    # MAX_CONSECUTIVE_STEP_FAILURES in a row it is dead: calls get 503, health says so, on_fatal fires.
    from lockstep.server.openai_api import build_app
    from lockstep.server.state import ServerState

    engine = make_engine(tiny_model_dir)
    fatal = threading.Event()

    def broken_step():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async def main(ae: AsyncEngine):
        ae.on_fatal = fatal.set
        good = await finals(await ae.submit(reqs("good")))
        engine.step = broken_step
        for i in range(2):
            with pytest.raises(RequestFailedError, match="engine step"):
                await finals(await ae.submit(reqs(f"fails{i}")))
            assert ae.alive
        with pytest.raises(EngineDeadError):
            await finals(await ae.submit(reqs("dies")))
        assert fatal.wait(5) and not ae.alive and "3 steps failed in a row" in ae.status
        with pytest.raises(EngineDeadError):
            await ae.submit(reqs("late"))
        state = ServerState(ae, engine.tokenizer, "tiny", "tiny", "fp_x", {"lockstep": "test"})
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"].startswith("engine failed")
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        return good

    assert len(run(engine, main)["good-0"].token_ids) == 4


def test_a_dead_tensor_parallel_worker_kills_the_engine_at_once(tiny_model_dir: Path) -> None:
    # Under tensor parallelism a worker's death leaves the ranks out of step for good: the first failed step is
    # fatal (503, on_fatal), not the third, so an orchestrator restarts the server instead of it failing every step.
    engine = make_engine(tiny_model_dir, tensor_parallel_size=2)
    fatal = threading.Event()

    async def main(ae: AsyncEngine):
        ae.on_fatal = fatal.set
        good = await finals(await ae.submit(reqs("good")))
        os.kill(engine.workers.pids[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await finals(await ae.submit(reqs("dies")))
        assert fatal.wait(5) and not ae.alive and "rank 1" in ae.status, ae.status
        return good

    try:
        assert len(run(engine, main)["good-0"].token_ids) == 4
    finally:
        engine.close()


def test_a_fault_in_the_loop_itself_kills_the_engine_and_is_reported(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)

    async def main(ae: AsyncEngine):
        def bug(out):
            raise KeyError("a bug in the engine loop")

        ae._delta = bug
        waiting = asyncio.ensure_future(_one(ae, reqs("first", max_tokens=50)))
        with pytest.raises(EngineDeadError):
            await waiting
        assert "KeyError" in ae.status

    run(engine, main)


def test_admission_limits(tiny_model_dir: Path) -> None:
    # Waiting sequences and tokens are capped (429 with a Retry-After), a call that could never be queued is a
    # ValueError (400), and every call either runs to the end or is refused whole.
    engine = make_engine(tiny_model_dir, max_num_seqs=2)
    limits = ServingLimits(max_queued_seqs=4, max_queued_tokens=40, max_seqs_per_request=3, retry_after=2.5)

    async def main(ae: AsyncEngine):
        with pytest.raises(ValueError, match="needs 4 sequences"):
            await ae.submit(reqs("big", 4))
        with pytest.raises(ValueError, match="hold 41 tokens"):
            await ae.submit(reqs("long", 1, prompt=tuple(range(41))))
        gate = Gate(ae)
        calls = [reqs("a", 2), reqs("b", 2), reqs("c", 1), reqs("d", 1, prompt=tuple(range(37)))]
        tasks = [asyncio.ensure_future(_one(ae, c)) for c in calls]
        await asyncio.sleep(0.1)
        gate.open()
        return await asyncio.gather(*tasks, return_exceptions=True)

    a, b, c, d = run(engine, main, limits)
    assert sorted(a) == ["a-0", "a-1"] and sorted(b) == ["b-0", "b-1"]
    assert isinstance(c, EngineOverloadedError) and c.status == 429 and c.retry_after == 2.5
    assert isinstance(d, EngineOverloadedError)  # 4 sequences waiting already
    assert_idle(engine)


def test_outputs_travel_as_deltas_and_add_up(engine: LLMEngine) -> None:
    # Issue 13, reproducer 10: each queued item copied the whole output so far. Now each holds one step's tokens.
    params = dict(temperature=0.8, seed=2, max_tokens=12, logprobs=2, stop=["~~"])

    async def main(ae: AsyncEngine):
        group = await ae.submit(reqs("d", **params))
        while group.finished is False and engine.has_unfinished_requests():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        items = list(group._items)
        return items, await finals(group)

    items, out = run(engine, main)
    assert all(isinstance(i, _Delta) and len(i.token_ids) == 1 and len(i.logprobs) == 1 for i in items)
    assert len(items) == 12 and sum(len(i.piece) for i in items) >= len(out["d-0"].text)
    whole = run(engine, lambda ae: _one(ae, reqs("w", **params)))["w-0"]
    assert bits(out["d-0"]) == bits(whole) and out["d-0"].text == whole.text
    assert out["d-0"].logprobs == whole.logprobs
    assert_idle(engine)


def test_a_consumer_that_stops_reading_loses_its_requests(engine: LLMEngine) -> None:
    for limits in (ServingLimits(unread_timeout=0.3), ServingLimits(max_unread_outputs=5)):

        async def main(ae: AsyncEngine):
            group = await ae.submit(reqs("slow", max_tokens=200))
            await asyncio.sleep(0.5)  # read nothing
            deadline = time.monotonic() + 20
            while engine.has_unfinished_requests():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert len(group._items) == 1  # the unread outputs were dropped
            with pytest.raises(SlowReaderError):
                await finals(group)

        run(engine, main, limits)
        assert_idle(engine)


def test_a_call_past_its_time_limit_is_stopped(engine: LLMEngine) -> None:
    async def main(ae: AsyncEngine):
        with pytest.raises(RequestTimeoutError, match="time limit"):
            await finals(await ae.submit(reqs("slow", max_tokens=200)))

    run(engine, main, ServingLimits(request_timeout=0.3))
    assert_idle(engine)


def test_drain_refuses_new_calls_and_ends_late_ones(engine: LLMEngine, monkeypatch) -> None:
    # Steps of at least 5 ms: the long call (1000 steps) cannot end inside the 0.5 s drain however fast the machine
    # (unslowed, it did on an idle one); the short one (3 steps) ends well inside it.
    step = engine.step

    def slow_step():
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)

    async def main(ae: AsyncEngine):
        short = asyncio.ensure_future(_one(ae, reqs("short", max_tokens=3)))
        long = asyncio.ensure_future(_one(ae, reqs("long", max_tokens=1000)))  # far longer than the drain
        await asyncio.sleep(0.1)
        ae.drain(0.5)
        assert ae.status == "shutting down"
        with pytest.raises(ShuttingDownError):
            await ae.submit(reqs("new"))
        assert list(await short) == ["short-0"]  # in flight: finishes
        with pytest.raises(ShuttingDownError, match="shut down before"):
            await long

    run(engine, main)
    assert_idle(engine)


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_seqs_per_request \\(8\\) must be <= max_queued_seqs \\(4\\)"):
        ServingLimits(max_queued_seqs=4, max_seqs_per_request=8)
    for bad in ({"max_queued_seqs": 0}, {"request_timeout": float("nan")}, {"unread_timeout": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServingLimits(**bad)
    assert dataclasses.replace(ServingLimits(), request_timeout=None).request_timeout is None


def test_a_server_state_of_dummy_weights_needs_no_weight_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``serve --load-format dummy`` (benchmarks): a folder with config and tokenizer but no safetensors serves, and
    its fingerprint says the weights are dummy rather than hashing files that are not there."""
    import shutil

    from lockstep.server.state import create_state

    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    state = create_state(str(folder), load_format="dummy", max_num_seqs=2)
    try:
        assert state.fingerprint_parts["weights_blake2b"] == "dummy"
        assert state.fingerprint.startswith("fp_")
    finally:
        state.engine.stop()
