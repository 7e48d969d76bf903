"""Tensors from PyTorch ``pytorch_model.bin`` files, read without running pickled code.

lockstep's checkpoints are safetensors; this is only for EAGLE-3 heads, which are often published as
``pytorch_model.bin`` (``models/eagle3.py``). ``torch.load(..., weights_only=True)`` unpickles tensors, their
storages and plain containers, and refuses every other global a pickle names, so a file cannot make the loader run
code. What it returns must then be a flat ``{name: tensor}`` dict: anything else (an optimizer state, training
arguments, a nested dict) is a ``ValueError`` that names the file, and the key where there is one.
"""

import pickle
import re
from pathlib import Path

import torch

BIN_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"


def bin_files(folder: Path) -> list[Path]:
    """``pytorch_model.bin``, or the shards ``pytorch_model.bin.index.json`` names (sorted); [] when neither."""
    index = folder / BIN_INDEX_FILE
    if index.is_file():
        import json

        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        names = sorted(set(weight_map.values()))
        if any(not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..") for n in names):
            raise ValueError(f"{index}: shard names must be file names in its folder")
        files = [folder / name for name in names]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"shard {file} listed in {index} not found")
        return files
    single = folder / BIN_FILE
    return [single] if single.is_file() else []


def load_bin(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one ``.bin`` file, on the CPU, by name. ValueError naming ``file`` for a file that is not a
    tensor-only pickle."""
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # a global outside the tensor allow-list, refused before it ran; or garbage
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f"it names {named.group(1)}" if named else "it is not a PyTorch tensor file"
        raise ValueError(f"{file}: refused, only tensors are loaded from .bin files and {what}") from None
    except (EOFError, RuntimeError, OSError) as e:
        raise ValueError(f"{file} is not a readable PyTorch file: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file}: holds a {type(data).__name__}, not a dict of tensors")
    for name, value in data.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise ValueError(f"{file}: entry {name!r} is a {type(value).__name__}, not a tensor")
    return dict(data)
