"""vLLM's LLM.beam_search on the tiny model: width 1 is greedy decoding, every beam's scores are its steps'
logprobs, and a prompt's beams are the same bits alone, among other prompts, under chunked prefill, with one
sequence at a time and with async scheduling."""

import struct
from pathlib import Path

import pytest

from lockstep.beam_search import beam_score
from lockstep.llm import LLM
from lockstep.sampling_params import BeamSearchParams, SamplingParams

TARGET = [5, 17, 42, 8, 63, 21, 3, 77, 9]
OTHERS = [[12, 40, 40, 7, 91, 33], [70, 3, 3, 3, 19, 44, 80, 6, 25, 14, 57, 38, 29]]
PARAMS = BeamSearchParams(beam_width=3, max_tokens=5)


def make(folder: Path, **kwargs) -> LLM:
    return LLM(str(folder), block_size=4, num_kv_blocks=512, **kwargs)


def beam_bits(output) -> list[tuple]:
    """Each sequence's tokens, summed logprob and candidate dicts, floats as their bit patterns."""
    f = lambda x: struct.pack("<d", x)
    steps = lambda seq: tuple(tuple((t, f(lp.logprob), lp.rank) for t, lp in d.items()) for d in seq.logprobs)
    return [(tuple(s.tokens), f(s.cum_logprob), steps(s), s.finish_reason) for s in output.sequences]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return make(tiny_model_dir)


@pytest.fixture(scope="module")
def alone(llm: LLM) -> list[tuple]:
    [out] = llm.beam_search([TARGET], PARAMS)
    return beam_bits(out)


def test_width_one_is_greedy_decoding(llm: LLM) -> None:
    [out] = llm.beam_search([TARGET], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    [seq] = out.sequences
    [greedy] = llm.generate([TARGET], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert seq.tokens == TARGET + greedy.token_ids and seq.finish_reason == "length"
    assert seq.cum_logprob == sum(greedy.token_logprobs)  # the same fp64 sum, in the same order
    assert seq.text == llm.get_tokenizer().decode(seq.tokens)


def test_beams_are_ranked_by_the_scores_of_their_steps(llm: LLM, alone: list[tuple]) -> None:
    [out] = llm.beam_search([TARGET], PARAMS)
    assert beam_bits(out) == alone and len(out.sequences) == 3
    scores = [beam_score(s, llm.engine.eos_token_ids[0], 1.0) for s in out.sequences]
    assert scores == sorted(scores, reverse=True) and len({tuple(s.tokens) for s in out.sequences}) == 3
    for seq in out.sequences:
        generated = seq.tokens[len(TARGET) :]
        assert seq.cum_logprob == sum(d[t].logprob for d, t in zip(seq.logprobs, generated, strict=True))
        # Each step's candidates are what a plain request for that prefix reports: the top 2k, ranks 1..2k.
        for j, step in enumerate(seq.logprobs):
            prefix = seq.tokens[: len(TARGET) + j]
            [plain] = llm.generate([prefix], SamplingParams(temperature=0, max_tokens=1, logprobs=6), use_tqdm=False)
            assert plain.logprobs[0] == step and sorted(v.rank for v in step.values()) == list(range(1, 7))
    # The search found more than the greedy path: a beam other than the first differs from it by step 2.
    assert out.sequences[1].tokens[: len(TARGET) + 2] != out.sequences[0].tokens[: len(TARGET) + 2]


@pytest.mark.parametrize(
    "settings",
    [{}, {"max_num_batched_tokens": 8, "max_num_seqs": 8}, {"max_num_seqs": 1}, {"async_scheduling": True}],
    ids=["others", "chunked_8", "one_seq", "async"],
)
def test_a_prompts_beams_are_the_same_bits_in_any_batch(tiny_model_dir: Path, alone: list[tuple], settings) -> None:
    outs = make(tiny_model_dir, **settings).beam_search([OTHERS[0], TARGET, OTHERS[1]], PARAMS)
    assert beam_bits(outs[1]) == alone
    assert beam_bits(outs[0]) != alone  # the harness tells prompts apart


def test_bad_parameters_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=2, temperature=0.7)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=2)
    with pytest.raises(ValueError, match="max_logprobs"):  # 2 * 11 candidates past vLLM's default cap of 20
        llm.beam_search([TARGET], BeamSearchParams(beam_width=11, max_tokens=1))
