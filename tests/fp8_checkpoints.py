"""Tiny FP8 checkpoints: a tiny full-precision folder's linear weights quantized into each layout lockstep reads
(Qwen3-FP8's 128 x 128 blocks, compressed-tensors per channel and per tensor), written as real folders with
config.json and safetensors, plus the dequantized full-precision folder they stand for."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lockstep.ops import fp8

LAYOUTS = ("fp8-block", "ct-channel", "ct-tensor", "ct-block")


def _quantized(name: str, t: torch.Tensor) -> bool:
    # The linear layers' matrices; not the embedding, the head, the norms or a router ("...gate.weight").
    if not name.endswith(".weight") or name.endswith(".gate.weight") or t.dim() != 2:
        return False
    return "embed" not in name and "lm_head" not in name


def _ct_config(strategy: str) -> dict:
    # The layout llm-compressor writes for its FP8_DYNAMIC scheme (strategy "tensor" for the per-tensor variant,
    # "block" for FP8_BLOCK: 128 x 128 weight blocks, activations per 128-column group).
    block = strategy == "block"
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                            "strategy": strategy, "group_size": None, "observer": "minmax",
                            "block_structure": [128, 128] if block else None},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                      "strategy": "group" if block else "token", "group_size": 128 if block else None,
                                      "observer": None},
                "output_activations": None,
            }
        },
    }  # fmt: skip


def save_fp8(src: Path, dst: Path, layout: str) -> Path:
    """``src`` (a tiny full-precision folder) with its linear weights in ``layout``, saved to ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, dst / f.name)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    out = {}
    for name, t in tensors.items():
        if not _quantized(name, t):
            out[name] = t
            continue
        prefix = name.removesuffix(".weight")
        if layout == "fp8-block":
            out[name], out[f"{prefix}.weight_scale_inv"] = fp8.quantize_weight(t, (128, 128))
        elif layout == "ct-block":
            out[name], out[f"{prefix}.weight_scale"] = fp8.quantize_weight(t, (128, 128))
        elif layout == "ct-channel":
            w8, s = fp8.quantize_weight(t)
            out[name], out[f"{prefix}.weight_scale"] = w8, s.to(t.dtype)
        else:
            scale = t.abs().amax().float() / fp8.FP8_MAX
            out[name], out[f"{prefix}.weight_scale"] = (t.float() / scale).to(fp8.FP8), scale.reshape(1)
    save_file({k: v.contiguous() for k, v in out.items()}, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    if layout == "fp8-block":
        config["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        }  # fmt: skip
    else:
        config["quantization_config"] = _ct_config(layout.removeprefix("ct-"))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def save_dequantized(fp8_folder: Path, dst: Path) -> Path:
    """The full-precision checkpoint an FP8 folder stands for: every FP8 matrix times its scales, in fp32."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((fp8_folder / "config.json").read_text())
    qc = config.pop("quantization_config")
    for f in fp8_folder.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, dst / f.name)
    tensors = load_file(fp8_folder / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_inv")):
            continue
        if t.dtype != fp8.FP8:
            out[name] = t
            continue
        prefix = name.removesuffix(".weight")
        scale = tensors.get(f"{prefix}.weight_scale_inv", tensors.get(f"{prefix}.weight_scale")).float()
        if qc.get("weight_block_size") or qc.get("config_groups", {}).get("group_0", {})["weights"]["block_structure"]:
            scale = fp8.expand_block_scale(scale, t.shape[0], 128)
        else:
            scale = scale.reshape(-1, 1).expand(t.shape[0], 1)
        out[name] = fp8.dequantize(t, scale)
    save_file(out, dst / "model.safetensors")
    config["torch_dtype"] = config["dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def save_kv_calibrated(src: Path, dst: Path, factors: list[float], per_head: bool) -> Path:
    """``src`` (a tiny Llama without biases) with KV head ``h``'s keys and values ``factors[h]`` times larger and
    the queries and o_proj columns that read it ``factors[h]`` times smaller, plus ``self_attn.k_scale``/``v_scale``
    = ``factors`` (per head, or the one factor per tensor): the same function in full precision, and with powers of
    two the same bits through an FP8 cache with these scales as ``src`` through one at scale 1. Without them its
    keys and values saturate e4m3."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or config["hidden_size"] // heads
    if not per_head and len(set(factors)) != 1:
        raise ValueError("a per-tensor scale needs one factor for every head")
    kv_rows = torch.tensor(factors).repeat_interleave(d)[:, None]  # [kv_heads * d, 1]
    q_rows = torch.tensor(factors).repeat_interleave(heads // kv_heads * d)  # [heads * d]
    tensors = load_file(src / "model.safetensors")
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}.self_attn"
        tensors[f"{pre}.k_proj.weight"] = tensors[f"{pre}.k_proj.weight"] * kv_rows
        tensors[f"{pre}.v_proj.weight"] = tensors[f"{pre}.v_proj.weight"] * kv_rows
        tensors[f"{pre}.q_proj.weight"] = tensors[f"{pre}.q_proj.weight"] / q_rows[:, None]
        tensors[f"{pre}.o_proj.weight"] = tensors[f"{pre}.o_proj.weight"] / q_rows[None, :]
        scale = torch.tensor(factors) if per_head else torch.tensor(factors[0])
        tensors[f"{pre}.k_scale"], tensors[f"{pre}.v_scale"] = scale.clone(), scale.clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")
    return dst
