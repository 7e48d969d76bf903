"""A lockstep rollout for verl (0.9), registered through verl's own rollout interface: ``register()``.

verl 0.9 runs every rollout in its async mode, in two halves that ``register`` adds under the name ``"lockstep"``
(``actor_rollout_ref.rollout.name=lockstep``):

- the server (``RolloutReplicaRegistry``): ``LockstepReplica.launch_servers`` starts one Ray actor per replica
  holding a ``lockstep.LLM`` behind lockstep's ``AsyncEngine`` (continuous batching of the agent loop's concurrent
  calls). ``LockstepServer`` has the methods verl's ``LLMServerClient`` and ``RolloutReplica`` call on a server:
  ``generate(prompt_ids, sampling_params, request_id)`` -> ``TokenOutput`` (token ids and the sampled tokens'
  logprobs), ``wake_up`` / ``sleep`` (sleep mode, level 1), ``clear_kv_cache``, ``release_kv_cache`` /
  ``resume_kv_cache``, ``abort_all_requests`` / ``resume_generation``, and ``update_weights``;
- the trainer worker's side (``_ROLLOUT_REGISTRY[("lockstep", "async")]``): ``LockstepServerAdapter``, a
  ``BaseRollout`` whose ``update_weights``, ``resume`` and ``release`` reach its replica's server actor.

verl resolves the name again in each Ray worker it starts, so the registration must happen there too: lockstep's
``verl.plugins`` entry point (``lockstep.rl.verl_plugin``) runs ``register`` wherever verl is imported.

Weights go to the actor through Ray's object store (host copies), not CUDA IPC or NCCL: correct anywhere, slower
than vLLM's colocated IPC path on a GPU. The trainer must compute the sampler's bits for the logprobs to match
(``lockstep.rl.hf.patch_model``; examples/verl_rollout.py does it on a transformers model beside verl's agent
loop); wiring it into verl's own FSDP actor is not done here (that worker does not start without a GPU).

verl 0.9.1 pins ``transformers<5.11``: it installs beside lockstep only in an environment of its own (see
docs/design.md, "verl").
"""

import functools
from typing import Any

from lockstep.sampling_params import SamplingParams

NAME = "lockstep"
_SERVER_NAME = "lockstep_rollout_server_{}"


def _sampling(sampling_params: dict[str, Any], default_max_tokens: int) -> SamplingParams:
    """verl's per-request sampling dict (vLLM's names) as ``SamplingParams``; the sampled tokens' logprobs are
    always returned (verl asks with ``logprobs``)."""
    p = dict(sampling_params)
    max_tokens = p.pop("max_tokens", p.pop("max_new_tokens", default_max_tokens))
    p.pop("logprobs", None)
    top_k = p.pop("top_k", -1)
    known = {"temperature", "top_p", "min_p", "repetition_penalty", "seed", "ignore_eos", "stop_token_ids"}
    extra = sorted(set(p) - known)
    if extra:
        raise ValueError(f"the lockstep rollout does not take sampling parameter(s) {extra}")
    return SamplingParams(max_tokens=int(max_tokens), top_k=-1 if top_k in (None, 0) else int(top_k), **p)


class LockstepServer:
    """One replica's engine (a Ray actor in verl; a plain object in tests). ``engine_args``: ``LLM`` keywords."""

    def __init__(self, model_path: str, response_length: int, **engine_args: Any) -> None:
        from lockstep.llm import LLM
        from lockstep.server.async_engine import AsyncEngine

        engine_args.setdefault("enable_sleep_mode", True)
        self.llm = LLM(model_path, **engine_args)
        self.engine = AsyncEngine(self.llm.engine)
        self.response_length = response_length
        self._paused = False

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, image_data=None, **kwargs
    ):
        """Token in, token out: verl's ``TokenOutput`` with the sampled tokens' logprobs."""
        from verl.workers.rollout.replica import TokenOutput

        if image_data or kwargs.get("video_data") or kwargs.get("audio_data"):
            raise NotImplementedError("the lockstep rollout takes text prompts only")
        params = _sampling(sampling_params, self.response_length)
        if self._paused:
            return TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted")
        group = await self.engine.submit([(request_id, list(prompt_ids), params)])
        outputs = [out async for out in group]  # one per step; the last is whole
        c = outputs[-1].outputs[0]
        stop = "aborted" if c.finish_reason == "abort" else "completed"
        return TokenOutput(token_ids=list(c.token_ids), log_probs=list(c.token_logprobs), stop_reason=stop)

    async def _call(self, fn):
        return await self.engine.run_on_engine(fn)

    async def update_weights(self, named: list) -> int:
        return len(await self._call(lambda e: e.load_weights(named)))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call(lambda e: e.wake_up(tags))

    async def sleep(self) -> None:
        await self._call(lambda e: e.sleep(1))

    async def clear_kv_cache(self) -> None:
        await self._call(lambda e: e.reset_prefix_cache())

    async def release_kv_cache(self) -> None:
        """Free the KV cache, keeping the weights (level 1 then the weights back)."""

        def release(e) -> None:
            e.sleep(1)
            e.wake_up(["weights"])

        await self._call(release)

    async def resume_kv_cache(self) -> None:
        await self._call(lambda e: e.wake_up(["kv_cache"]))

    async def abort_all_requests(self, reject_request: bool = False, **kwargs) -> dict:
        self._paused = True
        return {}

    async def resume_generation(self) -> None:
        self._paused = False

    async def start_profile(self, **kwargs) -> None:
        pass

    async def stop_profile(self) -> None:
        pass


@functools.cache
def _replica_class():
    import ray
    from verl.workers.rollout.replica import RolloutReplica

    class LockstepReplica(RolloutReplica):
        """One ``LockstepServer`` actor per replica, named so the trainer workers' adapters find it."""

        async def launch_servers(self) -> None:
            from verl.utils.config import omega_conf_to_dataclass
            from verl.workers.config import HFModelConfig

            config = self.config
            # verl hands replicas the model config as Hydra's DictConfig; the dataclass resolves local_path.
            model_config = omega_conf_to_dataclass(self.model_config, dataclass_type=HFModelConfig)
            engine_args = dict(
                dtype=config.dtype,
                max_num_seqs=config.max_num_seqs,
                gpu_memory_utilization=config.gpu_memory_utilization,
                max_model_len=config.max_model_len,
                tensor_parallel_size=config.tensor_model_parallel_size,
                seed=getattr(config, "seed", None),
            )
            actor = ray.remote(LockstepServer).options(
                name=_SERVER_NAME.format(self.replica_rank), max_concurrency=self.max_concurrency
            )
            server = actor.remote(model_config.local_path, config.response_length, **engine_args)
            self.servers = [server]
            self._server_handle = server
            # Token in, token out only (a lockstep serve gives the HTTP API); verl's router keys its servers by
            # address, so each replica gets a distinct placeholder.
            self._server_address = f"lockstep://replica-{self.replica_rank}"

    return LockstepReplica


@functools.cache
def _adapter_class():
    from verl.workers.rollout.base import BaseRollout

    class LockstepServerAdapter(BaseRollout):
        """The trainer worker's handle on its replica's ``LockstepServer`` (``server``: an actor handle, or for
        tests any object with the same async methods; default: the named actor of replica ``replica_rank``)."""

        def __init__(self, config, model_config, device_mesh, *args, server=None, replica_rank: int = -1, **kwargs):
            import os

            super().__init__(config, model_config, device_mesh)
            self._server = server
            # verl's hybrid workers pass no replica_rank: trainer rank r serves replica r // (its GPUs); one
            # lockstep actor runs the whole replica, so only the replica's first rank talks to it.
            rank = int(os.environ.get("RANK", "0"))
            per_replica = (
                self.config.tensor_model_parallel_size
                * self.config.data_parallel_size
                * self.config.pipeline_model_parallel_size
            )
            self.replica_rank = rank // per_replica if replica_rank == -1 else replica_rank
            self.is_leader_rank = replica_rank != -1 or rank % per_replica == 0

        @property
        def server(self):
            if self._server is None:
                import ray

                self._server = ray.get_actor(_SERVER_NAME.format(self.replica_rank))
            return self._server

        async def _run(self, method: str, *args):
            if not self.is_leader_rank:
                return None
            result = getattr(self.server, method)
            remote = getattr(result, "remote", None)
            return await (remote(*args) if remote is not None else result(*args))

        async def resume(self, tags: list[str]) -> None:
            await self._run("wake_up", list(tags))

        async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs) -> None:
            if wire_format != "named_tensors":
                raise NotImplementedError(f"the lockstep rollout takes named_tensors updates, not {wire_format!r}")
            # Every rank walks the generator (FSDP gathers each full tensor collectively); the leader sends.
            named = [(name, t.detach().to("cpu")) for name, t in weights]
            await self._run("update_weights", named)

        async def release(self) -> None:
            await self._run("sleep")

    return LockstepServerAdapter


def register() -> None:
    """Register the lockstep rollout with verl under ``"lockstep"`` (both halves; idempotent)."""
    from verl.workers.rollout import base, replica

    base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.LockstepServerAdapter"
    replica.RolloutReplicaRegistry.register(NAME, _replica_class)


def __getattr__(name: str):
    # The classes subclass verl's, so they exist only where verl imports (get_rollout_class imports them by name).
    if name == "LockstepServerAdapter":
        return _adapter_class()
    if name == "LockstepReplica":
        return _replica_class()
    raise AttributeError(name)
