"""Speculative decoding under async scheduling gives plain decoding's bits (sync and async alike): token ids,
logprob and top-logprob bits, text, finish reasons and prompt logprobs, over test_speculative's request matrix
(greedy, seeded T = 0.8 with top-k / top-p / min-p, penalties, a JSON schema, stop strings, min_tokens), with n-gram,
garbage, oracle and mixed drafters (rows accepting different lengths in one step), chunked prefill, preemption,
``n = 2`` and the draft-model drafter. The overlap must really happen: steps run ahead, and verify chunks whose
first token is fed on the device (drafted one token behind) run. The negative control shifts the fed token of
those verify chunks and must differ."""

from pathlib import Path

import pytest
import test_draft_model
import test_speculative
from test_draft_model import E2E_PARAMS, PROMPTS, output_bits
from test_speculative import BLOCK, _engine, _ids
from tiny_models import TINY_VOCAB

from lockstep import LLM, SamplingParams
from lockstep.engine import llm_engine
from lockstep.engine.llm_engine import LLMEngine
from lockstep.engine.token_feed import FedRows
from lockstep.spec.invariance import NGRAM, Garbage, Mixed, Oracle, all_bits, choice_bits

# The fixtures of the synchronous tests: their requests, reference outputs and models.
matrix, draft_dir, plain_bits = test_speculative.matrix, test_draft_model.draft_dir, test_draft_model.plain_bits


def _run(engine: LLMEngine, requests: dict, late: dict | None = None) -> dict:
    """test_speculative's ``_run`` for an overlapped engine: the scheduler's invariants are checked after every
    step that leaves no verify step in flight (one in flight holds blocks for its drafts, given back once it is
    read), and every block is free at the end."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests() or (late and steps < 2) or engine._in_flight is not None:
        done |= {o.request_id: o for o in engine.step() if o.finished}
        if engine._in_flight is None or not engine._in_flight.batch.has_drafts:
            engine.scheduler.check_integrity()
        steps += 1
        if late and steps == 2:
            for rid, (prompt, params) in late.items():
                engine.add_request(rid, prompt, params)
    engine.scheduler.check_integrity()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return done


def watch(engine: LLMEngine) -> list[tuple[bool, bool]]:
    """``(fed, has_drafts)`` of every step the engine launches (a list filled as steps run)."""
    seen: list[tuple[bool, bool]] = []
    launch = engine.runner.launch

    def spy(batch, feed=None):
        seen.append((feed is not None, batch.has_drafts))
        return launch(batch, feed)

    engine.runner.launch = spy
    return seen


class Sometimes:
    """Another drafter's proposals at every other call, nothing at the rest: as an n-gram lookup that finds a match
    only sometimes. A step without drafts runs ahead (one verify row would make the whole step wait), so the next
    one drafts one token behind."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def propose(self, requests) -> list[list[int]]:
        self.calls += 1
        return self.inner.propose(requests) if self.calls % 2 else [[] for _ in requests]

    def release(self, seq_id: int) -> None:
        self.inner.release(seq_id)


def drafter_for(case: str, requests: dict, reference: dict):
    if case == "garbage":
        return Garbage(TINY_VOCAB)
    if case == "oracle":
        return Oracle(reference, requests)
    if case == "mixed":
        return Mixed(Oracle(reference, requests), TINY_VOCAB)
    if case in ("sometimes", "preemption"):
        return Sometimes(Mixed(Oracle(reference, requests), TINY_VOCAB))
    return None  # the n-gram drafter the config names


OVERLAPPING = ("greedy", "sampled", "bias", "prompt_lp", "stop", "min_tokens")
CASES = {
    "ngram_k1": ({"num_speculative_tokens": 1}, {}),
    "ngram_k3": ({"num_speculative_tokens": 3}, {}),
    "garbage": ({"num_speculative_tokens": 4}, {}),
    "oracle": ({"num_speculative_tokens": 3}, {}),
    "mixed": ({"num_speculative_tokens": 5}, {}),
    "sometimes": ({"num_speculative_tokens": 3}, {}),
    "preemption": ({"num_speculative_tokens": 4}, {"num_kv_blocks": 16}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_async_speculation_is_plain_decoding(tiny_model_dir: Path, matrix, case: str) -> None:
    requests, reference = matrix
    spec, overrides = CASES[case]
    engine = _engine(
        tiny_model_dir, NGRAM | spec, drafter_for(case, requests, reference), async_scheduling=True, **overrides
    )
    seqs = []
    add = engine.scheduler.add
    engine.scheduler.add = lambda seq: (seqs.append(seq), add(seq))[1]
    assert all_bits(_run(engine, requests)) == all_bits(reference)
    # Penalties, grammars and bad words read every step back before the next: the overlap shows without them.
    steps = watch(engine)
    assert all_bits(_run(engine, {rid: requests[rid] for rid in OVERLAPPING})) == all_bits(
        {rid: reference[rid] for rid in OVERLAPPING}
    )
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0
    assert any(fed for fed, _ in steps)  # steps ran ahead, their newest tokens fed on the device
    if case != "garbage":  # a garbage drafter's drafts are rejected: its steps are verify steps, read back at once
        assert any(fed and drafts for fed, drafts in steps)  # verify chunks drafted one behind
    if case == "oracle":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if case == "mixed":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if case in ("sometimes", "preemption"):  # the drafter's misses run ahead: many verify chunks drafted one behind
        assert sum(fed and drafts for fed, drafts in steps) > 3
    if case == "preemption":
        assert sum(s.num_preemptions for s in seqs) > 0


def test_plain_async_reference_is_the_sync_one(tiny_model_dir: Path, matrix) -> None:
    # The "sync and async" half of the claim: plain decoding under async scheduling gives the reference too.
    requests, reference = matrix
    assert all_bits(_run(_engine(tiny_model_dir, async_scheduling=True), requests)) == all_bits(reference)


def test_async_chunked_prefill_during_speculation(tiny_model_dir: Path, matrix) -> None:
    requests, reference = matrix
    long_prompt = {"long": (_ids("the quick brown fox jumps over the lazy dog " * 2), SamplingParams(max_tokens=8))}
    budget = {"max_num_batched_tokens": 12, "max_num_seqs": 8}
    plain = _run(_engine(tiny_model_dir, **budget), {}, late=long_prompt)
    expected = all_bits(reference) | all_bits(plain)
    oracle = Oracle(reference | plain, requests | long_prompt)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    engine = _engine(tiny_model_dir, spec, Mixed(oracle, TINY_VOCAB), async_scheduling=True, **budget)
    steps = watch(engine)
    assert all_bits(_run(engine, requests, late=long_prompt)) == expected
    assert engine.spec_stats.num_accepted_tokens > 0 and any(fed and drafts for fed, drafts in steps)


def test_async_llm_n2_with_speculative_config(tiny_model_dir: Path) -> None:
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=16, logprobs=1, ignore_eos=True)
    prompts = ["abcabcabc", "zzzz"]
    with LLM(str(tiny_model_dir), block_size=BLOCK, seed=0) as llm:
        plain = [[choice_bits(c) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with LLM(str(tiny_model_dir), block_size=BLOCK, seed=0, speculative_config=spec, async_scheduling=True) as llm:
        got = [[choice_bits(c) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.spec_stats.num_draft_tokens > 0
    assert got == plain
    assert plain[0][0] != plain[0][1]


def test_async_draft_model(tiny_model_dir: Path, draft_dir: Path, plain_bits) -> None:
    # The target as its own draft (every greedy draft accepted) and an unrelated one (nearly none), overlapped.
    greedy = [SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)] * len(PROMPTS)
    mixed = [E2E_PARAMS[i % len(E2E_PARAMS)] for i in range(len(PROMPTS))]
    for draft, params in ((tiny_model_dir, greedy), (draft_dir, mixed)):
        spec = {"model": str(draft), "num_speculative_tokens": 3}
        llm = LLM(str(tiny_model_dir), block_size=BLOCK, speculative_config=spec, async_scheduling=True)
        steps = watch(llm.engine)
        assert output_bits(llm.generate(PROMPTS, params, use_tqdm=False)) == plain_bits(params)
        assert llm.engine.spec_stats.num_draft_tokens > 0
        assert any(fed for fed, _ in steps) or params is mixed  # E2E_PARAMS' penalties read every step back
        assert llm.engine.drafter.num_free_blocks == llm.engine.drafter.num_kv_blocks
    assert llm.engine.spec_stats.acceptance_rate < 0.15


def test_verify_steps_are_read_back_before_the_next(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A verify step's accepted count decides its sequences' lengths: it never runs ahead, and advancing one with
    # its tokens pending is refused.
    decided = []
    may_run_ahead = llm_engine._may_run_ahead

    def deciding(batch) -> bool:
        decided.append((batch.has_drafts, may_run_ahead(batch)))
        return decided[-1][1]

    monkeypatch.setattr(llm_engine, "_may_run_ahead", deciding)
    engine = _engine(tiny_model_dir, NGRAM | {"num_speculative_tokens": 3}, async_scheduling=True)
    prompts = {"a": (_ids("abcabcabcabc"), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))}
    _run(engine, prompts)
    assert (True, False) in decided and (False, True) in decided
    assert not any(drafts and ahead for drafts, ahead in decided)


def test_negative_control_a_wrong_fed_token_in_a_verify_chunk_differs(
    tiny_model_dir: Path, matrix, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The harness sees the verify chunks' fed rows: shifting their fed token changes the outputs.
    requests, reference = matrix
    engine = _engine(tiny_model_dir, NGRAM | {"num_speculative_tokens": 3}, async_scheduling=True)
    steps = watch(engine)
    write = FedRows.write

    def shifted(self: FedRows, input_ids) -> None:
        write(self, input_ids)
        if steps[-1][1]:  # only in verify steps
            input_ids[self.dst] = (input_ids[self.dst] + 1) % TINY_VOCAB

    monkeypatch.setattr(FedRows, "write", shifted)
    subset = {rid: requests[rid] for rid in ("greedy", "sampled")}
    got = all_bits(_run(engine, subset))
    assert any(fed and drafts for fed, drafts in steps)
    assert got["greedy"][0] != all_bits(reference)["greedy"][0]


def test_abort_with_a_verify_step_in_flight(tiny_model_dir: Path, matrix) -> None:
    # An abort between two calls, while a verify chunk drafted one behind is in flight for the request: its output
    # holds what was reported, its blocks come back, and the other requests keep their bits.
    requests, reference = matrix
    subset = {rid: requests[rid] for rid in OVERLAPPING}
    engine = _engine(
        tiny_model_dir, NGRAM | {"num_speculative_tokens": 3}, Oracle(reference, requests), async_scheduling=True
    )
    for rid, (prompt, params) in subset.items():
        engine.add_request(rid, prompt, params)
    done, aborted = {}, None
    while engine.has_unfinished_requests() or engine._in_flight is not None:
        done |= {o.request_id: o for o in engine.step() if o.finished}
        flight = engine._in_flight
        if aborted is None and flight is not None and flight.batch.has_drafts:
            entry = next(e for e in flight.batch.entries if e.drafts and e.seq.request_id in subset)
            aborted = engine.abort(entry.seq.request_id)
    assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    rid = aborted.request_id
    want = reference[rid].outputs[0]
    got = aborted.outputs[0]
    assert 0 < len(got.token_ids) < len(want.token_ids) and got.token_ids == want.token_ids[: len(got.token_ids)]
    assert all_bits({r: o for r, o in done.items() if r != rid}) == all_bits(
        {r: reference[r] for r in subset if r != rid}
    )
    engine.scheduler.check_integrity()
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
