"""True on-policy RL: trainer logprobs with autograd that equal the engine's sampled logprobs bit for bit.

``load_policy`` loads a checkpoint for training on the engine's own model code, ``token_logprobs`` computes
per-token logprobs of (prompt, completion) pairs in micro-batches, and ``LLM.load_weights`` syncs the trained
weights back into the engine.
"""

from lockstep.rl.logprobs import micro_batches, token_logprobs
from lockstep.rl.policy import TRAINABLE, load_policy, make_trainable

__all__ = ["TRAINABLE", "load_policy", "make_trainable", "micro_batches", "token_logprobs"]
