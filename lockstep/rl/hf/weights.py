"""The weights a patched Hugging Face model computes with, and the same tensors under checkpoint names for the
sampler (``LLM.load_weights``).

A plain ``nn.Linear`` computes with its own weight. A PEFT LoRA layer (``peft.tuners.lora.Linear``) normally adds
``lora_B(lora_A(dropout(x))) * scaling`` to the base layer's output, a second matmul whose rounding a sampler
running the merged weight ``W + scaling * B @ A`` never reproduces. With no dropout and no DoRA the patched model
instead computes with the merged weight itself, built differentiably at each forward (``merged_weight``), and
``sampler_weights`` hands the sampler exactly that tensor: the trainer and a sampler loaded with
``sampler_weights(model)`` then agree bit for bit, LoRA included. A LoRA layer with dropout or DoRA keeps PEFT's
own forward (``merged_weight`` returns None): training works, but its logprobs are not the sampler's bits.
"""

from collections.abc import Iterator

import torch
from torch import nn

from lockstep.ops import autograd


def _is_lora(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")


def _active_adapters(module: nn.Module) -> list[str]:
    if module.disable_adapters or module.merged:  # merged: the base weight already holds the adapters
        return []
    return [name for name in module.active_adapters if name in module.lora_A]


def merged_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight, bias)`` a linear ``module`` computes with: an ``nn.Linear``'s own, or a LoRA layer's base weight
    plus ``scaling * B @ A`` of each active adapter (differentiable in A and B; the product through the invariant
    ``linear``, the sum in fp32 rounded once to the base dtype). None where the layer cannot be merged exactly
    (dropout, DoRA, a LoRA bias, ``fan_in_fan_out``, or a module that is neither)."""
    if not _is_lora(module):
        return (module.weight, module.bias) if isinstance(module, nn.Linear) else None
    base = module.get_base_layer()
    if not isinstance(base, nn.Linear):
        return None
    names = _active_adapters(module)
    if not names:
        return base.weight, base.bias
    if getattr(module, "fan_in_fan_out", False):
        return None
    weight = base.weight.float()
    for name in names:
        if not isinstance(module.lora_dropout[name], nn.Identity):
            return None
        if getattr(module, "use_dora", {}).get(name) or getattr(module, "lora_bias", {}).get(name):
            return None
        a, b = module.lora_A[name].weight, module.lora_B[name].weight  # a: [r, K], b: [N, r]
        delta = autograd.linear(b, a.t().contiguous())  # [N, K] = b @ a, one sequential reduction over r
        weight = weight + module.scaling[name] * delta.float()
    return weight.to(base.weight.dtype), base.bias


def causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` inside ``model`` (itself, or a PEFT model's base model)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not (hasattr(inner, "model") and hasattr(inner, "lm_head")):
        raise TypeError(f"expected a transformers *ForCausalLM (or a PEFT model of one), got {type(model).__name__}")
    return inner


def _full(t: torch.Tensor) -> torch.Tensor:
    # A DTensor (FSDP2's sharded parameter) is gathered (a collective of the trainer's group); others as they are.
    full_tensor = getattr(t, "full_tensor", None)
    return (full_tensor() if full_tensor is not None else t).detach()


@torch.no_grad()
def sampler_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` for every weight of ``model`` (a transformers causal LM or a PEFT model of
    one), LoRA layers merged exactly as the patched forward merges them: what ``LLM.load_weights`` takes to make the
    sampler compute what the trainer computes. A LoRA layer that cannot be merged exactly (``merged_weight``) is
    merged PEFT's way (``get_delta_weight``). The tied LM head is left out; tensors are detached, not copied.

    A sharded model's parameters (FSDP2's ``fully_shard``: DTensors) are gathered one tensor at a time as the
    generator reaches them (``DTensor.full_tensor``), so every rank of the trainer must walk it, in step."""
    lm = causal_lm(model)
    lora_prefixes: tuple[str, ...] = ()
    tied = bool(getattr(lm.config, "tie_word_embeddings", False))
    for name, module in lm.named_modules():
        if lora_prefixes and name.startswith(lora_prefixes):
            continue
        if _is_lora(module):
            lora_prefixes += (name + ".",)
            merged = merged_weight(module)
            if merged is None:
                base = module.get_base_layer()
                weight = base.weight.detach().clone()
                for adapter in _active_adapters(module):
                    weight += module.get_delta_weight(adapter).to(weight.dtype)
                merged = weight, base.bias
            yield f"{name}.weight", _full(merged[0])
            if merged[1] is not None:
                yield f"{name}.bias", _full(merged[1])
            continue
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{name}.{param_name}" if name else param_name
            if full == "lm_head.weight" and tied:
                continue
            yield full, _full(param)
