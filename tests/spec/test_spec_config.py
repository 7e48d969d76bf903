"""vLLM's speculative_config dict: what it takes, its defaults, and what it refuses by name."""

import pytest

from lockstep.config import EngineConfig
from lockstep.spec import SpeculativeConfig, make_drafter
from lockstep.spec.ngram import NgramDrafter


def test_ngram_defaults_follow_vllm() -> None:
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"


def test_a_model_without_method_is_a_draft_model() -> None:
    c = SpeculativeConfig.from_dict({"model": "/models/small", "num_speculative_tokens": 4})
    assert (c.method, c.model) == ("draft_model", "/models/small")


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 3}, "method must be one of"),
        ({"num_speculative_tokens": 3}, "method"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, 'needs "model"'),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "<="),
        ({"model": "/m", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, "apply to method 'ngram'"),
    ],
)
def test_refused(config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(config)


def test_eagle3_parses_and_needs_its_head() -> None:
    c = SpeculativeConfig.from_dict({"method": "eagle3", "model": "/m", "num_speculative_tokens": 3})
    assert (c.method, c.model, c.num_speculative_tokens) == ("eagle3", "/m", 3)
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        SpeculativeConfig.from_dict({"method": "eagle3", "num_speculative_tokens": 3})


def test_engine_config_parses_it_and_runs_synchronous_steps_unless_asked() -> None:
    c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, device="cpu")
    assert isinstance(c.speculative_config, SpeculativeConfig) and c.async_scheduling is False
    assert isinstance(make_drafter(c.speculative_config, c), NgramDrafter)
    c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, async_scheduling=True)
    assert c.async_scheduling is True


def test_eagle3_takes_async_scheduling_when_asked() -> None:
    # Its bits under async scheduling: tests/spec/test_eagle3.py::test_async_scheduling_gives_plain_decodings_bits.
    spec = {"method": "eagle3", "model": "/m", "num_speculative_tokens": 2}
    assert EngineConfig(speculative_config=spec, async_scheduling=True, device="cpu").async_scheduling is True
    assert EngineConfig(speculative_config=spec, device="cpu").async_scheduling is False
