"""Speculative decoding gives plain decoding's output, bit for bit (token ids, logprobs, top logprobs, text,
finish reasons), whatever the drafter proposes: n-gram lookup at k = 1, 3, 7, random tokens, an oracle that
proposes plain decoding's own continuation (so long runs are accepted), and a mix in one batch, so that rows
accept different lengths in the same step; with chunked prefill and preemption during speculation. The
negative control samples every row of a verify chunk with its first row's noise and must differ."""

import json
from pathlib import Path

import pytest
from tiny_models import TINY_CHARS, TINY_VOCAB

from lockstep import LLM, SamplingParams
from lockstep.config import EngineConfig
from lockstep.engine.llm_engine import LLMEngine
from lockstep.spec.invariance import (
    NGRAM,
    Garbage,
    Mixed,
    Oracle,
    all_bits,
    bits,
    choice_bits,
    one_noise_per_chunk,
    probe_requests,
    requests,
    run,
)

BLOCK = 4


def _ids(text: str) -> list[int]:
    return [TINY_CHARS.index(c) for c in text]


def _engine(model: Path, spec: dict | None = None, drafter=None, **overrides) -> LLMEngine:
    config = dict(model=str(model), block_size=BLOCK, num_kv_blocks=512, seed=0) | overrides
    engine = LLMEngine(EngineConfig(**config, speculative_config=spec))
    if drafter is not None:
        engine.drafter = drafter
    return engine


@pytest.fixture(scope="module")
def matrix(tiny_model_dir: Path):
    """The requests (lockstep.spec.invariance) and plain decoding's outputs for them (the reference), from one
    engine."""
    engine = _engine(tiny_model_dir)
    probe = run(engine, probe_requests(_ids))
    reqs = requests(_ids, engine.tokenizer.decode, probe)
    reference = run(engine, reqs)
    assert reference["stop"].outputs[0].finish_reason == "stop" and len(reference["stop"].outputs[0].token_ids) < 20
    assert len(reference["min_tokens"].outputs[0].token_ids) >= 8
    json.loads(reference["json"].outputs[0].text)  # the constraint held
    return reqs, reference


@pytest.mark.parametrize("k", [1, 3, 7])
def test_ngram_drafting_is_plain_decoding(tiny_model_dir: Path, matrix, k: int) -> None:
    reqs, reference = matrix
    engine = _engine(tiny_model_dir, NGRAM | {"num_speculative_tokens": k})
    assert all_bits(run(engine, reqs)) == all_bits(reference)
    assert engine.spec_stats.num_draft_tokens > 0


def test_oracle_drafts_are_accepted_and_change_nothing(tiny_model_dir: Path, matrix) -> None:
    reqs, reference = matrix
    oracle = Oracle(reference, reqs)
    engine = _engine(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 3}, oracle)
    assert all_bits(run(engine, reqs)) == all_bits(reference)
    stats = engine.spec_stats
    # Every draft is plain decoding's next tokens, so all are accepted: the accept path really ran, long runs
    # of it, through stop strings, min_tokens, the grammar and max_tokens cutting a run short.
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 50
    assert stats.mean_accepted_length > 3.5


def test_garbage_drafts_change_nothing(tiny_model_dir: Path, matrix) -> None:
    reqs, reference = matrix
    engine = _engine(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 4}, Garbage(TINY_VOCAB))
    assert all_bits(run(engine, reqs)) == all_bits(reference)
    assert engine.spec_stats.num_draft_tokens > 50


def test_rows_accepting_different_lengths_in_one_step(tiny_model_dir: Path, matrix) -> None:
    reqs, reference = matrix
    mixed = Mixed(Oracle(reference, reqs), TINY_VOCAB)
    engine = _engine(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 5}, mixed)
    assert all_bits(run(engine, reqs)) == all_bits(reference)
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sorted(mixed.released) == sorted(range(len(reqs)))  # every finished sequence was released
    # One request alone, with the same drafter, gives the same bits as in the batch.
    rid = "sampled"
    alone = run(_engine(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 5}, mixed), {rid: reqs[rid]})
    assert bits(alone[rid]) == bits(reference[rid])


def test_chunked_prefill_during_speculation(tiny_model_dir: Path, matrix) -> None:
    # A 12-token budget: verify chunks share steps with a long prompt's prefill chunks (and squeeze its drafts).
    reqs, reference = matrix
    long_prompt = {"long": (_ids("the quick brown fox jumps over the lazy dog " * 2), SamplingParams(max_tokens=8))}
    plain = run(_engine(tiny_model_dir, max_num_batched_tokens=12, max_num_seqs=8), {}, late=long_prompt)
    expected = all_bits(reference) | all_bits(plain)
    oracle = Oracle(reference | plain, reqs | long_prompt)
    engine = _engine(
        tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 3}, Mixed(oracle, TINY_VOCAB),
        max_num_batched_tokens=12, max_num_seqs=8,
    )  # fmt: skip
    assert all_bits(run(engine, reqs, late=long_prompt)) == expected
    assert engine.spec_stats.num_accepted_tokens > 0


def test_preemption_during_speculation(tiny_model_dir: Path, matrix) -> None:
    reqs, reference = matrix
    mixed = Mixed(Oracle(reference, reqs), TINY_VOCAB)
    engine = _engine(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 4}, mixed, num_kv_blocks=16)
    seqs = []
    real_add = engine.scheduler.add
    engine.scheduler.add = lambda seq: (seqs.append(seq), real_add(seq))[1]
    assert all_bits(run(engine, reqs)) == all_bits(reference)
    assert sum(s.num_preemptions for s in seqs) > 0
    assert engine.spec_stats.num_accepted_tokens > 0


def test_prefix_cache_holds_only_accepted_tokens(tiny_model_dir: Path, matrix) -> None:
    # Blocks that held rejected drafts must not be found as a cached prefix: a request whose prompt is another's
    # output reads the blocks speculation computed, and must get plain decoding's bits.
    reqs, reference = matrix
    engine = _engine(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 4}, Garbage(TINY_VOCAB))
    run(engine, reqs)
    prompt = reqs["greedy"][0] + list(reference["greedy"].outputs[0].token_ids[:16])
    follow = {"follow": (prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=1))}
    engine.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=1))
    seq = engine.scheduler.get("probe")
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.num_cached_tokens >= 16  # the speculated blocks were hit
    assert all_bits(run(engine, follow)) == all_bits(run(_engine(tiny_model_dir), follow))


def test_negative_control_one_noise_for_a_whole_chunk_differs(tiny_model_dir: Path, matrix) -> None:
    # The harness can see a difference: keying every row of a verify chunk by the first row's position (the
    # seed-per-step mistake) changes the sampled requests' tokens.
    reqs, reference = matrix
    engine = _engine(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 3}, Oracle(reference, reqs, False))
    with one_noise_per_chunk():
        got = all_bits(run(engine, {rid: reqs[rid] for rid in ("greedy", "sampled", "penalised")}))
    want = all_bits(reference)
    assert got["greedy"] == want["greedy"]  # greedy has no noise
    assert got["sampled"][0] != want["sampled"][0] and got["penalised"][0] != want["penalised"][0]


def test_llm_n2_with_speculative_config(tiny_model_dir: Path) -> None:
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=16, logprobs=1, ignore_eos=True)
    prompts = ["abcabcabc", "zzzz"]
    with LLM(str(tiny_model_dir), block_size=BLOCK, seed=0) as llm:
        plain = [[choice_bits(c) for c in o.outputs] for o in llm.generate(prompts, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with LLM(str(tiny_model_dir), block_size=BLOCK, seed=0, speculative_config=spec) as llm:
        got = [[choice_bits(c) for c in o.outputs] for o in llm.generate(prompts, params)]
        assert llm.engine.spec_stats.num_draft_tokens > 0
    assert got == plain
    assert plain[0][0] != plain[0][1]  # two different choices
