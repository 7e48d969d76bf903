"""Loading Hugging Face checkpoint folders: shards, tied heads, dtypes, configs, and every kind of bad input."""

import json
import shutil

import pytest
import torch
from paged_runner import PagedRunner
from safetensors.torch import load_file, save_file
from tiny_models import hf_logits, max_rel_err, save_tiny_hf

from lockstep.distributed import TPGroup
from lockstep.models.llama import ModelConfig
from lockstep.models.loader import load_model, load_tokenizer, read_config

TOKENS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def broken(llama_dir, tmp_path):
    """A writable copy of the tiny Llama checkpoint to damage."""
    return shutil.copytree(llama_dir, tmp_path / "ckpt")


def _logits(folder, **kwargs) -> torch.Tensor:
    return PagedRunner(load_model(folder, **kwargs)).prefill_logits("s", TOKENS)


def _edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _config_only(source, folder):
    """A folder with ``source``'s config.json and nothing else."""
    folder.mkdir()
    shutil.copy(source / "config.json", folder / "config.json")
    return folder


# --- checkpoints that load -----------------------------------------------------------------------------------


def test_sharded_checkpoint_loads_the_same_weights(llama_dir, tmp_path):
    sharded = save_tiny_hf(tmp_path / "sharded", "llama", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert torch.equal(_logits(sharded), _logits(llama_dir))


def test_tied_embeddings_share_one_tensor_and_match_transformers(tmp_path):
    folder = save_tiny_hf(tmp_path / "tied", "llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")
    model = load_model(folder)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert max_rel_err(_logits(folder), hf_logits(folder, TOKENS)) <= 1e-4


def test_missing_lm_head_falls_back_to_the_embedding(broken):
    weights = load_file(broken / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, broken / "model.safetensors", {"format": "pt"})
    model = load_model(broken)
    assert model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_weights_are_converted_to_the_requested_dtype(llama_dir, dtype):
    model = load_model(llama_dir, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    reference = load_file(llama_dir / "model.safetensors")["model.layers.1.self_attn.k_proj.weight"]
    q, kv = model.config.num_heads * model.config.head_dim, model.config.num_kv_heads * model.config.head_dim
    k_rows = model.model.layers[1].self_attn.qkv_proj.weight[q : q + kv]
    assert torch.equal(k_rows, reference.to(dtype))


def test_default_dtype_is_the_checkpoints(broken):
    _edit_config(broken, dtype="bfloat16")
    assert load_model(broken).dtype == torch.bfloat16


def test_old_style_rope_config_and_generation_config_eos(broken):
    config = json.loads((broken / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_theta"] = 500000.0
    config["rope_scaling"] = {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    (broken / "config.json").write_text(json.dumps(config))
    (broken / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    parsed = read_config(broken)
    assert parsed.rope_theta == 500000.0
    assert parsed.rope_scaling["rope_type"] == "llama3"
    assert parsed.eos_token_ids == (7, 9)


def test_mistral_sliding_window_caps_the_length():
    base = dict(
        architectures=["MistralForCausalLM"],
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32768,
    )
    assert ModelConfig.from_hf({**base, "sliding_window": 4096}).max_position_embeddings == 4096
    assert ModelConfig.from_hf({**base, "sliding_window": None}).max_position_embeddings == 32768


def test_tokenizer_loads_with_its_chat_template(smollm_tokenizer):
    text = smollm_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in text


# --- bad input -----------------------------------------------------------------------------------------------


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")


def test_missing_config(broken):
    (broken / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(broken)


def test_config_that_is_not_json(broken):
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_model(broken)


def test_unsupported_architecture(broken):
    _edit_config(broken, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(broken)


def test_unsupported_rope_type(broken):
    _edit_config(broken, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(ValueError, match="config.json: unsupported rope type 'yarn'"):
        load_model(broken)


def test_config_missing_a_key(broken):
    config = json.loads((broken / "config.json").read_text())
    del config["hidden_size"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json: missing key 'hidden_size'"):
        load_model(broken)


def test_no_weights(broken):
    (broken / "model.safetensors").rename(broken / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights .*pytorch_model\.bin"):
        load_model(broken)


def test_truncated_safetensors(broken):
    path = broken / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(broken)


def test_corrupt_safetensors_header(broken):
    path = broken / "model.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage garbage" + b"\x00" * 64)
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        load_model(broken)


def test_missing_tensor(broken):
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors", {"format": "pt"})
    with pytest.raises(ValueError, match="missing tensor.*'model.layers.1.mlp.up_proj.weight'"):
        load_model(broken)


def test_unexpected_tensor(broken):
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.0.mlp.experts.0.weight"] = torch.zeros(2)
    save_file(weights, broken / "model.safetensors", {"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mlp.experts.0.weight'"):
        load_model(broken)


def test_shape_mismatch(broken):
    _edit_config(broken, intermediate_size=96)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.mlp.\w+_proj.weight' has shape"):
        load_model(broken)


def test_missing_shard(tmp_path):
    sharded = save_tiny_hf(tmp_path / "sharded", "llama", max_shard_size="40KB")
    shard = sorted(sharded.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(sharded)


def test_missing_tokenizer(llama_dir):
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(llama_dir)


# --- load_format="dummy" ---------------------------------------------------------------------------------------


def test_dummy_weights_need_only_the_config(llama_dir, tmp_path):
    folder = _config_only(llama_dir, tmp_path / "config-only")
    with pytest.raises(FileNotFoundError, match="no \\*\\.safetensors"):
        load_model(folder)  # the default format reads a checkpoint
    model = load_model(folder, load_format="dummy")
    tensors = model.checkpoint_tensors()
    again = load_model(folder, load_format="dummy").checkpoint_tensors()
    assert all(torch.equal(t, again[name]) for name, t in tensors.items())  # the same draw every time
    assert all((t - 1).abs().max() < 1 for name, t in tensors.items() if "norm" in name)
    logits = PagedRunner(model).prefill_logits("s", TOKENS)
    assert logits.isfinite().all() and 0.1 < logits.std() < 10  # of order one: no ties, no overflow
    assert not torch.equal(logits, _logits(llama_dir))  # not the checkpoint's weights
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_model(folder, load_format="pt")


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_dummy_weights_are_the_same_at_every_tp_size(tmp_path, arch):
    # Each rank draws every tensor whole and keeps its slice: rank r of N holds the one-process model's slice.
    folder = _config_only(save_tiny_hf(tmp_path / "ckpt", arch), tmp_path / "config-only")
    whole = load_model(folder, load_format="dummy").checkpoint_tensors()
    for size in (2, 4):
        for rank in range(size):
            # Building and filling needs no collectives, so any rank can be made in this process.
            part = load_model(folder, load_format="dummy", tp=TPGroup(rank=rank, size=size))
            shards = part.checkpoint_shards()
            for name, got in part.checkpoint_tensors().items():
                shard = shards.get(name)
                expected = whole[name] if shard is None else whole[name][shard.index()]
                assert torch.equal(got, expected), f"TP {size} rank {rank}: {name}"
