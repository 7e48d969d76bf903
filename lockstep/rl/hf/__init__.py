"""True on-policy RL on a Hugging Face ``transformers`` model: ``patch_model(model)`` makes its forward and backward
run lockstep's invariant kernels in the engine's order, so that its per-token logprobs
(``selective_log_softmax``) equal bit for bit the ``token_logprobs`` a ``lockstep.LLM`` reported when it sampled
the tokens; ``sampler_weights(model)`` is what ``LLM.load_weights`` takes to keep the sampler on the trainer's
weights (LoRA merged exactly as the trainer computes it). docs/design.md, "The Hugging Face trainer", says how.

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    lockstep.rl.hf.patch_model(model)
    logits = model(input_ids, attention_mask=mask).logits
    logprobs = lockstep.rl.hf.selective_log_softmax(logits[:, :-1], input_ids[:, 1:])
"""

from lockstep.rl.hf.logprobs import next_token_logprobs, selective_log_softmax
from lockstep.rl.hf.model import is_patched, patch_model, unpatch_model
from lockstep.rl.hf.weights import sampler_weights

__all__ = [
    "is_patched",
    "next_token_logprobs",
    "patch_model",
    "sampler_weights",
    "selective_log_softmax",
    "unpatch_model",
]
