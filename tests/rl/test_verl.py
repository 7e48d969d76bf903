"""The lockstep rollout for verl (``lockstep.rl.verl``): registered through verl's registries (in every process that
imports verl, through the ``verl.plugins`` entry point), its server answers verl's token-in-token-out ``generate``
with the engine's bits (concurrent calls batched), the trainer side's ``release`` / ``resume`` / ``update_weights``
put the trainer's weights in exactly as ``LLM.load_weights`` does, and examples/verl_rollout.py runs verl's own
``LLMServerManager`` and ``AgentLoopManager`` under Ray with the trainer's logprobs equal to the sampler's.
verl pins transformers < 5.11, so it is not in the project's environment: these run where verl imports (an
environment of its own; docs/design.md, "verl")."""

import asyncio
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

verl = pytest.importorskip("verl")

from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.models.loader import load_model  # noqa: E402
from lockstep.rl import verl as lockstep_verl  # noqa: E402

EXAMPLE = Path(__file__).parents[2] / "examples" / "verl_rollout.py"
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


@pytest.mark.parametrize("how", ["entry point", "VERL_USE_EXTERNAL_MODULES"])
def test_registered_in_a_fresh_verl_process(how):
    """What verl's Ray workers see: a process that only imports verl resolves ``rollout.name=lockstep``."""
    env = dict(os.environ)
    if how == "VERL_USE_EXTERNAL_MODULES":
        env |= {"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "lockstep.rl.verl_plugin"}
    else:
        from importlib.metadata import entry_points

        if not any(ep.value == "lockstep.rl.verl_plugin" for ep in entry_points(group="verl.plugins")):
            pytest.skip("lockstep is not pip-installed here (its entry points are in its package metadata)")
    code = (
        "import verl\n"
        "from verl.workers.rollout.base import get_rollout_class\n"
        "from verl.workers.rollout.replica import get_rollout_replica_class\n"
        "print(get_rollout_class('lockstep', 'async').__name__, get_rollout_replica_class('lockstep').__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["LockstepServerAdapter", "LockstepReplica"]
    env |= {"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": ""}  # the negative control
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode != 0


def test_server_generates_the_engines_bits_and_takes_weights(tiny_model_dir, tiny_rl_model_dir_b):
    server = lockstep_verl.LockstepServer(str(tiny_model_dir), response_length=6)
    adapter_cls = lockstep_verl.LockstepServerAdapter
    adapter = adapter_cls.__new__(adapter_cls)  # BaseRollout's config plumbing needs verl's Hydra configs
    adapter._server, adapter.replica_rank, adapter.is_leader_rank = server, 0, True

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


def test_verls_agent_loop_samples_through_lockstep_with_the_trainers_bits(tmp_path):
    """examples/verl_rollout.py under Ray (2 CPUs; with 1 it had not finished after 10 minutes): verl's agent loop
    samples 2 prompts x 4 through the lockstep replica; the patched transformers trainer's logprobs of verl's batch
    equal ``rollout_log_probs`` exactly (unpatched they do not); a GRPO step with verl's loss sees an importance
    ratio of exactly 1; after the sync through ``RolloutReplica.sleep`` and the adapter, the next rollout matches
    the new weights, not the old."""
    pytest.importorskip("ray")
    spec = importlib.util.spec_from_file_location("verl_rollout_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    import ray

    ray.init(num_cpus=2, num_gpus=1, object_store_memory=128 << 20, include_dashboard=False)
    try:
        r = example.main(["--prompts", "2", "--n", "4", "--max-response-length", "8", "--lr", "0.05"])
    finally:
        ray.shutdown()
    assert r["tokens"] > 8
    assert r["mismatch"] == 0.0 and r["mismatch_after_sync"] == 0.0, r
    assert r["mismatch_unpatched"] > 0 and r["mismatch_after_sync_unpatched"] > 0, r
    assert r["ratio_min"] == r["ratio_max"] == 1.0 and r["grad_norm"] > 0, r
    assert r["mismatch_after_sync_old_weights"] > 0, r  # the new weights reached the server
