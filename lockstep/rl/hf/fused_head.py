"""TRL's fused LM head (``model(..., labels=labels, fused_lm_head=True)`` -> per-token ``log_probs``), computed with
the engine's head and log_softmax.

TRL 1.16's trainers (GRPO, RLOO, DPO, KTO, SFT) never take ``logits`` from the model: at construction they wrap
its ``forward`` (``trl.trainer.utils.add_fused_lm_head``) so that ``fused_lm_head=True`` runs the backbone and then
TRL's own chunked projection and log-softmax, whose reduction order is not the engine's. ``add_fused_lm_head`` here
replaces that wrapper, after TRL's (the trainer must exist first), by one with the same contract whose
``log_probs`` are ``selective_log_softmax`` of the patched head's logits: the sampler's bits at ``temperature=1``.
Without ``fused_lm_head`` the forward is transformers' own (the patched model's).
"""

import types

import torch
from torch import nn

from lockstep.ops import autograd
from lockstep.rl.hf.layers import K
from lockstep.rl.hf.model import no_autocast
from lockstep.rl.hf.weights import causal_lm

__all__ = ["add_fused_lm_head"]


def _fused_forward(
    self: nn.Module,
    *args,
    fused_lm_head: bool = False,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch=None,
    **kwargs,
):
    state = self.__dict__["_lockstep_fused_head"]
    if not fused_lm_head:
        extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
        return type(self).forward(self, *args, **kwargs, **{k: v for k, v in extra.items() if v is not None})

    if kwargs.get("output_router_logits") or getattr(self.config, "output_router_logits", False):
        raise NotImplementedError("the MoE load-balancing loss (output_router_logits) is not supported on lockstep")
    kwargs["use_cache"] = False
    hidden = self.model(*args, **kwargs).last_hidden_state  # [batch, seq, hidden], the patched backbone
    with no_autocast(hidden.device):
        return _head(self, state, hidden, labels, shift_labels, num_items_in_batch)


def _head(self: nn.Module, state: dict, hidden, labels, shift_labels, num_items_in_batch):
    from trl.trainer.utils import FusedCausalLMOutput

    if shift_labels is None:
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    mask = labels != -100  # [batch, seq - 1]
    head = self.lm_head
    logits = K.linear(hidden[mask], head.weight, head.bias).float()  # [n, vocab]: the engine's rows, fp32
    if state["temperature"] != 1.0:
        logits = logits / state["temperature"]
    logprobs = autograd.log_softmax(logits)  # [n, vocab] fp32, the engine's log_softmax
    chosen = logprobs.gather(1, labels[mask].long()[:, None])[:, 0]
    log_probs = chosen.new_zeros(mask.shape).masked_scatter(mask, chosen)
    entropy = None
    if "entropy" in state["outputs"]:
        per_row = -(logprobs.exp() * logprobs).sum(-1)
        entropy = per_row.new_zeros(mask.shape).masked_scatter(mask, per_row)
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy, label_mask=mask)


def add_fused_lm_head(
    model: nn.Module, temperature: float = 1.0, outputs: tuple[str, ...] = ("log_probs", "entropy")
) -> None:
    """Give ``model`` (a patched causal LM, or a PEFT model of one) TRL's ``fused_lm_head=True`` call on lockstep's
    kernels (see the module docstring), replacing any fused head TRL installed. ``temperature`` divides the fp32
    logits first (1.0: the engine's logprobs exactly); ``outputs`` lists the per-token fields computed, of
    ``"log_probs"`` (always) and ``"entropy"``; TRL's other fields are None."""
    lm = causal_lm(model)
    unknown = set(outputs) - {"log_probs", "entropy"}
    if unknown:
        raise ValueError(f"lockstep's fused head computes log_probs and entropy, not {sorted(unknown)}")
    lm.__dict__["_lockstep_fused_head"] = {"temperature": float(temperature), "outputs": tuple(outputs)}
    lm.forward = types.MethodType(_fused_forward, lm)
