"""TRL's ``GRPOTrainer`` with ``lockstep.LLM`` as its generator, in-process: ``use_lockstep(trainer, llm)``.

TRL 1.16 plugs a generator in two ways: ``rollout_func`` (a function returning prompt ids, completion ids and
logprobs) and its vLLM backend (``use_vllm=True``: a ``VLLMGeneration`` object with ``generate`` and
``sync_weights``). Only the vLLM path computes TRL's own sampler-vs-trainer metrics
(``sampling/sampling_logp_difference/{mean,max}``, ``sampling/importance_sampling_ratio/{min,mean,max}``) and the
importance-sampling correction, so ``use_lockstep`` takes that path with ``LockstepGeneration``, an object of
``VLLMGeneration``'s shape that generates with the engine and syncs the trainer's weights into it
(``LLM.load_weights``) before the first generation after each optimizer step, as TRL syncs vLLM. TRL then
tokenizes, pads, scores and logs exactly as it does for vLLM.

The trainer's side: ``use_lockstep`` patches the model (``lockstep.rl.hf.patch_model``) and replaces the fused LM
head TRL installed (``lockstep.rl.hf.fused_head``), so the logprobs TRL recomputes are the engine's bits and
``sampling_logp_difference`` reads exactly 0 (the importance ratio exactly 1). With an engine built with
``batch_invariant=False`` (the negative control) the two sides use different kernels and the metrics show it.

Limits: ``temperature`` must be 1.0 (the engine reports the raw distribution's logprobs, vLLM's default; TRL's
correction wants the tempered ones); no tools or images yet; one process (under ``accelerate launch`` each process
would need its own engine). TRL's server mode against ``lockstep serve``: ``lockstep.rl.trl_server``.
"""

from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import torch

from lockstep.llm import LLM
from lockstep.rl.hf import patch_model, sampler_weights
from lockstep.rl.hf.fused_head import add_fused_lm_head
from lockstep.rl.hf.weights import causal_lm
from lockstep.sampling_params import SamplingParams

__all__ = ["LockstepGeneration", "use_lockstep"]


class LockstepGeneration:
    """TRL's ``VLLMGeneration`` interface (colocated mode) on a ``lockstep.LLM``: ``generate`` samples one
    completion per prompt (TRL repeats each prompt ``num_generations`` times; the engine draws each request's seed
    from its own ``seed``), ``sync_weights`` copies the trainer model's weights into the engine."""

    mode = "colocate"

    def __init__(self, llm: LLM, model: torch.nn.Module, sampling: dict[str, Any]):
        self.llm = llm
        self.model = model
        self.sampling = sampling
        self.num_syncs = 0

    def sync_weights(self) -> None:
        """``LLM.load_weights`` of the trainer's weights (``sampler_weights``: LoRA merged as the trainer runs it)."""
        self.llm.load_weights(sampler_weights(self.model))
        self.num_syncs += 1

    def generate(
        self, prompts: list[list[int]], images: list | None, num_generations: int, profiler=None
    ) -> tuple[list[list[int]], list[list[int]], list[list[list[float]]], list[list[list[int]]]]:
        """``(prompt_ids, completion_ids, logprobs, logprob_token_ids)`` as ``VLLMGeneration.generate`` returns
        them: ``logprobs[i][t] = [the sampled token's logprob]``."""
        if images is not None and any(img is not None for img in images):
            raise NotImplementedError("images are not supported by the lockstep generator yet")
        params = SamplingParams(**self.sampling)
        with profiler or nullcontext():
            outs = self.llm.generate([list(p) for p in prompts], params, use_tqdm=False)
        completions = [list(o.token_ids) for o in outs]
        logprobs = [[[lp] for lp in o.token_logprobs] for o in outs]
        token_ids = [[[t] for t in c] for c in completions]
        return [list(o.prompt_token_ids) for o in outs], completions, logprobs, token_ids


def _sampling(trainer) -> dict[str, Any]:
    """The trainer's generation settings as ``SamplingParams`` fields."""
    if trainer.temperature != 1.0:
        raise ValueError(
            f"temperature={trainer.temperature}: lockstep reports the logprobs of the raw distribution (vLLM's "
            "default), and TRL's importance correction compares them with the tempered distribution's; use 1.0"
        )
    extra = dict(trainer.args.generation_kwargs or {})
    sampling = dict(
        temperature=1.0,
        top_p=trainer.top_p,
        top_k=trainer.top_k if trainer.top_k else -1,
        min_p=trainer.min_p or 0.0,
        repetition_penalty=trainer.repetition_penalty,
        max_tokens=trainer.max_completion_length,
    )
    return sampling | extra


def _models(trainer) -> Iterable[torch.nn.Module]:
    yield trainer.model
    if getattr(trainer, "ref_model", None) is not None:
        yield trainer.ref_model


def use_lockstep(trainer, llm: LLM) -> LockstepGeneration:
    """Make a constructed ``trl.GRPOTrainer`` (built with ``use_vllm=False``) generate with ``llm`` and train on
    lockstep's kernels (see the module docstring); returns the generator. Call it before ``trainer.train()``.

    ``llm`` must run the trainer's model in the same dtype on the same device type; its weights are replaced by
    the trainer's before the first generation."""
    if trainer.args.use_vllm:
        raise ValueError("build the GRPOTrainer with use_vllm=False: lockstep takes vLLM's place")
    if getattr(trainer, "tools", None):
        raise NotImplementedError("tool calling is not supported by the lockstep generator yet")
    sampling = _sampling(trainer)
    engine = llm.engine.runner.model
    weight = causal_lm(trainer.model).model.embed_tokens.weight
    if (weight.dtype, weight.device.type) != (engine.dtype, engine.device.type):
        raise ValueError(
            f"the trainer's model runs in {weight.dtype} on {weight.device.type}, the engine in {engine.dtype} on "
            f"{engine.device.type}: the bits agree only between the same dtype and device type"
        )
    for model in _models(trainer):
        patch_model(model)
        add_fused_lm_head(model, temperature=trainer.temperature)
    generation = LockstepGeneration(llm, trainer.model, sampling)
    trainer.vllm_generation = generation
    trainer.use_vllm = True  # TRL's vLLM path: its generate / sync_weights calls and its mismatch metrics
    trainer.vllm_mode = "colocate"
    trainer._last_loaded_step = -1  # sync before the first generation
    return generation
