"""SamplingParams: a default request does what vLLM's does, values are normalised, and a bad one is named with
its field."""

from pathlib import Path

import pytest
from tiny_models import TINY_EOS

from lockstep.llm import LLM
from lockstep.sampling_params import MIN_TEMPERATURE, SamplingParams

# What vLLM's SamplingParams() means, spelled out (top_k -1 and 0 both turn top-k off).
VLLM_DEFAULTS = dict(
    n=1, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
    repetition_penalty=1.0, max_tokens=16, stop=None, stop_token_ids=None, ignore_eos=False, logprobs=None,
    logit_bias=None,
)  # fmt: skip


def test_a_default_request_does_what_vllms_does(tiny_model_dir: Path) -> None:
    # vLLM's SamplingParams() samples at temperature 1 with no top-k, top-p, min-p or penalty, for at most 16
    # tokens, stopping at EOS. The default request here gives the same bits as those values spelled out with the
    # seed the engine drew for it; changing any one of them changes the tokens, so the comparison can see each.
    llm = LLM(str(tiny_model_dir), seed=0)
    [out] = llm.generate("hello", SamplingParams(), use_tqdm=False)
    assert out.seed is not None, "a default request is sampled: the engine draws it a seed"
    assert out.finish_reason == "length" and len(out.token_ids) == 16 and out.logprobs is None
    spelled = dict(VLLM_DEFAULTS, seed=out.seed)
    [same] = llm.generate("hello", SamplingParams(**spelled), use_tqdm=False)
    assert (same.token_ids, same.token_logprobs) == (out.token_ids, out.token_logprobs)
    for change in ({"temperature": 0.5}, {"temperature": 0}, {"top_k": 5}, {"top_p": 0.5}, {"min_p": 0.2},
                   {"presence_penalty": 1.0}, {"frequency_penalty": 1.0}, {"repetition_penalty": 1.3}):  # fmt: skip
        [other] = llm.generate("hello", SamplingParams(**spelled | change), use_tqdm=False)
        assert other.token_ids != out.token_ids, change
    [longer] = llm.generate("hello", SamplingParams(**spelled | {"max_tokens": 40}), use_tqdm=False)
    assert longer.token_ids[:16] == out.token_ids and len(longer.token_ids) == 40
    # EOS ends a default request (ignore_eos is off): forced first, it is the whole output.
    [eos] = llm.generate("hello", SamplingParams(logit_bias={TINY_EOS: 100}), use_tqdm=False)
    assert (eos.token_ids, eos.finish_reason, eos.text) == ([TINY_EOS], "stop", "")


def test_normalisation():
    p = SamplingParams(temperature=0, top_k=0, stop="\n\n", stop_token_ids=(7, 8), logprobs=0, seed=-3)
    assert p.greedy
    assert p.top_k == -1
    assert p.stop == ["\n\n"]
    assert p.stop_token_ids == [7, 8]
    assert p.logprobs == 0 and p.seed == -3
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(top_k=5, top_p=0.5).top_k == 5
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(repetition_penalty=1.1).penalized and not SamplingParams(repetition_penalty=1.0).penalized


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": -1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": 1.0}, "seed"),
        ({"seed": "42"}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
        ({"logprobs": -2}, "logprobs"),  # -1 is vLLM's whole vocabulary
        ({"logprobs": 1.5}, "logprobs"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"n": 0}, "n"),
        ({"n": 2.0}, "n"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": 1e308}, "repetition_penalty"),  # issue 13's poisoned request
        ({"repetition_penalty": 0.001}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"logit_bias": {-1: 2.0}}, "logit_bias"),
        ({"logit_bias": {"5": 2.0}}, "logit_bias"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {5: float("-inf")}}, "logit_bias"),
    ],
)
def test_invalid_values_name_field_and_value(kwargs, field):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    msg = str(err.value)
    assert msg.startswith(field)
    assert repr(next(iter(kwargs.values()))) in msg


def test_a_temperature_below_the_floor_is_greedy():
    # Issue 13: 1e-300 (or 1e-40) divided fp32 logits into infinities and NaN; below MIN_TEMPERATURE it is greedy,
    # as in vLLM. The floor itself still samples.
    for t in (1e-300, 1e-40, MIN_TEMPERATURE / 2):
        p = SamplingParams(temperature=t, seed=1)
        assert p.greedy and p.temperature == 0.0
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(repetition_penalty=0.01).repetition_penalty == 0.01
