"""Calibrated FP8 KV-cache scales from a checkpoint: ``k_scale``/``v_scale`` per tensor or per KV head.

A checkpoint calibrated for an FP8 KV cache (llm-compressor's ``kv_cache_scheme``, vLLM's FP8 checkpoints) stores
one scale per layer and per K and V: ``model.layers.{i}.self_attn.k_scale`` and ``.v_scale`` (older files:
``self_attn.k_proj.output_scale`` / ``v_proj.output_scale``), a scalar or ``[1]`` per tensor, or ``[num_kv_heads]``
(any shape of that many elements) per head (compressed-tensors' ``strategy: "attn_head"``). The cache then holds
``e4m3(k / k_scale)`` and ``e4m3(v / v_scale)`` and attention reads ``k8 * k_scale`` and ``v8 * v_scale``
(``layers.attention.Attention``: q times k_scale before the scores, the output times v_scale after, both
elementwise per head, so every path that reads the cache reads it alike). Without such tensors the scales are 1,
as before. The scales only act on an FP8 cache (``kv_cache_dtype="fp8"``); a full-precision cache ignores them.
"""

import torch
from torch import nn

_SUFFIXES = {
    ".self_attn.k_scale": "k",
    ".self_attn.v_scale": "v",
    ".self_attn.k_proj.output_scale": "k",
    ".self_attn.v_proj.output_scale": "v",
}


def check_kv_cache_scheme(hf: dict) -> None:
    """Refuse a compressed-tensors ``kv_cache_scheme`` lockstep cannot honour (anything but static 8-bit float
    scales per tensor or per head)."""
    scheme = (hf.get("quantization_config") or {}).get("kv_cache_scheme")
    if not scheme:
        return
    ok = scheme.get("type") == "float" and scheme.get("num_bits") == 8 and not scheme.get("dynamic")
    if not ok or scheme.get("strategy", "tensor") not in ("tensor", "attn_head"):
        raise ValueError(
            f"kv_cache_scheme {scheme}: lockstep reads static 8-bit float KV scales per tensor or per head only"
        )


def kv_scale_of(name: str) -> tuple[str, str] | None:
    """``(layer prefix, "k" or "v")`` for a checkpoint's KV-scale tensor name, else None."""
    for suffix, which in _SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], which
    return None


def attach_kv_scales(model: nn.Module, scales: dict[tuple[str, str], torch.Tensor]) -> None:
    """Give each attention layer named in ``scales`` (``kv_scale_of``'s keys -> the checkpoint tensors) fp32
    buffers ``k_scale``/``v_scale`` ``[this rank's KV heads]``; a layer given only one of them keeps 1 for the
    other."""
    layers = {name: m for name, m in model.named_modules() if name.endswith(".self_attn") and hasattr(m, "attn")}
    for prefix in sorted({p for p, _ in scales}):
        attn = layers.get(f"{prefix}.self_attn")
        if attn is None:
            raise ValueError(f"KV scales for {prefix!r}, which has no attention layer")
        full = model.config.num_kv_heads
        kv0 = getattr(attn, "kv_head_start", 0)
        device = next(attn.parameters()).device
        for which in ("k", "v"):
            t = scales.get((prefix, which))
            t = torch.ones(1) if t is None else t.detach().float().reshape(-1)
            if t.numel() not in (1, full):
                raise ValueError(
                    f"{prefix}.self_attn.{which}_scale has {t.numel()} values: expected 1 (per tensor) or "
                    f"{full} (per KV head)"
                )
            if not torch.isfinite(t).all() or (t <= 0).any():
                raise ValueError(f"{prefix}.self_attn.{which}_scale must be finite and positive, got {t.tolist()}")
            heads = t.expand(full)[kv0 : kv0 + attn.attn.num_kv_heads].clone().to(device)
            attn.attn.register_buffer(f"{which}_scale", heads, persistent=False)
