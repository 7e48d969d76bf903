"""LLMEngine driven request by request: add_request's checks, step, and abort freeing a request mid-flight.
(LLM.generate end to end, and the invariance matrix, are in tests/test_llm.py.)"""

from pathlib import Path

import pytest

from lockstep.config import EngineConfig
from lockstep.engine.llm_engine import LLMEngine
from lockstep.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=512, seed=0))


def test_add_request_takes_one_sequence_and_unique_ids(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="one sequence per request"):
        engine.add_request("direct", [1, 2], SamplingParams(n=3, temperature=0.9, seed=41))
    engine.add_request("dup", [1, 2], SamplingParams(temperature=0, max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [3, 4], SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()


def test_engine_abort(engine: LLMEngine) -> None:
    blocks = engine.scheduler.block_manager
    free_before = blocks.num_free_blocks
    engine.add_request("keep", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.add_request("drop", [4, 5, 6], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    aborted = engine.abort("drop")
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 1
    assert engine.abort("drop") is None
    assert blocks.num_free_blocks == free_before - 1  # "drop"'s block is back; "keep" holds one
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep"] and len(finished[0].token_ids) == 4
    assert blocks.num_free_blocks == free_before
