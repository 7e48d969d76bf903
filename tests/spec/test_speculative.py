"""Speculative decoding gives plain decoding's output, bit for bit (token ids, logprobs, top logprobs, text,
finish reasons), whatever the drafter proposes: n-gram lookup at k = 1, 3, 7, random tokens, an oracle that
proposes plain decoding's own continuation (so long runs are accepted), and a mix in one batch, so that rows
accept different lengths in the same step; with chunked prefill and preemption during speculation. The
negative control samples every row of a verify chunk with its first row's noise and must differ."""

import json
from pathlib import Path

import numpy as np
import pytest
from tiny_models import TINY_VOCAB

from lockstep import LLM, SamplingParams, StructuredOutputsParams
from lockstep.config import EngineConfig
from lockstep.engine import model_runner
from lockstep.engine.llm_engine import LLMEngine

BLOCK = 4
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _ids(text: str) -> list[int]:
    from tiny_models import TINY_CHARS

    return [TINY_CHARS.index(c) for c in text]


# Repetitive prompts, so the n-gram drafter finds something to propose.
BASE = {
    "greedy": (_ids("abcabcabcabc"), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)),
    "sampled": (
        _ids("xyzxyzxy"),
        SamplingParams(
            temperature=0.8, seed=11, top_k=30, top_p=0.9, min_p=0.02, max_tokens=20, ignore_eos=True, logprobs=2
        ),
    ),
    "penalised": (
        _ids("hello hello"),
        SamplingParams(
            temperature=0.7,
            seed=5,
            repetition_penalty=1.3,
            presence_penalty=0.4,
            frequency_penalty=0.2,
            max_tokens=20,
            ignore_eos=True,
        ),
    ),  # fmt: skip
    "bias": (_ids("1212121"), SamplingParams(temperature=0, logit_bias={10: 2.5, 20: -1.0}, max_tokens=20)),
    "json": (_ids("name: "), SamplingParams(temperature=0, max_tokens=40, structured_outputs=None)),
    "prompt_lp": (_ids("qwqwqwqw"), SamplingParams(temperature=0, prompt_logprobs=2, max_tokens=10)),
    # vLLM's token controls: "a" is the favourite, banned right after an "a": plain decoding gives "abab...", which
    # the n-gram drafter proposes, and a verify row's ban must read the drafts before it, as plain decoding's does.
    "banned": (
        _ids("abcabcab"),
        SamplingParams(
            temperature=0,
            max_tokens=20,
            ignore_eos=True,
            allowed_token_ids=_ids("abc"),
            bad_words=["aa"],
            logit_bias={_ids("a")[0]: 50.0, _ids("b")[0]: 40.0},
        ),
    ),  # fmt: skip
}


def _requests(probe: dict) -> dict:
    """BASE, with the json request constrained, and two requests whose stops come from a probe's output: a stop
    string first seen mid-way, and a stop token held back by min_tokens."""
    reqs = dict(BASE)
    schema = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    reqs["json"] = (BASE["json"][0], SamplingParams(temperature=0, max_tokens=40, structured_outputs=schema))
    text = probe["stop"].outputs[0].text
    reqs["stop"] = (_ids("mnmnmnmn"), SamplingParams(temperature=0.9, seed=9, max_tokens=20, stop=[text[6:8]]))
    token = probe["min_tokens"].outputs[0].token_ids[2]
    reqs["min_tokens"] = (
        _ids("rsrsrs"),
        SamplingParams(temperature=0.9, seed=2, max_tokens=20, min_tokens=8, stop_token_ids=[token]),
    )
    return reqs


def _engine(model: Path, spec: dict | None = None, drafter=None, **overrides) -> LLMEngine:
    config = dict(model=str(model), block_size=BLOCK, num_kv_blocks=512, seed=0) | overrides
    engine = LLMEngine(EngineConfig(**config, speculative_config=spec))
    if drafter is not None:
        engine.drafter = drafter
    return engine


def _run(engine: LLMEngine, requests: dict, late: dict | None = None) -> dict:
    """Every request's final output; ``late`` requests join after two steps. Checks the scheduler's and block
    manager's invariants after every step and that every block is free at the end."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests() or (late and steps < 2):
        done |= {o.request_id: o for o in engine.step() if o.finished}
        engine.scheduler.check_integrity()
        steps += 1
        if late and steps == 2:
            for rid, (prompt, params) in late.items():
                engine.add_request(rid, prompt, params)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return done


def _bits(out) -> tuple:
    c = out.outputs[0]
    top = None if c.logprobs is None else [{t: (lp.logprob.hex(), lp.rank) for t, lp in d.items()} for d in c.logprobs]
    prompt = None
    if out.prompt_logprobs is not None:
        prompt = [None if d is None else {t: lp.logprob.hex() for t, lp in d.items()} for d in out.prompt_logprobs]
    return c.token_ids, [x.hex() for x in c.token_logprobs], top, c.text, c.finish_reason, prompt


def _all_bits(outputs: dict) -> dict:
    return {rid: _bits(o) for rid, o in sorted(outputs.items())}


class Oracle:
    """Proposes plain decoding's own continuation of the sequence (from the reference outputs)."""

    def __init__(self, reference: dict, requests: dict, strict: bool = True) -> None:
        self.full = [requests[rid][0] + list(out.outputs[0].token_ids) for rid, out in reference.items()]
        self.strict = strict

    def continuation(self, tokens: list[int], n: int) -> list[int]:
        for full in self.full:
            if full[: len(tokens)] == tokens:
                return full[len(tokens) : len(tokens) + n]
        if self.strict:
            raise AssertionError("a sequence went where plain decoding did not")
        return []

    def propose(self, requests) -> list[list[int]]:
        return [self.continuation(r.token_ids, r.num_tokens) for r in requests]

    def release(self, seq_id: int) -> None:
        pass


class Garbage:
    """Random token ids (and some that are not token ids at all, which the engine must cut off)."""

    def propose(self, requests) -> list[list[int]]:
        out = []
        for r in requests:
            rng = np.random.default_rng(r.seq_id * 7919 + len(r.token_ids))
            tokens = rng.integers(0, TINY_VOCAB, r.num_tokens).tolist()
            if len(r.token_ids) % 5 == 0:
                tokens[-1] = TINY_VOCAB + 3  # out of range: cut there
            out.append(tokens)
        return out

    def release(self, seq_id: int) -> None:
        pass


class Mixed:
    """Per sequence: the oracle's continuation, random tokens, or the oracle's first half then random tokens, so
    the rows of one step accept different lengths."""

    def __init__(self, oracle: Oracle) -> None:
        self.oracle, self.garbage, self.released = oracle, Garbage(), []

    def propose(self, requests) -> list[list[int]]:
        out = []
        for r, junk in zip(requests, self.garbage.propose(requests), strict=True):
            good = self.oracle.continuation(r.token_ids, r.num_tokens)
            half = len(good) // 2
            out.append([good, junk, good[:half] + [(t + 1) % TINY_VOCAB for t in good[half:]]][r.seq_id % 3])
        return out

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


@pytest.fixture(scope="module")
def matrix(tiny_model_dir: Path):
    """The requests and plain decoding's outputs for them (the reference), from one engine."""
    engine = _engine(tiny_model_dir)
    probe_params = SamplingParams(temperature=0.9, seed=9, max_tokens=12, ignore_eos=True)
    probe = _run(
        engine,
        {
            "stop": (_ids("mnmnmnmn"), probe_params),
            "min_tokens": (_ids("rsrsrs"), SamplingParams(temperature=0.9, seed=2, max_tokens=8, ignore_eos=True)),
        },
    )
    requests = _requests(probe)
    reference = _run(engine, requests)
    assert reference["stop"].outputs[0].finish_reason == "stop" and len(reference["stop"].outputs[0].token_ids) < 20
    assert len(reference["min_tokens"].outputs[0].token_ids) >= 8
    json.loads(reference["json"].outputs[0].text)  # the constraint held
    return requests, reference


NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.parametrize("k", [1, 3, 7])
def test_ngram_drafting_is_plain_decoding(tiny_model_dir: Path, matrix, k: int) -> None:
    requests, reference = matrix
    engine = _engine(tiny_model_dir, NGRAM | {"num_speculative_tokens": k})
    assert _all_bits(_run(engine, requests)) == _all_bits(reference)
    assert engine.spec_stats.num_draft_tokens > 0


def test_oracle_drafts_are_accepted_and_change_nothing(tiny_model_dir: Path, matrix) -> None:
    requests, reference = matrix
    oracle = Oracle(reference, requests)
    engine = _engine(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 3}, oracle)
    assert _all_bits(_run(engine, requests)) == _all_bits(reference)
    stats = engine.spec_stats
    # Every draft is plain decoding's next tokens, so all are accepted: the accept path really ran, long runs
    # of it, through stop strings, min_tokens, the grammar and max_tokens cutting a run short.
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 50
    assert stats.mean_accepted_length > 3.5


def test_garbage_drafts_change_nothing(tiny_model_dir: Path, matrix) -> None:
    requests, reference = matrix
    engine = _engine(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 4}, Garbage())
    assert _all_bits(_run(engine, requests)) == _all_bits(reference)
    assert engine.spec_stats.num_draft_tokens > 50


def test_rows_accepting_different_lengths_in_one_step(tiny_model_dir: Path, matrix) -> None:
    requests, reference = matrix
    mixed = Mixed(Oracle(reference, requests))
    engine = _engine(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 5}, mixed)
    assert _all_bits(_run(engine, requests)) == _all_bits(reference)
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sorted(mixed.released) == sorted(range(len(requests)))  # every finished sequence was released
    # One request alone, with the same drafter, gives the same bits as in the batch.
    rid = "sampled"
    alone = _run(_engine(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 5}, mixed), {rid: requests[rid]})
    assert _bits(alone[rid]) == _bits(reference[rid])


def test_chunked_prefill_during_speculation(tiny_model_dir: Path, matrix) -> None:
    # A 12-token budget: verify chunks share steps with a long prompt's prefill chunks (and squeeze its drafts).
    requests, reference = matrix
    long_prompt = {"long": (_ids("the quick brown fox jumps over the lazy dog " * 2), SamplingParams(max_tokens=8))}
    plain = _run(_engine(tiny_model_dir, max_num_batched_tokens=12, max_num_seqs=8), {}, late=long_prompt)
    expected = _all_bits(reference) | _all_bits(plain)
    oracle = Oracle(reference | plain, requests | long_prompt)
    engine = _engine(
        tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 3}, Mixed(oracle), max_num_batched_tokens=12,
        max_num_seqs=8,
    )  # fmt: skip
    assert _all_bits(_run(engine, requests, late=long_prompt)) == expected
    assert engine.spec_stats.num_accepted_tokens > 0


def test_preemption_during_speculation(tiny_model_dir: Path, matrix) -> None:
    requests, reference = matrix
    mixed = Mixed(Oracle(reference, requests))
    engine = _engine(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 4}, mixed, num_kv_blocks=16)
    seqs = []
    real_add = engine.scheduler.add
    engine.scheduler.add = lambda seq: (seqs.append(seq), real_add(seq))[1]
    assert _all_bits(_run(engine, requests)) == _all_bits(reference)
    assert sum(s.num_preemptions for s in seqs) > 0
    assert engine.spec_stats.num_accepted_tokens > 0


def test_prefix_cache_holds_only_accepted_tokens(tiny_model_dir: Path, matrix) -> None:
    # Blocks that held rejected drafts must not be found as a cached prefix: a request whose prompt is another's
    # output reads the blocks speculation computed, and must get plain decoding's bits.
    requests, reference = matrix
    engine = _engine(tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 4}, Garbage())
    _run(engine, requests)
    prompt = requests["greedy"][0] + list(reference["greedy"].outputs[0].token_ids[:16])
    follow = {"follow": (prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=1))}
    engine.add_request("probe", prompt, SamplingParams(temperature=0, max_tokens=1))
    seq = engine.scheduler.get("probe")
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.num_cached_tokens >= 16  # the speculated blocks were hit
    assert _all_bits(_run(engine, follow)) == _all_bits(_run(_engine(tiny_model_dir), follow))


def test_negative_control_one_noise_for_a_whole_chunk_differs(
    tiny_model_dir: Path, matrix, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The harness can see a difference: keying every row of a verify chunk by the first row's position (the
    # seed-per-step mistake) changes the sampled requests' tokens.
    requests, reference = matrix
    monkeypatch.setattr(model_runner, "_sample_position", lambda e, j: e.start + e.num_fed)
    engine = _engine(
        tiny_model_dir, {"method": "ngram", "num_speculative_tokens": 3}, Oracle(reference, requests, False)
    )
    got = _all_bits(_run(engine, {rid: requests[rid] for rid in ("greedy", "sampled", "penalised")}))
    want = _all_bits(reference)
    assert got["greedy"] == want["greedy"]  # greedy has no noise
    assert got["sampled"][0] != want["sampled"][0] and got["penalised"][0] != want["penalised"][0]


def test_llm_n2_with_speculative_config(tiny_model_dir: Path) -> None:
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=16, logprobs=1, ignore_eos=True)
    prompts = ["abcabcabc", "zzzz"]
    with LLM(str(tiny_model_dir), block_size=BLOCK, seed=0) as llm:
        plain = [[_bits_choice(c) for c in o.outputs] for o in llm.generate(prompts, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with LLM(str(tiny_model_dir), block_size=BLOCK, seed=0, speculative_config=spec) as llm:
        got = [[_bits_choice(c) for c in o.outputs] for o in llm.generate(prompts, params)]
        assert llm.engine.spec_stats.num_draft_tokens > 0
    assert got == plain
    assert plain[0][0] != plain[0][1]  # two different choices


def _bits_choice(c) -> tuple:
    return c.token_ids, [x.hex() for x in c.token_logprobs], c.text
