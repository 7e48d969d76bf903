"""How far verl 0.9.1's own FSDP trainer engine gets on a CPU, and where lockstep's ``patch_model`` stops on it.

verl 0.9.1 has no CPU platform: it falls back to CUDA, and its trainer workers start ``torch.distributed`` with
NCCL (``RuntimeError: Distributed package doesn't have NCCL built in`` on a CPU torch). This probe registers the
missing pieces by hand, in one process (rank 0 of 1), to see what comes next:

- a ``PlatformCPU`` through ``verl.plugin.platform_manager.set_platform`` (device "cpu", backend gloo; its
  ``current_device`` answers "cpu", since verl moves the model to ``get_device_id()`` before FSDP2 loads it);
- ``VERL_ENGINE_DEVICE=cuda`` (verl registers its FSDP engine for "cuda" and "npu" only);
- ``override_config.attn_implementation=sdpa`` (verl's default is flash_attention_2) and ``strategy=fsdp2`` (FSDP1
  asks torch for ``torch.device(0)``, which fails without an accelerator).

With those, verl's ``FSDPEngine.initialize()`` builds the FSDP2 model on the CPU (``FSDPQwen3ForCausalLM``, its
LM head an ``FSDPLinear``), with verl's default mixed precision (bf16 compute on fp32 masters). The probe samples
with a lockstep ``LLM`` in that compute dtype, then compares verl's module's logprobs of the sample, unpatched and
after ``patch_model`` (which reads the classes through FSDP2's wrappers), and runs a backward through it. Printed
on the CPU (2026-12-02, verl 0.9.1, torch 2.13): unpatched 0.0303, patched 0.0 (bf16), 25 finite gradients. It
needs verl (docs/design.md, "verl", says how to install it).

    VERL_ENGINE_DEVICE=cuda python bench/verl_cpu_engine.py
"""

import argparse
import importlib.util
import os
from pathlib import Path

import torch

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29733")
os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
os.environ.setdefault("VERL_ENGINE_VENDOR", "nvidia")


def cpu_platform():
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class PlatformCPU(PlatformCUDA):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: torch.cpu)

        def is_available(self) -> bool:
            return True

        def current_device(self):
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, index) -> None:
            pass

        def synchronize(self, index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def communication_backend_name(self) -> str:
            return "gloo"

        def ray_resource_name(self) -> str:
            return "CPU"

        def is_ipc_supported(self) -> bool:
            return False

    return PlatformCPU()


def main() -> None:
    from omegaconf import open_dict
    from verl.plugin.platform import platform_manager
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.distributed import initialize_global_process_group_ray
    from verl.workers.config import HFModelConfig
    from verl.workers.engine import EngineRegistry

    from lockstep import LLM, SamplingParams
    from lockstep.rl.hf import patch_model, selective_log_softmax

    platform_manager.set_platform(cpu_platform())
    spec = importlib.util.spec_from_file_location(
        "verl_rollout", Path(__file__).parents[1] / "examples" / "verl_rollout.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = argparse.Namespace(dtype="float32", prompts=2, n=4, max_prompt_length=32, max_response_length=8)
    folder = example.build_tiny_qwen3(Path("/tmp/lockstep-verl-qwen3"))
    cfg = example.verl_config(folder, args)
    actor = cfg.actor_rollout_ref
    with open_dict(cfg):
        actor.model.override_config["attn_implementation"] = "sdpa"
        actor.actor.strategy = actor.actor.fsdp_config.strategy = "fsdp2"

    initialize_global_process_group_ray(backend="gloo")  # verl's own "cpu:gloo,cpu:gloo" is refused as a duplicate
    model_config = omega_conf_to_dataclass(actor.model, dataclass_type=HFModelConfig)
    model_config.model_type = "language_model"
    engine = EngineRegistry.new(
        model_type="language_model",
        backend="fsdp2",
        model_config=model_config,
        engine_config=omega_conf_to_dataclass(actor.actor.fsdp_config),
        optimizer_config=omega_conf_to_dataclass(actor.actor.optim),
        checkpoint_config=omega_conf_to_dataclass(actor.actor.checkpoint),
    )
    engine.initialize()
    module = engine.module
    print(f"verl's engine initialized on the CPU: {type(engine).__name__}, module {type(module).__name__}")

    # FSDP2's mixed precision: the forward computes in param_dtype (verl's default bf16), the casts of the fp32
    # masters; a sampler loading the fp32 checkpoint in that dtype rounds the same way.
    mp = module._get_fsdp_state()._mp_policy
    compute = mp.param_dtype or next(p.dtype for p in module.parameters())
    print(f"verl's FSDP2 mixed precision: param_dtype {mp.param_dtype}, reduce_dtype {mp.reduce_dtype}")
    prompt = [5, 6, 7, 8, 9, 10]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    dtype = str(compute).removeprefix("torch.")
    out = LLM(str(folder), dtype=dtype).generate([prompt], [params])[0].outputs[0]
    seq = torch.tensor([prompt + list(out.token_ids[:-1])])
    want = torch.tensor(out.token_logprobs)

    def trainer_logprobs() -> torch.Tensor:
        logits = module(input_ids=seq).logits[0, len(prompt) - 1 :]
        return selective_log_softmax(logits, torch.tensor(out.token_ids))

    with torch.no_grad():
        diff = float((trainer_logprobs() - want).abs().max())
    print(f"verl's FSDP2 model, unpatched: max |trainer - sampler ({dtype})| logprob {diff:.3g}")
    try:
        patch_model(module)
    except (ValueError, NotImplementedError) as e:
        print(f"patch_model on verl's FSDP2 model: {type(e).__name__}: {e}")
        return
    lps = trainer_logprobs()
    diff = float((lps.detach() - want).abs().max())
    print(f"verl's FSDP2 model, patched: max |trainer - sampler ({dtype})| logprob {diff!r}")
    lps.sum().backward()
    norms = [float(p.grad.full_tensor().float().norm()) for p in module.parameters() if p.grad is not None]
    finite = all(n == n and n != float("inf") for n in norms)
    total = sum(n * n for n in norms) ** 0.5
    print(f"backward through verl's FSDP2 model: {len(norms)} gradients, all finite {finite}, norm {total:.4g}")


if __name__ == "__main__":
    main()
