"""verl with lockstep as its rollout: verl's agent loop samples through lockstep, and the sampler's logprobs equal
the trainer's bit for bit.

A verl user picks the rollout by name, ``actor_rollout_ref.rollout.name=lockstep``; lockstep's package metadata
registers that name in every verl process (the ``verl.plugins`` entry point, ``lockstep.rl.verl_plugin``). This
script runs what of a verl GRPO step runs without a GPU, through verl's own classes under Ray:

1. ``LLMServerManager.create`` launches the replica (``LockstepReplica``: one ``LockstepServer`` actor holding a
   ``lockstep.LLM``), and ``AgentLoopManager`` (verl's single-turn agent loop in its Ray workers) samples
   ``--n`` completions per prompt through ``LLMServerClient.generate``; the batch comes back in verl's layout
   (left-padded ``prompts``, right-padded ``responses``, ``response_mask``, ``position_ids``, and
   ``rollout_log_probs``, the sampler's logprobs);
2. the trainer is the same checkpoint in ``transformers`` with ``lockstep.rl.hf.patch_model``: its logprobs of
   verl's batch equal ``rollout_log_probs`` exactly (``mismatch`` = 0.0); unpatched, transformers' kernels miss them
   (the negative control, ``mismatch_unpatched`` > 0);
3. one GRPO step with verl's own loss (``compute_grpo_outcome_advantage``, ``compute_policy_loss_vanilla``): the
   importance ratio is exactly 1; the new weights go to the server the way verl's hybrid engine sends them
   (``RolloutReplica.sleep``, then the trainer worker's ``LockstepServerAdapter.resume(["weights"])``,
   ``update_weights``, ``resume(["kv_cache"])``), and the next rollout's logprobs again equal the trainer's (and
   no longer the weights' before the step: the sync landed).

verl's FSDP actor is not in it: verl 0.9.1 has no CPU platform (it falls back to CUDA and its trainer workers
start ``torch.distributed`` with NCCL), so here the trainer runs in this process. On the CPU Ray is told of one
GPU it does not have, because verl's standalone replica reserves one for its checkpoint-engine worker (which the
lockstep rollout does not use on the CPU). verl 0.9.1 pins transformers < 5.11: run this in an environment of
its own (docs/design.md, "verl").

    python examples/verl_rollout.py                              # a tiny random Qwen3, 2 prompts x 4 samples
    python examples/verl_rollout.py --model /path/to/checkpoint --device cuda --prompts 8 --n 8
"""

import argparse
import asyncio
import copy
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

_CHARS = "".join(chr(c) for c in range(32, 127))  # one token per printable ASCII character
_EOS = 96


def build_tiny_qwen3(folder: Path) -> Path:
    """A random-weight Qwen3 (2 layers, hidden 64) with a one-token-per-character tokenizer and a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    if (folder / "config.json").exists():
        return folder
    shape = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=256)  # fmt: skip
    config = Qwen3Config(**shape, bos_token_id=None, eos_token_id=_EOS, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).float()
    with torch.no_grad():  # peaked, non-trivial weights (transformers sets norms to one)
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 2.0 * noise / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    vocab = {c: i for i, c in enumerate(_CHARS)} | {"<unk>": 95, "</s>": _EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(folder)
    return folder


def verl_config(model: Path, args: argparse.Namespace):
    """verl's own PPO trainer config (its Hydra defaults) with the lockstep rollout and a small run's sizes."""
    import verl
    from hydra import compose, initialize_config_dir

    overrides = [
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.name=lockstep",
        f"actor_rollout_ref.rollout.dtype={args.dtype}",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.max_num_seqs={args.prompts * args.n}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.prompts * args.n}",
        f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={args.max_prompt_length}",
        f"data.max_response_length={args.max_response_length}",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
    ]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def prompts_batch(num_prompts: int, n: int):
    """verl's input batch: chat messages (``raw_prompt``) with a group id (``uid``), each prompt ``n`` times."""
    from verl import DataProto

    messages = [[{"role": "user", "content": f"What is {3 + i} + {4 * i}?"}] for i in range(num_prompts)]
    raw = np.empty(num_prompts, dtype=object)
    raw[:] = messages
    batch = DataProto.from_single_dict({"raw_prompt": raw, "uid": np.array([f"q{i}" for i in range(num_prompts)],
                                                                           dtype=object)})  # fmt: skip
    return batch.repeat(repeat_times=n, interleave=True)


def trainer_logprobs(model, batch) -> torch.Tensor:
    """The trainer's logprob of each response token of verl's batch: ``[batch, response_length]`` (0 past the
    response), from one padded forward over ``input_ids`` with verl's ``attention_mask`` and ``position_ids``."""
    from lockstep.rl.hf import selective_log_softmax

    ids, mask, pos = batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["position_ids"]
    responses = batch.batch["responses"]  # [batch, response_length]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits  # [batch, width, vocab]
    width = responses.shape[1]
    lp = selective_log_softmax(logits[:, -width - 1 : -1].float(), responses)
    return lp * batch.batch["response_mask"]


def mismatch(lp: torch.Tensor, batch) -> float:
    """max |trainer - sampler| over the response tokens."""
    mask = batch.batch["response_mask"].bool()
    return float((lp.detach() - batch.batch["rollout_log_probs"]).abs()[mask].max())


def reward(tokenizer, batch) -> torch.Tensor:
    """A scalar reward on each response's last token (the share of digits in it): ``[batch, response_length]``."""
    responses, mask = batch.batch["responses"], batch.batch["response_mask"]
    rewards = torch.zeros(responses.shape, dtype=torch.float32)
    for i in range(len(responses)):
        text = tokenizer.decode(responses[i][mask[i].bool()])
        length = int(mask[i].sum())
        if length:
            rewards[i, length - 1] = sum(c.isdigit() for c in text) / length
    return rewards


def grpo_step(model, optimizer, batch, rewards: torch.Tensor, actor_config) -> dict[str, float]:
    """One GRPO update with verl's advantage and clipped policy loss, ``old_log_prob`` = the sampler's logprobs."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, compute_policy_loss_vanilla

    mask = batch.batch["response_mask"]
    advantages, _ = compute_grpo_outcome_advantage(rewards, mask, batch.non_tensor_batch["uid"])
    log_prob = trainer_logprobs(model, batch)
    old = batch.batch["rollout_log_probs"]
    ratio = torch.exp(log_prob.detach() - old)[mask.bool()]
    loss, _ = compute_policy_loss_vanilla(old, log_prob, advantages, mask, "token-mean", actor_config)
    optimizer.zero_grad()
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    optimizer.step()
    return {"loss": float(loss.detach()), "grad_norm": grad_norm, "ratio_min": float(ratio.min()),
            "ratio_max": float(ratio.max())}  # fmt: skip


def actor_config(cfg):
    """verl's ``ActorConfig`` from the trainer config (its clip ratios; one data-parallel rank: token-mean)."""
    from verl.utils.config import omega_conf_to_dataclass

    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a checkpoint folder (default: a tiny random Qwen3)")
    parser.add_argument("--device", default="cpu", help="the trainer's device")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (the GRPO group)")
    parser.add_argument("--max-prompt-length", type=int, default=32)
    parser.add_argument("--max-response-length", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--num-cpus", type=int, default=2, help="Ray's CPUs")
    args = parser.parse_args(argv)

    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.workers.rollout.llm_server import LLMServerManager

    from lockstep.rl.hf import patch_model, unpatch_model
    from lockstep.rl.verl import LockstepServerAdapter

    model_dir = args.model or build_tiny_qwen3(Path(tempfile.gettempdir()) / "lockstep-verl-qwen3")
    cfg = verl_config(model_dir, args)
    if not ray.is_initialized():
        gpus = torch.cuda.device_count() or 1  # on the CPU: one GPU for verl's resource pool to reserve
        ray.init(num_cpus=args.num_cpus, num_gpus=gpus, object_store_memory=256 << 20, include_dashboard=False)

    servers = LLMServerManager.create(cfg)
    agent_loop = AgentLoopManager.create(cfg, llm_client=servers.get_client())
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def rollout():
        batch = agent_loop.generate_sequences(prompts_batch(args.prompts, args.n))
        return batch.to(args.device)

    results = {}
    batch = rollout()
    results["tokens"] = int(batch.batch["response_mask"].sum())
    with torch.no_grad():
        results["mismatch_unpatched"] = mismatch(trainer_logprobs(model, batch), batch)
        patch_model(model)
        results["mismatch"] = mismatch(trainer_logprobs(model, batch), batch)
    print(
        f"rollout: {len(batch)} samples, {results['tokens']} response tokens; max |trainer - sampler| logprob: "
        f"{results['mismatch']} patched, {results['mismatch_unpatched']} unpatched (transformers' kernels)"
    )

    before = copy.deepcopy(model)  # the weights the first rollout sampled with
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    step = grpo_step(model, optimizer, batch, reward(tokenizer, batch), actor_config(cfg))
    results.update(step)
    print(
        f"GRPO step: loss {step['loss']:.4f}, grad norm {step['grad_norm']:.4f}, importance ratio in "
        f"[{step['ratio_min']}, {step['ratio_max']}]"
    )

    # The weight sync of verl's hybrid engine: the replica sleeps while the trainer steps, then the trainer
    # worker's adapter wakes the weights, sends them, and wakes the KV cache.
    adapter = LockstepServerAdapter(cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model, None, replica_rank=0)
    replicas = servers.get_replicas()

    async def sync():
        await asyncio.gather(*[r.sleep() for r in replicas])
        await adapter.resume(["weights"])
        await adapter.update_weights((name, p.detach()) for name, p in model.state_dict().items())
        await adapter.resume(["kv_cache"])

    asyncio.run(sync())
    second = rollout()
    with torch.no_grad():
        results["mismatch_after_sync"] = mismatch(trainer_logprobs(model, second), second)
        # Had the new weights not reached the server, the old ones would match instead.
        results["mismatch_after_sync_old_weights"] = mismatch(trainer_logprobs(before, second), second)
        unpatch_model(model)
        results["mismatch_after_sync_unpatched"] = mismatch(trainer_logprobs(model, second), second)
    results["responses_changed"] = not torch.equal(batch.batch["responses"], second.batch["responses"])
    print(
        f"after the sync: max |trainer - sampler| logprob {results['mismatch_after_sync']} patched, "
        f"{results['mismatch_after_sync_unpatched']} unpatched, "
        f"{results['mismatch_after_sync_old_weights']} on the weights before the step"
    )
    return results


if __name__ == "__main__":
    main()
