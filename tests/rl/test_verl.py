"""The lockstep rollout for verl (``lockstep.rl.verl``): registered through verl's registries, its server answers
verl's token-in-token-out ``generate`` with the engine's bits (concurrent calls batched), and the trainer side's
``release`` / ``resume`` / ``update_weights`` put the trainer's weights in exactly as ``LLM.load_weights`` does.
verl pins transformers < 5.11, so it is not in the project's environment: these run where verl imports (an
environment of its own; docs/design.md, "verl")."""

import asyncio

import pytest

verl = pytest.importorskip("verl")

from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.models.loader import load_model  # noqa: E402
from lockstep.rl import verl as lockstep_verl  # noqa: E402

PROMPTS = [[(3 * i + j) % 95 for j in range(20 + i)] for i in range(4)]
SAMPLING = [{"temperature": 0.9, "seed": 5 + i, "max_tokens": 6, "logprobs": True} for i in range(4)]


def _reference(folder, weights=None):
    llm = LLM(str(folder))
    if weights is not None:
        llm.load_weights(weights)
    params = [SamplingParams(temperature=0.9, seed=5 + i, max_tokens=6) for i in range(4)]
    return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs) for o in llm.generate(PROMPTS, params)]


async def _generate_all(server):
    outs = await asyncio.gather(
        *[server.generate(p, dict(s), f"r{i}") for i, (p, s) in enumerate(zip(PROMPTS, SAMPLING, strict=True))]
    )
    return [(o.token_ids, o.log_probs) for o in outs]


def test_registered_through_verls_registries():
    from verl.workers.rollout.base import BaseRollout, get_rollout_class
    from verl.workers.rollout.replica import RolloutReplica, get_rollout_replica_class

    lockstep_verl.register()
    assert issubclass(get_rollout_class("lockstep", "async"), BaseRollout)
    assert issubclass(get_rollout_replica_class("lockstep"), RolloutReplica)


def test_server_generates_the_engines_bits_and_takes_weights(tiny_model_dir, tiny_rl_model_dir_b):
    server = lockstep_verl.LockstepServer(str(tiny_model_dir), response_length=6)
    adapter_cls = lockstep_verl.LockstepServerAdapter
    adapter = adapter_cls.__new__(adapter_cls)  # BaseRollout's config plumbing needs verl's Hydra configs
    adapter._server, adapter.replica_rank = server, 0

    async def scenario():
        first = await _generate_all(server)
        await adapter.release()  # verl: after generation, the trainer takes the GPU
        assert server.llm.is_sleeping
        await adapter.resume(["weights"])
        weights = load_model(tiny_rl_model_dir_b).checkpoint_tensors()
        await adapter.update_weights((name, t) for name, t in weights.items())
        await adapter.resume(["kv_cache"])
        return first, await _generate_all(server)

    first, second = asyncio.run(scenario())
    assert first == _reference(tiny_model_dir)
    assert second == _reference(tiny_model_dir, load_model(tiny_rl_model_dir_b).checkpoint_tensors())
    assert first != second  # the update changed the answers
