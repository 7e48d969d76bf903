"""True on-policy RL: trainer logprobs with autograd that equal the engine's sampled logprobs bit for bit.

``load_policy`` loads a checkpoint for training on the engine's own model code, ``token_logprobs`` computes
per-token logprobs of (prompt, completion) pairs in micro-batches, and ``LLM.load_weights`` syncs the trained
weights back into the engine. ``patch_model`` does the same for a Hugging Face ``transformers`` model
(``lockstep.rl.hf``): a TRL or hand-written trainer keeps its model and gets the sampler's bits.
"""

from lockstep.rl.hf import patch_model, sampler_weights, selective_log_softmax, unpatch_model
from lockstep.rl.logprobs import micro_batches, token_logprobs
from lockstep.rl.policy import TRAINABLE, load_policy, make_trainable

__all__ = [
    "TRAINABLE",
    "load_policy",
    "make_trainable",
    "micro_batches",
    "patch_model",
    "sampler_weights",
    "selective_log_softmax",
    "token_logprobs",
    "unpatch_model",
]
