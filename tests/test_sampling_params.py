import pytest

from lockstep.sampling_params import SamplingParams


def test_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (1.0, 1.0, -1, None, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and p.ignore_eos is False
    assert (p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias) == (0, 0, 0, 1, None)
    assert not p.greedy and not p.penalized
    assert SamplingParams(repetition_penalty=1.1).penalized and SamplingParams(logit_bias={}).logit_bias is None


def test_normalisation():
    p = SamplingParams(temperature=0, top_k=0, stop="\n\n", stop_token_ids=(7, 8), logprobs=0, seed=-3)
    assert p.greedy
    assert p.top_k == -1
    assert p.stop == ["\n\n"]
    assert p.stop_token_ids == [7, 8]
    assert p.logprobs == 0 and p.seed == -3
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(top_k=5, top_p=0.5).top_k == 5


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
        ({"logprobs": -1}, "logprobs"),
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
        ({"logit_bias": {-1: 2.0}}, "logit_bias"),
        ({"logit_bias": {"5": 2.0}}, "logit_bias"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
    ],
)
def test_invalid_values_name_field_and_value(kwargs, field):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    msg = str(err.value)
    assert msg.startswith(field)
    assert repr(next(iter(kwargs.values()))) in msg
