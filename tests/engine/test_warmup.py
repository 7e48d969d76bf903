"""The start-up warm-up (engine/warmup.py; on CUDA it runs in LLMEngine's constructor): it leaves the engine as a
fresh one (no request, no cached prefix, the same draw of seeds, the same bits for later requests), and the
compile counter chains onto Triton's hook."""

from pathlib import Path

import pytest

from lockstep.config import EngineConfig
from lockstep.engine import warmup
from lockstep.engine.llm_engine import LLMEngine
from lockstep.sampling_params import SamplingParams


def _engine(folder: Path, budget: int = 40) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(folder), block_size=4, num_kv_blocks=64, max_num_batched_tokens=budget, max_num_seqs=8, seed=3
        )
    )


def _run(engine: LLMEngine) -> list[tuple]:
    requests = {
        "greedy": ([5, 6, 7, 8, 9, 10, 11], SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)),
        "drawn-seed": ([5, 6, 7, 8, 9, 10, 11], SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)),
    }
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    return [(o.token_ids, [x.hex() for x in o.token_logprobs], o.seed) for o in (done[r] for r in requests)]


@pytest.mark.parametrize("budget", [40, 128])
def test_warm_up_leaves_a_fresh_engine(tiny_model_dir: Path, budget: int) -> None:
    warmed = _engine(tiny_model_dir, budget)
    ran = warmup.warm_up(warmed)
    # Every length up to the step budget ran, and at 128 tokens the 3, the 16 and two 64-token requests sharing
    # steps too.
    shared = 3 + 16 + 2 if budget >= 128 else 0
    assert ran == len([n for n in warmup.WARMUP_LENGTHS if n <= budget]) + shared
    assert not warmed.has_unfinished_requests() and not warmed.scheduler.block_manager.hash_to_block_id
    assert warmed.scheduler.block_manager.num_free_blocks == warmed.config.num_kv_blocks
    assert _run(warmed) == _run(_engine(tiny_model_dir, budget))  # bits and the seed drawn for the unseeded request


def test_the_warm_up_shows_in_the_cache_until_it_is_forgotten(tiny_model_dir: Path, monkeypatch) -> None:
    # Negative control for the check above: without the final reset the warm-up prompts' blocks stay cached.
    engine = _engine(tiny_model_dir)
    monkeypatch.setattr(type(engine.scheduler.block_manager), "reset_prefix_cache", lambda self: None)
    warmup.warm_up(engine)
    assert engine.scheduler.block_manager.hash_to_block_id


def test_compile_counter_chains_onto_triton_hook(monkeypatch) -> None:
    import triton

    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda *a, **k: seen.append(1))
    monkeypatch.setattr(warmup, "_installed", False)
    before = warmup.compiled_kernels()
    triton.knobs.runtime.jit_post_compile_hook(key="k", repr="_kernel[num_warps=4](x: *fp32)")  # as Triton calls it
    assert warmup.compiled_kernels() == [*before, "_kernel[num_warps=4](x: *fp32)"] and seen == [1]
