"""The n-gram drafter proposes what vLLM's prompt lookup proposes: hand-made cases, and a transcription of vLLM's
reversed-KMP search (vllm/v1/spec_decode/ngram_proposer.py) on random sequences."""

import numpy as np
import pytest

from lockstep.spec import DraftRequest, SpeculativeConfig
from lockstep.spec.ngram import NgramDrafter, lookup


@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, expected",
    [
        ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),  # suffix [2, 3] at 1: then 4, 1
        ([1, 2, 3, 4, 1, 2, 3], 2, 3, 3, [4, 1, 2]),  # the longer suffix [1, 2, 3] matches too
        ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),  # [5, 6] never occurred before
        ([1, 2, 3, 4, 1, 2, 3, 5, 6], 1, 2, 2, []),  # nor [6]
        ([1, 1, 1, 1], 1, 3, 3, [1]),  # overlapping occurrence: [1, 1, 1] at 0, one token after it
        ([5, 9, 7, 5, 9, 8, 5, 9], 2, 2, 3, [7, 5, 9]),  # two occurrences of [5, 9]: the earliest, like vLLM
        ([5, 9, 7, 1, 5, 9, 8, 1, 5, 9], 2, 3, 2, [8, 1]),  # [1, 5, 9] (length 3) beats the earlier [5, 9]
        ([3, 4, 3], 2, 2, 4, []),  # shorter than a match can be
        ([7], 1, 1, 3, []),
        ([1, 2, 1, 2, 1, 2], 2, 4, 5, [1, 2]),  # [1, 2, 1, 2] at 0; only two tokens follow
    ],
)
def test_lookup_hand_made(tokens: list[int], min_n: int, max_n: int, k: int, expected: list[int]) -> None:
    assert lookup(np.array(tokens, dtype=np.int64), min_n, max_n, k) == expected


def test_lookup_respects_max_model_len() -> None:
    tokens = np.array([1, 2, 3, 4, 1, 2, 3], dtype=np.int64)
    assert lookup(tokens, 2, 3, 3, max_model_len=9) == [4, 1]
    assert lookup(tokens, 2, 3, 3, max_model_len=7) == []


def _vllm_kmp(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's algorithm, written out step by step: KMP's failure function over the reversed sequence, capped at
    max_n; the last (so earliest in the original) position of the longest match wins."""
    total = len(tokens)
    if total < min_n or k <= 0:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n
    longest = position = prev = 0
    i = 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return tokens[start : start + min(k, total - start)]


def test_lookup_matches_vllm_on_random_sequences() -> None:
    rng = np.random.default_rng(0)
    checked = proposed = 0
    for _ in range(3000):
        total = int(rng.integers(1, 40))
        tokens = rng.integers(0, int(rng.integers(2, 6)), total).tolist()  # small alphabets: many repeats
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 8))
        expected = _vllm_kmp(tokens, min_n, max_n, k)
        assert lookup(np.array(tokens, dtype=np.int64), min_n, max_n, k) == expected, (tokens, min_n, max_n, k)
        checked += 1
        proposed += bool(expected)
    assert proposed > checked // 3  # the comparison saw real proposals, not only empty ones


def test_drafter_batches_requests() -> None:
    config = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    )
    drafter = NgramDrafter(config)
    out = drafter.propose([DraftRequest(0, [1, 2, 3, 4, 1, 2, 3], 2), DraftRequest(1, [9, 8], 4)])
    assert out == [[4, 1], []]
    drafter.release(0)
