"""Model ids: ``LLM("org/name")`` as in vLLM. A Hugging Face repo id that is not a folder resolves to its snapshot
folder in the local Hugging Face cache, downloaded first (with a progress bar) where the network allows.

The cache is the one ``huggingface_hub`` and transformers share: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub`` (read when a model is resolved, not when the library was imported). With
``HF_HUB_OFFLINE=1`` the network is never tried. Only the files lockstep reads are fetched: configs, safetensors
weights and tokenizer files (never pickled ``*.bin`` or other formats), except for an EAGLE-3 head published as
``pytorch_model.bin`` (``torch_bin=True``), which its loader reads tensors-only (``models/torch_bin.py``).
"""

import os
from pathlib import Path

# Configs (config.json, generation_config.json, the shard index, tokenizer JSON), weights, sentencepiece and
# tiktoken vocabularies, BPE merges, chat templates.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
TORCH_BIN_PATTERNS = ["pytorch_model.bin", "pytorch_model-*.bin"]  # the shard index is a *.json
_TRUE = {"1", "true", "yes", "on"}


def hub_cache_dir() -> Path:
    """Where ``huggingface_hub`` keeps downloaded repos, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or transformers' ``TRANSFORMERS_OFFLINE``) forbids network access."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def is_repo_id(model: str) -> bool:
    """Whether ``model`` is spelled like a Hugging Face repo id (``name`` or ``org/name``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def resolve_model(model: str, revision: str | None = None, torch_bin: bool = False) -> str:
    """The checkpoint folder ``model`` names: ``model`` itself when it is a folder, else the snapshot of the
    Hugging Face repo ``model`` at ``revision`` (a branch, tag or commit; default ``main``) in the local cache,
    downloaded first unless offline. Raises FileNotFoundError naming the id and the cache when it is neither.
    ``torch_bin``: fetch ``pytorch_model.bin`` weights too (EAGLE-3 heads only)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hugging Face model ids, but {model} is a folder")
        return model
    if not is_repo_id(model):
        raise FileNotFoundError(f"model folder {path} does not exist (nor is it a Hugging Face model id)")
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    offline = hub_offline()
    patterns = ALLOW_PATTERNS + (TORCH_BIN_PATTERNS if torch_bin else [])
    try:
        return snapshot_download(
            model, revision=revision, cache_dir=cache, local_files_only=offline, allow_patterns=patterns
        )
    except Exception as e:  # no network, no such repo or revision, gated, incomplete: all say the same to a user
        first_line = (str(e).splitlines() or [""])[0]
        how = "HF_HUB_OFFLINE is set" if offline else f"downloading failed: {type(e).__name__}: {first_line}"
        raise FileNotFoundError(
            f"model {model!r} (revision {revision or 'main'}) is not a folder and not in the Hugging Face cache "
            f"{cache} ({how}). Download it where the network allows (`hf download {model}`) into that cache, "
            "or point HF_HOME or HF_HUB_CACHE at a cache that has it, or pass a checkpoint folder."
        ) from e
