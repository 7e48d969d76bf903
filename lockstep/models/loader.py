"""Load a Hugging Face checkpoint folder as it is: ``config.json``, ``*.safetensors`` (one file or shards with
``model.safetensors.index.json``), and the tokenizer with its chat template.

Every failure names the file, and the tensor where there is one: a missing folder or file raises
``FileNotFoundError``; an unsupported architecture, unreadable JSON or safetensors, an unexpected, mis-shaped or
missing tensor raises ``ValueError``. Pickled ``*.bin`` weights are never loaded.

``load_format="dummy"`` (vLLM's name) reads ``config.json`` alone and draws the weights at random
(``fill_random``): a model's shape without its checkpoint, for benchmarks.
"""

import dataclasses
import json
import math
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

from lockstep.config import LOAD_FORMATS
from lockstep.distributed import TPGroup
from lockstep.models.kv_scales import attach_kv_scales, check_kv_cache_scheme, kv_scale_of
from lockstep.models.llama import LlamaForCausalLM, ModelConfig
from lockstep.models.quantization import checkpoint_slots, conform, fp8_scheme, prepare_checkpoint, quantize_model

INDEX_FILE = "model.safetensors.index.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _folder(path: str | Path) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist or is not a directory")
    return folder


def _read_json(file: Path) -> dict:
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return data


def read_config(path: str | Path) -> ModelConfig:
    """The model's ``ModelConfig`` from ``config.json``, with end-of-sequence ids from ``generation_config.json``
    when the folder has one (instruct models often list extra stop tokens only there)."""
    folder = _folder(path)
    config_file = folder / "config.json"
    hf = _read_json(config_file)
    try:
        config = ModelConfig.from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        detail = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{config_file}: {detail}") from e
    generation_file = folder / "generation_config.json"
    if generation_file.is_file():
        eos = _read_json(generation_file).get("eos_token_id")
        if eos is not None:
            config = dataclasses.replace(config, eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,))
    return config


# generation_config.json keys that give sampling defaults (vLLM's --generation-config auto), and their
# SamplingParams names.
GENERATION_DEFAULT_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def read_generation_defaults(path: str | Path, required: bool = False) -> dict:
    """The sampling defaults a checkpoint's ``generation_config.json`` sets, as ``SamplingParams`` keywords (its
    ``max_new_tokens`` as ``max_tokens``; other keys, ``do_sample`` included, are not read, as in vLLM). ``{}``
    when the folder has no such file, unless ``required``; ValueError for values SamplingParams refuses."""
    from lockstep.sampling_params import SamplingParams

    file = _folder(path) / "generation_config.json"
    if not file.is_file():
        if required:
            raise FileNotFoundError(f"{file} not found")
        return {}
    data = _read_json(file)
    defaults = {ours: data[key] for key, ours in GENERATION_DEFAULT_KEYS.items() if data.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
    return defaults


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, in a fixed order."""
    folder = _folder(path)
    index_file = folder / INDEX_FILE
    if index_file.is_file():
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_file} has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"shard {file} listed in {index_file} not found")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (found {', '.join(pickles)}: convert it to safetensors)" if pickles else ""
        raise FileNotFoundError(f"no *.safetensors weights in {folder}{hint}")
    return files


def _tensor_names(file: Path) -> list[str]:
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own SafetensorError, or OSError
        raise ValueError(f"{file} is not a readable safetensors file: {e}") from e


def _ignored(name: str, config: ModelConfig) -> bool:
    # Old checkpoints store the rotary inverse frequencies; tied checkpoints sometimes store the head anyway.
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class that implements ``architecture`` (one of ``SUPPORTED_ARCHITECTURES``)."""
    if architecture in ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"):
        from lockstep.models.qwen3_vl import Qwen3VLForConditionalGeneration

        return Qwen3VLForConditionalGeneration
    if architecture == "Qwen2_5_VLForConditionalGeneration":
        from lockstep.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration
    return LlamaForCausalLM


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    kernels: str = "invariant",
    max_model_len: int | None = None,
    tp: TPGroup | None = None,
    tp_invariant: bool | None = None,
    load_format: str = "auto",
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """Build the model a checkpoint folder describes and load its weights, converted to ``dtype`` (default: the
    checkpoint's ``dtype``/``torch_dtype``), on the kernel set registered as ``kernels`` (``layers.kernels``).
    ``load_format``: "auto" or "safetensors" reads the weights, "dummy" draws them (``fill_random``).

    Under tensor parallelism (``tp``, see ``LlamaForCausalLM``) only this rank's slice of each tensor is read.

    FP8 (``models.quantization``): an FP8 checkpoint loads into FP8 layers; ``quantization="fp8"`` quantizes a
    full-precision one after loading; dummy weights of an FP8 checkpoint's shape are drawn, then quantized."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    folder = _folder(path)
    config = read_config(folder)
    hf = _read_json(folder / "config.json")
    scheme = fp8_scheme(hf, quantization)
    check_kv_cache_scheme(hf)
    names_by_file = {}
    if load_format != "dummy":
        names_by_file = {file: _tensor_names(file) for file in weight_files(folder)}
        all_names = {name for names in names_by_file.values() for name in names}
        if not config.tie_word_embeddings and "lm_head.weight" not in all_names:
            # A checkpoint without a head shares the embedding (what transformers does too).
            config = dataclasses.replace(config, tie_word_embeddings=True)

    model = model_class(config.architecture)(
        config,
        kernels=kernels,
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        tp=tp,
        tp_invariant=tp_invariant,
    )
    model.fp8_scheme = scheme  # LLM.load_weights and the trainer quantize as the model was loaded
    if load_format == "dummy":
        fill_random(model)
        if scheme is not None:
            quantize_model(model, scheme)
        return model
    if scheme is not None and not scheme.online:
        prepare_checkpoint(model, scheme, all_names)
    slots = model.checkpoint_tensors()
    shards = model.checkpoint_shards()
    if scheme is not None and not scheme.online:
        slots, shards = checkpoint_slots(slots, scheme, all_names, shards)
    loaded: set[str] = set()
    kv_scales: dict[tuple[str, str], torch.Tensor] = {}
    for file, names in names_by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for file_name in names:
                name = model.checkpoint_name(file_name)
                if _ignored(name, config):
                    continue
                kv = kv_scale_of(name)
                if kv is not None:  # calibrated FP8 KV scales: attached after the loop (models/kv_scales.py)
                    kv_scales[kv] = f.get_tensor(file_name)
                    continue
                dest = slots.get(name)
                if dest is None:
                    raise ValueError(f"{file}: unexpected tensor {name!r} for a {config.architecture}")
                if name in loaded:
                    raise ValueError(f"{file}: tensor {name!r} appears in more than one file")
                shard = shards.get(name)
                try:
                    if shard is None:
                        tensor = model.checkpoint_layout(name, f.get_tensor(file_name))
                    else:
                        source = f.get_slice(file_name)
                        full = list(source.get_shape())
                        tensor = source[shard.index()]
                except Exception as e:
                    raise ValueError(f"{file}: cannot read tensor {name!r}: {e}") from e
                if scheme is not None:
                    tensor = conform(name, tensor)
                if shard is not None and (len(full) != dest.dim() or full[shard.dim] != shard.full):
                    expected = list(dest.shape)
                    expected[shard.dim] = shard.full
                    raise ValueError(f"{file}: tensor {name!r} has shape {full}, but config.json implies {expected}")
                if tensor.shape != dest.shape:
                    raise ValueError(
                        f"{file}: tensor {name!r} has shape {list(tensor.shape)}, "
                        f"but config.json implies {list(dest.shape)}"
                    )
                dest.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(slots) - loaded)
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{folder}: the checkpoint is missing tensor(s) {shown}")
    if kv_scales:
        attach_kv_scales(model, kv_scales)
    if scheme is not None and scheme.online:
        quantize_model(model, scheme)
    return model


@torch.no_grad()
def fill_random(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights in place of a checkpoint's. Each checkpoint tensor is drawn whole on the model's device from a
    generator seeded by ``seed`` and its name, and each rank keeps its slice, so on one kind of device the model is
    the same at every tensor-parallel size. Norm weights are 1 + 0.1 N(0, 1), every other tensor N(0, 1) over the
    square root of its fan-in (the last dimension; a patch embedding's C * T * P * P): logits of order one, without
    the ties of vLLM's tiny uniform values. Norm biases (LayerNorm's) count as norm weights too."""
    shards = model.checkpoint_shards()
    for name, dest in model.checkpoint_tensors().items():
        shape = list(dest.shape)
        shard = shards.get(name)
        if shard is not None:
            shape[shard.dim] = shard.full
        gen = torch.Generator(device=dest.device).manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
        full = torch.randn(shape, generator=gen, device=dest.device)
        # A patch embedding ([D, C, T, P, P], a convolution's weight) reads C * T * P * P inputs.
        fan_in = math.prod(shape[1:]) if len(shape) == 5 else shape[-1]
        norm = "norm" in name or ".ln_" in name  # Qwen2.5-VL's merger calls its RMSNorm ln_q
        full = 1.0 + 0.1 * full if norm else full / fan_in**0.5
        dest.copy_(full if shard is None else full[shard.index()])


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer (``transformers.AutoTokenizer``), chat template included. Never downloads."""
    folder = _folder(path)
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {folder} (looked for {', '.join(_TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
