"""Per-token logprobs from a patched model's logits, as the engine computes them: ``ops.log_softmax`` of the fp32
logits (the head's output cast, as the engine's ``LMHead`` casts it), the target's entry gathered.

TRL's ``selective_log_softmax`` takes the same arguments but reduces the vocabulary its own way (``logsumexp``,
or a bf16 ``log_softmax`` per row), so its values are not the sampler's bits; ``selective_log_softmax`` here is
the drop-in that is.
"""

import torch
from torch import nn

from lockstep.ops import autograd

__all__ = ["next_token_logprobs", "selective_log_softmax"]


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)`` at ``index``, with autograd: ``logits: [..., vocab]``, ``index: [...]`` int ->
    fp32 ``[...]``. The engine's logprob bits for the engine's logits (a ``temperature`` division by 1.0 is exact;
    the engine reports logprobs of the raw logits whatever the sampling temperature)."""
    vocab = logits.shape[-1]
    logprobs = autograd.log_softmax(logits.float().reshape(-1, vocab))  # [rows, vocab] fp32
    return logprobs.gather(1, index.reshape(-1, 1).long())[:, 0].view(index.shape)


def next_token_logprobs(model: nn.Module, input_ids: torch.Tensor, **forward_kwargs) -> torch.Tensor:
    """Each token's logprob given the tokens before it: ``input_ids: [batch, seq]`` -> fp32 ``[batch, seq - 1]``
    (entry ``t`` is token ``t + 1``'s). ``forward_kwargs`` (``attention_mask``, ``position_ids``) go to the model;
    entries at padding or across a packed sequence's boundary are meaningless, mask them."""
    logits = model(input_ids=input_ids, **forward_kwargs).logits  # [batch, seq, vocab]
    return selective_log_softmax(logits[:, :-1], input_ids[:, 1:])
