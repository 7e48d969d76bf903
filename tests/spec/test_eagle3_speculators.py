"""EAGLE-3 heads in vLLM's "speculators" format (``models/speculators.py``): the same weights as a published-layout
head, written the speculators way (the layer's config in ``transformer_layer_config``, its tensors under
``layers.0.``), draft exactly what the published head drafts, call for call, and the output is plain decoding's,
bit for bit; the method and ``num_speculative_tokens`` come from the head's config when left out, as in vLLM; a
"qwen3" layer's q/k norms and the format's ``norm_before_residual`` default are computed (against the reference
forward, with the control that they change the proposals); malformed configs are ValueErrors that name the
problem."""

import json
from pathlib import Path

import pytest
import test_eagle3
import torch
from safetensors.torch import load_file, save_file
from test_eagle3 import (
    AUX,
    DRAFT_VOCAB,
    GREEDY,
    HEAD_DIM,
    PROMPTS,
    SEEDED,
    _bits,
    _llm,
    _recording,
    _reference_drafts,
    eagle3_config,
    random_head,
    save_head,
)

from lockstep import LLM
from lockstep.models.eagle3 import load_eagle3
from lockstep.models.loader import load_model
from lockstep.spec import SpeculativeConfig

target_dir, head_dir = test_eagle3.target_dir, test_eagle3.head_dir
PARAMS = [GREEDY, SEEDED] * 2


def speculators_config(model_type: str = "llama", k: int = 3, **overrides) -> dict:
    """A speculators EAGLE-3 ``config.json`` for the published ``eagle3_config()`` head's shapes."""
    published = eagle3_config()
    layer = {key: published[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "num_hidden_layers", "rms_norm_eps", "vocab_size", "max_position_embeddings",
             "rope_theta")}  # fmt: skip
    layer |= {"model_type": model_type, "architectures": ["LlamaForCausalLM"], "head_dim": HEAD_DIM,
              "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16"}  # fmt: skip
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": "tiny/llama", "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": DRAFT_VOCAB,
        "norm_before_residual": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": AUX,
        "torch_dtype": "bfloat16",
    } | overrides


def save_speculators(folder: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """``tensors`` (published names) saved under the speculators names, with a speculators ``config.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(speculators_config() if config is None else config))
    named = {k.replace("midlayer.", "layers.0.", 1): v.contiguous() for k, v in tensors.items()}
    save_file(named, folder / "model.safetensors")
    return folder


def _run(target: Path, spec: dict, **kw) -> tuple[list, list, LLM]:
    llm = LLM(str(target), block_size=4, num_kv_blocks=256, seed=0, enable_prefix_caching=False,
              speculative_config=spec, **kw)  # fmt: skip
    calls = _recording(llm)
    return _bits(llm.generate(PROMPTS, PARAMS, use_tqdm=False)), calls, llm


@pytest.mark.parametrize("explicit", [True, False], ids=["method-eagle3", "auto-detected"])
def test_a_speculators_head_drafts_what_its_published_twin_does(
    target_dir: Path, head_dir: Path, tmp_path: Path, explicit: bool
) -> None:
    tensors = load_file(head_dir / "model.safetensors")
    folder = save_speculators(tmp_path / "speculators", tensors)
    spec = {"model": str(folder), "num_speculative_tokens": 3} | ({"method": "eagle3"} if explicit else {})
    bits, calls, llm = _run(target_dir, spec)
    assert llm.engine.config.speculative_config.method == "eagle3" and llm.engine.drafter.head.config.speculators
    twin = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 3}
    twin_bits, twin_calls, _ = _run(target_dir, twin)
    assert calls == twin_calls and bits == twin_bits
    assert len(calls) >= 2 * len(PROMPTS) and len({tuple(p) for _, _, p in calls}) > len(calls) // 2  # real drafts
    assert bits == _bits(_llm(target_dir, None).generate(PROMPTS, PARAMS, use_tqdm=False))  # plain decoding's bits
    head, published = llm.engine.drafter.head.checkpoint_tensors(), load_file(head_dir / "model.safetensors")
    assert all(torch.equal(head[name], published[name]) for name in published if name != "t2d")


def test_num_speculative_tokens_defaults_to_the_proposal_methods(target_dir: Path, head_dir: Path, tmp_path: Path):
    """vLLM's default k for this format: the ``speculative_tokens`` of ``default_proposal_method`` (here the second
    of two methods), for the dict without ``num_speculative_tokens``; given, it wins."""
    config = speculators_config()
    config["speculators_config"]["proposal_methods"] = [
        {"proposal_type": "sampling", "speculative_tokens": 5},
        {"proposal_type": "greedy", "speculative_tokens": 2},
    ]
    folder = save_speculators(tmp_path / "k2", load_file(head_dir / "model.safetensors"), config)
    assert SpeculativeConfig.from_dict({"model": str(folder)}).num_speculative_tokens == 2
    assert SpeculativeConfig.from_dict({"method": "eagle3", "model": str(folder)}).num_speculative_tokens == 2
    assert SpeculativeConfig.from_dict({"model": str(folder), "num_speculative_tokens": 4}).num_speculative_tokens == 4
    _, calls, _ = _run(target_dir, {"model": str(folder)})
    assert max(k for _, k, _ in calls) == 2 and all(len(p) == k for _, k, p in calls)  # fewer only near max_tokens
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):  # a published head names no default
        SpeculativeConfig.from_dict({"method": "eagle3", "model": str(head_dir)})


def test_a_published_head_is_auto_detected_too_and_never_a_draft_model(head_dir: Path, tmp_path: Path) -> None:
    assert SpeculativeConfig.from_dict({"model": str(head_dir), "num_speculative_tokens": 2}).method == "eagle3"
    folder = save_speculators(tmp_path / "s", load_file(head_dir / "model.safetensors"))
    for head in (head_dir, folder):
        with pytest.raises(ValueError, match='is an EAGLE-3 head, not a draft model: use method "eagle3"'):
            SpeculativeConfig.from_dict({"method": "draft_model", "model": str(head), "num_speculative_tokens": 2})


def test_a_qwen3_layer_and_the_default_norm_before_residual_are_computed(target_dir: Path, tmp_path: Path) -> None:
    """A layer of model_type "qwen3" (the speculators library's default) has Qwen3's per-head q/k norms; a config
    without norm_before_residual means true for this format (vLLM's reading). The proposals are the reference
    forward with both; the reference without either differs (the control: both change what is drafted)."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(13)
    tensors = random_head(13)
    tensors["midlayer.self_attn.q_norm.weight"] = 1.0 + 0.5 * torch.randn(HEAD_DIM, generator=g)
    tensors["midlayer.self_attn.k_norm.weight"] = 1.0 + 0.5 * torch.randn(HEAD_DIM, generator=g)
    config = speculators_config("qwen3")
    del config["norm_before_residual"]
    folder = save_speculators(tmp_path / "qwen3", tensors, config)
    target = load_model(target_dir)
    head = load_eagle3(folder, target, target.kernels, 64)
    assert head.config.norm_before_residual and head.self_attn.q_norm is not None
    assert torch.equal(head.self_attn.k_norm.weight, tensors["midlayer.self_attn.k_norm.weight"])
    _, calls, _ = _run(target_dir, {"model": str(folder), "num_speculative_tokens": 3})
    target_hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    plain = {k: v for k, v in tensors.items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
    assert len(calls) >= 2 * len(PROMPTS)
    differ = 0
    for tokens, k, proposal in calls:
        assert proposal == _reference_drafts(target_hf, tensors, tokens, k, norm_before_residual=True), tokens
        differ += proposal != _reference_drafts(target_hf, plain, tokens, k)
    assert differ > len(calls) // 2


def _bad(change) -> tuple[dict, dict]:
    tensors, config = random_head(3), speculators_config()
    change(tensors, config)
    return tensors, config


def _layer(**kw):
    return lambda t, c: c["transformer_layer_config"].update(kw)


def _set(name: str, tensor: torch.Tensor):
    return lambda t, c: t.__setitem__(name, tensor)


def _spec(**kw):
    return lambda t, c: c["speculators_config"].update(kw)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda t, c: c.update(speculators_model_type="dflash"), "speculators_model_type 'dflash' is not supported"),
        (lambda t, c: c.pop("speculators_config"), "needs speculators_config"),
        (_spec(algorithm="eagle"), "speculators_config.algorithm is 'eagle', expected 'eagle3'"),
        (_spec(proposal_methods=[]), "proposal_methods must be a non-empty list"),
        (_spec(proposal_methods=[{"proposal_type": "greedy"}]), "speculative_tokens of 'greedy' must be an int >= 1"),
        (lambda t, c: c["speculators_config"].pop("verifier"), "speculators_config.verifier must be an object"),
        (lambda t, c: c.pop("transformer_layer_config"), "needs transformer_layer_config"),
        (_layer(model_type="mistral"), "transformer_layer_config.model_type 'mistral' is not supported"),
        (lambda t, c: c["transformer_layer_config"].pop("vocab_size"), "transformer_layer_config lacks vocab_size"),
        (_layer(num_hidden_layers=2), "heads of 2 layers are not supported"),
        (_layer(hidden_size=32), "hidden_size 32"),
        (lambda t, c: c.update(norm_before_fc=True), "norm_before_fc=true is not supported"),
        (lambda t, c: c.update(norm_output=True), "norm_output=true is not supported"),
        (lambda t, c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1]), "aux hidden-state layers"),
        (lambda t, c: t.pop("midlayer.self_attn.q_proj.weight"), "lacks layers.0.self_attn.q_proj.weight"),
        (
            _set("midlayer.mlp.down_proj.weight", torch.ones(64, 8)),
            r"layers.0.mlp.down_proj.weight has shape \[64, 8\]",
        ),
        (_layer(attention_bias=True), "lacks .*layers.0.self_attn.o_proj.bias"),
        (_layer(model_type="qwen3"), "lacks layers.0.self_attn.k_norm.weight, layers.0.self_attn.q_norm.weight"),
    ],
)
def test_a_malformed_speculators_head_is_a_value_error_naming_the_problem(
    target_dir: Path, tmp_path: Path, change, match: str
) -> None:
    tensors, config = _bad(change)
    folder = save_speculators(tmp_path / "bad", tensors, config)
    target = load_model(target_dir)
    with pytest.raises(ValueError, match=match):
        load_eagle3(folder, target, target.kernels, 64)


def test_a_malformed_speculators_head_fails_the_llm_by_name(target_dir: Path, tmp_path: Path) -> None:
    tensors, config = _bad(lambda t, c: c.update(fc_norm=True))
    folder = save_speculators(tmp_path / "bad", tensors, config)
    with pytest.raises(ValueError, match="fc_norm=true is not supported"):
        LLM(str(target_dir), block_size=4, speculative_config={"model": str(folder), "num_speculative_tokens": 2})
    config = speculators_config()
    config["speculators_config"]["proposal_methods"] = [{"proposal_type": "greedy", "speculative_tokens": 0}]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="speculative_tokens of 'greedy' must be an int >= 1, got 0"):
        SpeculativeConfig.from_dict({"model": str(folder)})


def test_published_tensor_names_in_a_speculators_folder_are_refused(target_dir: Path, tmp_path: Path) -> None:
    folder = save_speculators(tmp_path / "mixed", random_head(3))
    save_head(tmp_path / "published", random_head(3))
    save_file(load_file(tmp_path / "published" / "model.safetensors"), folder / "extra.safetensors")
    target = load_model(target_dir)
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) midlayer\..* in a speculators checkpoint"):
        load_eagle3(folder, target, target.kernels, 64)


def test_a_hub_head_is_recognised_from_its_config_alone(head_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """For a hub id only ``config.json`` is fetched to pick the method (faked here); where it cannot be fetched
    the model is a draft model, as before, and its own loader reports what is wrong."""
    import huggingface_hub

    folder = save_speculators(tmp_path / "hub", load_file(head_dir / "model.safetensors"))
    fetched = []

    def hf_hub_download(repo_id, filename, **kwargs):
        fetched.append((repo_id, filename))
        if repo_id != "org/head":
            raise OSError("no such repo")
        return str(folder / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    c = SpeculativeConfig.from_dict({"model": "org/head"})
    assert (c.method, c.num_speculative_tokens) == ("eagle3", 3)
    assert SpeculativeConfig.from_dict({"model": "org/other", "num_speculative_tokens": 2}).method == "draft_model"
    assert set(fetched) == {("org/head", "config.json"), ("org/other", "config.json")}
