"""``AsyncEngine.run_on_engine`` (the server's weight updates and sleep): a call waits for the requests in flight, which
finish with their own bits; calls submitted after it wait behind it in order; while the engine sleeps a new request
is refused with ``EngineSleepingError`` (503) and nothing is queued; after waking the bits are those of before."""

import asyncio
from pathlib import Path

import pytest

from lockstep.config import EngineConfig
from lockstep.engine.llm_engine import LLMEngine
from lockstep.sampling_params import SamplingParams
from lockstep.server.async_engine import AsyncEngine, EngineSleepingError


def reqs(prefix: str, n: int = 2, max_tokens: int = 24) -> list:
    p = SamplingParams(temperature=0.8, seed=3, max_tokens=max_tokens, ignore_eos=True)
    return [(f"{prefix}-{i}", [(5 * i + j) % 90 + 1 for j in range(12)], p) for i in range(n)]


async def finals(group) -> dict:
    return {out.request_id: (out.outputs[0].token_ids, out.outputs[0].token_logprobs) async for out in group
            if out.finished}  # fmt: skip


@pytest.fixture(scope="module")
def async_engine(tiny_model_dir: Path):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), enable_sleep_mode=True, max_num_seqs=4))
    a = AsyncEngine(engine)
    yield a
    a.stop()


def test_sleep_waits_for_requests_in_flight_then_refuses_new_ones(async_engine):
    async def scenario():
        reference = await finals(await async_engine.submit(reqs("ref")))
        running = await async_engine.submit(reqs("run"))
        sleep = asyncio.ensure_future(async_engine.run_on_engine(lambda e: e.sleep(1)))
        await asyncio.sleep(0)
        # Submitted after the sleep: it waits behind it and is refused (nothing lost, nothing queued).
        with pytest.raises(EngineSleepingError):
            await async_engine.submit(reqs("late"))
        done = await finals(running)
        await sleep
        assert async_engine.engine.is_sleeping and not async_engine.engine.has_unfinished_requests()
        with pytest.raises(EngineSleepingError):
            await async_engine.submit(reqs("asleep"))
        await async_engine.run_on_engine(lambda e: e.wake_up())
        after = await finals(await async_engine.submit(reqs("ref2")))
        return reference, done, after

    reference, done, after = asyncio.run(scenario())
    # The running requests finished whole; the same prompts and seeds give the same bits before and after sleeping.
    assert list(done.values()) == list(reference.values()) == list(after.values())
    assert all(len(ids) == 24 for ids, _ in done.values())


def test_call_errors_reach_the_caller(async_engine):
    async def scenario():
        with pytest.raises(ValueError, match="level"):
            await async_engine.run_on_engine(lambda e: e.sleep(5))
        return await async_engine.run_on_engine(lambda e: e.reset_prefix_cache())

    assert asyncio.run(scenario()) is True
    assert async_engine.alive
