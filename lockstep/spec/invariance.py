"""The speculative-decoding invariance matrix's parts: its requests, drafters that stress the verify step, a run
loop that checks the scheduler after every step, and the bits an output is compared by. One copy, shared by the
CPU tests (tests/spec/test_speculative.py) and the GPU run of the matrix (bench/spec_matrix.py).

The requests are written as text and encoded with the model's tokenizer (``encode``), so any tokenizer that has a
token for each printable ASCII character serves: the tests' one-token-per-character tokenizer, the bench's for the
Qwen3-8B shape. The drafters propose plain decoding's own continuation (``Oracle``: every draft accepted), random
ids, some not token ids at all (``Garbage``), or a mix per sequence (``Mixed``: rows of one step accept different
lengths). ``one_noise_per_chunk`` is the negative control: it keys every row of a verify chunk by its first row's
position (the seed-per-step mistake), which must change sampled requests' tokens.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from lockstep.outputs import RequestOutput
from lockstep.sampling_params import SamplingParams
from lockstep.structured.params import StructuredOutputsParams

Requests = dict[str, tuple[list[int], SamplingParams]]

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def probe_requests(encode: Callable[[str], list[int]]) -> Requests:
    """Run these first (plain decoding): ``requests`` picks its stop string and stop token from their outputs."""
    return {
        "stop": (encode("mnmnmnmn"), SamplingParams(temperature=0.9, seed=9, max_tokens=12, ignore_eos=True)),
        "min_tokens": (encode("rsrsrs"), SamplingParams(temperature=0.9, seed=2, max_tokens=8, ignore_eos=True)),
    }


def requests(
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    probe: dict[str, RequestOutput],
    max_tokens: int = 20,
    json: bool = True,
) -> Requests:
    """The matrix's requests, each ``max_tokens`` long at most (the JSON one twice that): greedy with top
    logprobs; seeded T=0.8 with top-k, top-p and min-p; seeded with repetition, presence and frequency penalties;
    a logit bias; a JSON schema (``json``; needs llguidance); prompt logprobs; vLLM's token controls; a stop string
    first seen mid-way (the text of the probe's output tokens 6 and 7); a stop token held back by ``min_tokens``.
    Prompts repeat themselves, so the n-gram drafter finds something to propose."""
    n = max_tokens
    reqs: Requests = {
        "greedy": (encode("abcabcabcabc"), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3)),
        "sampled": (
            encode("xyzxyzxy"),
            SamplingParams(
                temperature=0.8, seed=11, top_k=30, top_p=0.9, min_p=0.02, max_tokens=n, ignore_eos=True, logprobs=2
            ),
        ),
        "penalised": (
            encode("hello hello"),
            SamplingParams(
                temperature=0.7,
                seed=5,
                repetition_penalty=1.3,
                presence_penalty=0.4,
                frequency_penalty=0.2,
                max_tokens=n,
                ignore_eos=True,
            ),
        ),
        "bias": (encode("1212121"), SamplingParams(temperature=0, logit_bias={10: 2.5, 20: -1.0}, max_tokens=n)),
    }
    if json:
        schema = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        reqs["json"] = (encode("name: "), SamplingParams(temperature=0, max_tokens=2 * n, structured_outputs=schema))
    reqs |= {
        "prompt_lp": (encode("qwqwqwqw"), SamplingParams(temperature=0, prompt_logprobs=2, max_tokens=n // 2)),
        # "a" is the favourite, banned right after an "a": plain decoding gives "abab...", which the n-gram drafter
        # proposes, and a verify row's ban must read the drafts before it, as plain decoding's does.
        "banned": (
            encode("abcabcab"),
            SamplingParams(
                temperature=0,
                max_tokens=n,
                ignore_eos=True,
                allowed_token_ids=encode("abc"),
                bad_words=["aa"],
                logit_bias={encode("a")[0]: 50.0, encode("b")[0]: 40.0},
            ),
        ),
    }
    stop = decode(list(probe["stop"].outputs[0].token_ids[6:8]))
    reqs["stop"] = (encode("mnmnmnmn"), SamplingParams(temperature=0.9, seed=9, max_tokens=n, stop=[stop]))
    token = probe["min_tokens"].outputs[0].token_ids[2]
    reqs["min_tokens"] = (
        encode("rsrsrs"),
        SamplingParams(temperature=0.9, seed=2, max_tokens=n, min_tokens=8, stop_token_ids=[token]),
    )
    return reqs


def run(engine, reqs: Requests, late: Requests | None = None) -> dict[str, RequestOutput]:
    """Every request's final output from ``engine`` (an ``LLMEngine``); ``late`` requests join after two steps.
    Checks the scheduler's and block manager's invariants after every step and that every block is free at the
    end (AssertionError otherwise)."""
    for rid, (prompt, params) in reqs.items():
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
    if bm.num_free_blocks != bm.num_blocks:
        raise AssertionError(f"{bm.num_blocks - bm.num_free_blocks} KV blocks still held after the run")
    return done


def bits(out: RequestOutput) -> tuple:
    """What must not change: token ids, logprob bits, top logprob bits (with ranks), text, finish reason and
    prompt logprob bits."""
    c = out.outputs[0]
    top = None if c.logprobs is None else [{t: (lp.logprob.hex(), lp.rank) for t, lp in d.items()} for d in c.logprobs]
    prompt = None
    if out.prompt_logprobs is not None:
        prompt = [None if d is None else {t: lp.logprob.hex() for t, lp in d.items()} for d in out.prompt_logprobs]
    return c.token_ids, [x.hex() for x in c.token_logprobs], top, c.text, c.finish_reason, prompt


def all_bits(outputs: dict[str, RequestOutput]) -> dict[str, tuple]:
    return {rid: bits(o) for rid, o in sorted(outputs.items())}


def choice_bits(c) -> tuple:
    """``bits`` of one choice of an ``LLM.generate`` output (a ``CompletionOutput``)."""
    top = None if c.logprobs is None else [{t: (lp.logprob.hex(), lp.rank) for t, lp in d.items()} for d in c.logprobs]
    return c.token_ids, [x.hex() for x in c.token_logprobs], top, c.text, c.finish_reason


class Oracle:
    """Proposes plain decoding's own continuation of the sequence (from the reference outputs); ``strict``: raise
    when a sequence is not a prefix of any (it went where plain decoding did not)."""

    def __init__(self, reference: dict[str, RequestOutput], reqs: Requests, strict: bool = True) -> None:
        self.full = [reqs[rid][0] + list(out.outputs[0].token_ids) for rid, out in reference.items()]
        self.strict = strict

    @classmethod
    def of(cls, full: list[list[int]], strict: bool = True) -> "Oracle":
        """The oracle of whole sequences (prompt + plain decoding's output each)."""
        oracle = cls({}, {}, strict)
        oracle.full = [list(f) for f in full]
        return oracle

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
    """Random token ids below ``vocab`` (and, at every fifth length, a last one that is not a token id, which the
    engine must cut off)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def propose(self, requests) -> list[list[int]]:
        out = []
        for r in requests:
            rng = np.random.default_rng(r.seq_id * 7919 + len(r.token_ids))
            tokens = rng.integers(0, self.vocab, r.num_tokens).tolist()
            if len(r.token_ids) % 5 == 0:
                tokens[-1] = self.vocab + 3  # out of range: cut there
            out.append(tokens)
        return out

    def release(self, seq_id: int) -> None:
        pass


class Mixed:
    """Per sequence (by ``seq_id % 3``): the oracle's continuation, random tokens, or the oracle's first half then
    wrong tokens, so the rows of one step accept different lengths. Records the released sequences."""

    def __init__(self, oracle: Oracle, vocab: int) -> None:
        self.oracle, self.garbage, self.vocab, self.released = oracle, Garbage(vocab), vocab, []

    def propose(self, requests) -> list[list[int]]:
        out = []
        for r, junk in zip(requests, self.garbage.propose(requests), strict=True):
            good = self.oracle.continuation(r.token_ids, r.num_tokens)
            half = len(good) // 2
            out.append([good, junk, good[:half] + [(t + 1) % self.vocab for t in good[half:]]][r.seq_id % 3])
        return out

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


@contextmanager
def one_noise_per_chunk() -> Iterator[None]:
    """The negative control: while active, every row of a verify chunk samples with the noise of the chunk's first
    row (keyed by one position, the seed-per-step mistake); sampled requests' tokens must then differ."""
    from lockstep.engine import model_runner

    real = model_runner._sample_position
    model_runner._sample_position = lambda e, j: e.start + e.num_fed
    try:
        yield
    finally:
        model_runner._sample_position = real
