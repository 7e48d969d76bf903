"""LLMEngine driven request by request: add_request's checks, step, and abort freeing a request mid-flight.
(LLM.generate end to end, and the invariance matrix, are in tests/test_llm.py.)"""

from pathlib import Path

import pytest

from lockstep.config import EngineConfig
from lockstep.engine.llm_engine import LLMEngine
from lockstep.outputs import OutputKind
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


def _bits(out) -> tuple:
    """Token ids and logprob bit patterns (float.hex tells -0.0 from 0.0, which == does not)."""
    return out.token_ids, [x.hex() for x in out.token_logprobs], out.finish_reason


def _run(engine: LLMEngine, requests: dict) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    return done


def test_a_poisoned_request_fails_alone_and_the_others_keep_their_bits(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 13, reproducer 1: one request whose row could not be sampled raised inside the shared step and failed
    # every request in it. Now each fault below aborts its own request, in the step where the others run too.
    good = {
        "greedy": ([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)),
        "sampled": ([9, 10, 11], SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True)),
        "penalised": ([5, 5, 6], SamplingParams(temperature=0.7, seed=4, max_tokens=6, repetition_penalty=1.3)),
        "stops": ([12, 13], SamplingParams(temperature=0.8, seed=5, max_tokens=6, stop=["zz"], ignore_eos=True)),
    }
    solo = {rid: _bits(_run(engine, {rid: r})[rid]) for rid, r in good.items()}
    other_seed = SamplingParams(temperature=0.9, seed=33, max_tokens=6, ignore_eos=True)
    assert _bits(_run(engine, {"control": (good["sampled"][0], other_seed)})["control"]) != solo["sampled"]

    nan_row = SamplingParams(temperature=0.8, seed=1, max_tokens=4)
    nan_row.temperature = float("nan")  # past validation, as a bug would be: every score NaN
    bad_bias = SamplingParams(temperature=0, max_tokens=4, logit_bias={1: 1.0})
    stop_check = SamplingParams(temperature=0, max_tokens=4, stop=["x"])
    update_text = engine._update_text

    def flaky(request) -> None:  # the stop-string check of one request raises
        if request.seq.request_id == "bad-stop-check":
            raise RuntimeError("boom")
        update_text(request)

    monkeypatch.setattr(engine, "_update_text", flaky)
    poisoned = {"bad-nan": ([1, 2, 3], nan_row), "bad-bias": ([4, 5], bad_bias), "bad-stop-check": ([6], stop_check)}
    requests = dict(list(good.items())[:2]) | poisoned | dict(list(good.items())[2:])
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    bad_bias.logit_bias = {engine.vocab_size + 1: 1.0}  # a token id past the vocabulary, after the check
    first = {o.request_id: o for o in engine.step()}
    assert set(first) == set(requests)  # they all shared the step
    done = {rid: o for rid, o in first.items() if o.finished}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    for rid in poisoned:
        assert done[rid].finish_reason == "abort", rid
    assert done["bad-nan"].token_ids == done["bad-bias"].token_ids == []  # no token sampled
    assert len(done["bad-stop-check"].token_ids) == 1  # sampled, then its check failed
    assert "NaN or -inf" in done["bad-nan"].outputs[0].error
    assert "IndexError" in done["bad-bias"].outputs[0].error
    assert "detokenizing failed: RuntimeError: boom" in done["bad-stop-check"].outputs[0].error
    assert {rid: _bits(done[rid]) for rid in good} == solo
    assert all(done[rid].outputs[0].error is None for rid in good)
    blocks = engine.scheduler.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
    engine.scheduler.check_integrity()


def test_the_floor_temperature_of_the_issue_is_greedy(engine: LLMEngine) -> None:
    # Issue 13's temperature (1e-300) now answers like temperature 0 rather than with garbage.
    ids = engine.tokenizer.encode("the the the of of and and Hello Hello")
    tiny = SamplingParams(temperature=1e-300, max_tokens=4, seed=1, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = _run(engine, {"tiny": (ids, tiny), "greedy": (ids, greedy)})
    assert _bits(got["tiny"]) == _bits(got["greedy"]) and got["tiny"].seed == 1


def test_delta_outputs_add_up_to_the_whole_output(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=7, ignore_eos=True, logprobs=1)
    whole = _run(engine, {"whole": ([3, 4, 5], params)})["whole"]
    engine.add_request("delta", [3, 4, 5], params, output_kind=OutputKind.DELTA)
    pieces = []
    while engine.has_unfinished_requests():
        pieces += engine.step()
    assert [len(p.token_ids) for p in pieces] == [1] * 7
    assert sum((p.token_ids for p in pieces), []) == whole.token_ids
    assert sum((p.token_logprobs for p in pieces), []) == whole.token_logprobs
    assert sum((p.logprobs for p in pieces), []) == whole.logprobs
    assert pieces[-1].text == whole.text and pieces[-1].finish_reason == "length"


def test_a_final_only_request_reports_once_when_it_ends(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=7, ignore_eos=True, logprobs=1)
    whole = _run(engine, {"whole": ([3, 4, 5], params)})["whole"]
    engine.add_request("final", [3, 4, 5], params, output_kind=OutputKind.FINAL_ONLY)
    engine.add_request("each", [6, 7], params)  # a cumulative neighbour still reports every step
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = [o for o in outputs if o.request_id == "final"]
    assert len(final) == 1 and final[0].finished
    assert _bits(final[0]) == _bits(whole) and final[0].logprobs == whole.logprobs
    assert len([o for o in outputs if o.request_id == "each"]) == 7


def test_a_long_prompt_never_stalls_decodes_for_more_than_one_chunk(tiny_model_dir: Path) -> None:
    # Issue 13, reproducer 4: the CPU's default budget put an 8k-token prompt in one step while decodes waited.
    # The budget now follows the device, and every step gives each running decode its token before prefill.
    assert LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu")).config.max_num_batched_tokens == 256
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_num_batched_tokens=16, max_num_seqs=4))
    engine.add_request("decoding", [1, 2, 3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    engine.add_request("long", list(range(3, 97)) * 2, SamplingParams(temperature=0, max_tokens=1))
    steps = 0
    while engine.scheduler.get("long") is not None:
        batch_outputs = engine.step()
        steps += 1
        assert [o.request_id for o in batch_outputs][:1] == ["decoding"]  # a token every step, first
    assert steps == -(-188 // 15)  # 15 prompt tokens a step beside the decode
