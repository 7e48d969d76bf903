"""TRL's GRPOTrainer in server mode (``use_vllm=True, vllm_mode="server"``) against ``lockstep serve --dev-mode``.

A stock TRL server-mode GRPO script: a dataset of prompts, a reward function, a ``GRPOConfig`` pointing at the
sampler's URL. Two lines are lockstep's: ``use_lockstep_server()`` before the trainer is built (TRL's vLLM client,
with its weight broadcast over lockstep's gloo/NCCL group instead of vLLM's NCCL engine, and no ``vllm`` package
needed) and ``patch_trainer(trainer)`` after (the model on lockstep's kernels). TRL generates through the server's
``/v1/completions``, pushes the weights after every optimizer step (``/update_weights``, bucketed broadcasts) and
logs its sampler-vs-trainer metrics; ``mismatch`` below is ``sampling/sampling_logp_difference/max``, exactly 0.0
against a batch-invariant server and above 0 against one started with ``--no-batch-invariant``.

    lockstep serve MODEL --dev-mode --port 8000 &                   # on the sampler's GPUs (or the CPU)
    python examples/trl_grpo_server.py --model MODEL --server http://127.0.0.1:8000 --steps 3
"""

import argparse
import socket

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the checkpoint folder the server serves")
    ap.add_argument("--server", default="http://127.0.0.1:8000", help="the lockstep server's URL")
    ap.add_argument("--group-port", type=int, default=None, help="the weight-update group's port (default: free)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4, help="completions per step (per_device_train_batch_size)")
    ap.add_argument("--num-generations", type=int, default=4, help="completions per prompt (GRPO's group)")
    ap.add_argument("--max-completion-length", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=list(_DTYPES))
    ap.add_argument("--output-dir", default="/tmp/lockstep-trl-grpo-server")
    args = ap.parse_args(argv)

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lockstep.rl.trl_server import patch_trainer, use_lockstep_server

    def reward_digits(completions, **kwargs) -> list[float]:
        return [sum(c.isdigit() for c in text) + 0.1 * len(text) for text in completions]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=_DTYPES[args.dtype]).to(args.device)
    dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(1, 10) for b in range(1, 10)]})
    config = GRPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps,
        learning_rate=args.lr,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        # A seed for the server's sampling too: an unseeded request gets a fresh seed on the server (as vLLM's does),
        # so without it each run samples other completions. Each of a prompt's num_generations choices still gets a
        # seed of its own (derived from this one and its index).
        generation_kwargs={"seed": 0},
        use_cpu=args.device == "cpu",
        bf16=False,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=args.server,
        vllm_group_port=args.group_port or free_port(),
        vllm_server_timeout=60,
    )
    use_lockstep_server()
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward_digits, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    patch_trainer(trainer)

    steps: list[dict] = []

    class PrintMismatch(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "sampling/sampling_logp_difference/max" in logs:
                steps.append(dict(logs))
                print(
                    f"step {state.global_step}: mismatch {logs['sampling/sampling_logp_difference/max']!r} | "
                    f"is-ratio min {logs['sampling/importance_sampling_ratio/min']!r} "
                    f"max {logs['sampling/importance_sampling_ratio/max']!r} | reward {logs['reward']:.3f}",
                    flush=True,
                )

    trainer.add_callback(PrintMismatch())
    try:
        trainer.train()
    finally:
        trainer.vllm_generation.vllm_client.close_communicator()
    return steps


if __name__ == "__main__":
    main()
