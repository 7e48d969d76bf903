"""A model folder's generation_config.json supplies the sampling defaults a request leaves out, as in vLLM
(``--generation-config auto``); ``"vllm"`` ignores it, a folder reads another one's."""

import json
import shutil
from pathlib import Path

import pytest

from lockstep import LLM, SamplingParams
from lockstep.models.loader import read_generation_defaults


def with_generation_config(src: Path, dst: Path, **values) -> Path:
    shutil.copytree(src, dst)
    file = dst / "generation_config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | values))
    return dst


def test_defaults_come_from_generation_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = with_generation_config(
        tiny_model_dir, tmp_path / "m", temperature=0.0, top_k=5, max_new_tokens=5, do_sample=True, num_beams=4
    )
    assert read_generation_defaults(folder) == {"temperature": 0.0, "top_k": 5, "max_tokens": 5}
    assert read_generation_defaults(tiny_model_dir) == {}  # eos and bos only: nothing to default

    llm = LLM(str(folder), seed=0)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=5, max_tokens=5)
    a, b = llm.generate(["hello", "hello"], use_tqdm=False)  # no params: greedy, 5 tokens
    assert len(a.token_ids) == 5 and a.token_ids == b.token_ids
    assert len(llm.generate("hello", SamplingParams(max_tokens=7), use_tqdm=False)[0].token_ids) == 7

    plain = LLM(str(folder), generation_config="vllm", seed=0)
    assert plain.get_default_sampling_params() == SamplingParams()  # vLLM's (and OpenAI's) defaults
    other = LLM(str(tiny_model_dir), generation_config=str(folder))
    assert other.get_default_sampling_params().max_tokens == 5


def test_bad_generation_configs_fail_before_loading(tiny_model_dir: Path, tmp_path: Path) -> None:
    bad = with_generation_config(tiny_model_dir, tmp_path / "bad", temperature=-1)
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        LLM(str(bad))
    with pytest.raises(FileNotFoundError, match="generation_config.json"):
        LLM(str(tiny_model_dir), generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="generation_config"):
        LLM(str(tiny_model_dir), generation_config="")
