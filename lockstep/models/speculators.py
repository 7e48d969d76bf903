"""EAGLE-3 heads in vLLM's "speculators" format (the ``speculators`` library's checkpoints, which vLLM loads with
``speculative_config={"model": path}``), read as the published layout that ``models/eagle3.py`` loads.

A speculators ``config.json`` names the algorithm in ``speculators_model_type`` ("eagle3") and nests the decoder
layer's Hugging Face config in ``transformer_layer_config`` (``model_type`` "llama" or "qwen3"; the latter's
attention has Qwen3's per-head ``q_norm`` / ``k_norm``). Next to it: ``draft_vocab_size``, ``target_hidden_size``,
``norm_before_residual``, ``eagle_aux_hidden_state_layer_ids``, and ``speculators_config`` with the ``algorithm``,
the ``proposal_methods`` (each with its ``speculative_tokens``; ``default_proposal_method`` names the one to use)
and the ``verifier`` the head was trained on. The weights are the published ones with the decoder layer under
``layers.0.`` instead of ``midlayer.``. As vLLM does, a speculators config without ``norm_before_residual`` means
true (the published layout's default is false), and the proposal method's ``speculative_tokens`` is the default
``num_speculative_tokens``. The ``speculators`` variants lockstep's head does not compute (``norm_before_fc``,
``fc_norm``, ``norm_output``, other algorithms) are refused by name rather than drafted wrongly.

Also here, for ``spec/config.py`` to pick the method from a checkpoint's config without importing the model code:
``is_eagle3_head`` recognises a head's config in either format. Nothing here imports torch.
"""

import json
from pathlib import Path

KEY = "speculators_model_type"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # the published layout's names
LAYER_PREFIX, PUBLISHED_PREFIX = "layers.0.", "midlayer."
# transformer_layer_config's model_type -> the architecture lockstep reads the layer as.
LAYER_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Variants of the speculators EAGLE-3 head that lockstep's head does not compute: each must be false or absent.
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def is_speculators(hf: dict) -> bool:
    """Whether a ``config.json`` dict is in the speculators format."""
    return KEY in hf


def is_eagle3_head(hf: dict) -> bool:
    """Whether a ``config.json`` dict is an EAGLE-3 head's: a published architecture, or the speculators format
    (any of its algorithms: ``models.eagle3.read_eagle3_config`` refuses the others by name)."""
    return is_speculators(hf) or any(a in EAGLE3_ARCHITECTURES for a in hf.get("architectures") or [])


def read_checkpoint_config(model: str) -> dict | None:
    """The ``config.json`` of ``model`` (a folder, or a Hugging Face id: only that file is fetched, from the cache
    when offline), or None when there is none to read. Used to recognise an EAGLE-3 head by its config."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        file = folder / "config.json"
    else:
        from lockstep.models.hub import hub_cache_dir, hub_offline, is_repo_id

        if not is_repo_id(model):
            return None
        try:
            from huggingface_hub import hf_hub_download

            cache, offline = hub_cache_dir(), hub_offline()
            file = Path(hf_hub_download(model, "config.json", cache_dir=cache, local_files_only=offline))
        except Exception:  # no network, no such repo: the checkpoint's own loader reports it, with the whole story
            return None
    if not file.is_file():
        return None
    try:
        hf = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return hf if isinstance(hf, dict) else None


def algorithm(hf: dict, path) -> str:
    """The speculators config's algorithm, "eagle3"; ValueError naming any other (lockstep drafts only EAGLE-3)."""
    kind = hf.get(KEY)
    if kind != "eagle3":
        raise ValueError(
            f"{path}: speculators_model_type {kind!r} is not supported: lockstep runs speculators heads of type "
            f"'eagle3' only"
        )
    return kind


def speculative_tokens(hf: dict, path) -> int:
    """The ``speculative_tokens`` of the proposal method the config names (``default_proposal_method``, else the
    first), the default ``num_speculative_tokens``; ValueError naming what is missing or malformed."""
    spec = _speculators_config(hf, path)
    methods = spec.get("proposal_methods")
    if not isinstance(methods, list) or not methods or not all(isinstance(m, dict) for m in methods):
        raise ValueError(f"{path}: speculators_config.proposal_methods must be a non-empty list of objects")
    default = spec.get("default_proposal_method")
    chosen = next((m for m in methods if default is not None and m.get("proposal_type") == default), methods[0])
    k = chosen.get("speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(
            f"{path}: speculators_config.proposal_methods: speculative_tokens of {chosen.get('proposal_type')!r} "
            f"must be an int >= 1, got {k!r}"
        )
    return k


def eagle3_config(hf: dict, path) -> dict:
    """The published-layout ``config.json`` dict (``LlamaForCausalLMEagle3``'s flat one) that the speculators config
    ``hf`` describes: the layer's config, with the EAGLE-3 fields beside it. ValueError naming the first problem:
    another algorithm, a missing or malformed ``speculators_config`` or ``transformer_layer_config``, a layer
    ``model_type`` other than llama / qwen3, or a variant the head does not compute."""
    algorithm(hf, path)
    spec = _speculators_config(hf, path)
    if spec.get("algorithm", "eagle3") != "eagle3":
        raise ValueError(f"{path}: speculators_config.algorithm is {spec['algorithm']!r}, expected 'eagle3'")
    verifier = spec.get("verifier")
    if not isinstance(verifier, dict):
        raise ValueError(f"{path}: speculators_config.verifier must be an object (the model the head drafts for)")
    speculative_tokens(hf, path)
    layer = hf.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{path}: a speculators config needs transformer_layer_config, the decoder layer's config")
    model_type = layer.get("model_type", "llama")
    if model_type not in LAYER_ARCHITECTURES:
        raise ValueError(
            f"{path}: transformer_layer_config.model_type {model_type!r} is not supported (only "
            f"{', '.join(LAYER_ARCHITECTURES)})"
        )
    for flag in UNSUPPORTED_FLAGS:
        if hf.get(flag):
            raise ValueError(f"{path}: {flag}=true is not supported (lockstep's EAGLE-3 head has no such norm)")
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in layer]
    if missing:
        raise ValueError(f"{path}: transformer_layer_config lacks {', '.join(missing)}")
    flat = dict(layer)
    flat["architectures"] = [LAYER_ARCHITECTURES[model_type]]
    flat.setdefault("num_hidden_layers", 1)
    for name in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if hf.get(name) is not None:
            flat[name] = hf[name]
    flat["norm_before_residual"] = bool(hf.get("norm_before_residual", True))  # vLLM's default for this format
    return flat


def published_name(name: str) -> str:
    """A speculators tensor name -> the published one (``layers.0.`` -> ``midlayer.``; the others are the same)."""
    return PUBLISHED_PREFIX + name.removeprefix(LAYER_PREFIX) if name.startswith(LAYER_PREFIX) else name


def speculators_name(name: str) -> str:
    """The inverse of ``published_name``: the name a speculators checkpoint gives a published tensor."""
    return LAYER_PREFIX + name.removeprefix(PUBLISHED_PREFIX) if name.startswith(PUBLISHED_PREFIX) else name


def _speculators_config(hf: dict, path) -> dict:
    spec = hf.get("speculators_config")
    if not isinstance(spec, dict):
        raise ValueError(
            f"{path}: a speculators config needs speculators_config (algorithm, proposal_methods, verifier), got "
            f"{spec!r}"
        )
    return spec
