"""TRL's GRPOTrainer with lockstep as its generator: the sampler's and the trainer's logprobs agree bit for bit.

A TRL user's GRPO script: a dataset of prompts, a reward function, a ``GRPOConfig``, ``GRPOTrainer``. Two lines
differ from a vLLM run: the generator is a ``lockstep.LLM`` in this process, and ``use_lockstep(trainer, llm)``
hands it to the trainer (which patches the model onto lockstep's kernels, ``lockstep.rl.hf.patch_model``). The
engine samples every completion and gets the trainer's weights after each optimizer step (``LLM.load_weights``);
TRL recomputes each sampled token's logprob and logs its own sampler-vs-trainer metrics, which this script prints
per step: ``mismatch`` is TRL's ``sampling/sampling_logp_difference/max``, exactly 0.0 with lockstep, so the
importance ratio TRL applies is exactly 1. ``--no-batch-invariant`` runs the engine on torch's default kernels (the
negative control): the mismatch is then above 0 (3.6e-5 and 2.9e-5 in the first two steps on the embedded model,
fp32 on the CPU; each step took about 45 s on 2 shared cores).

    python examples/trl_grpo.py --steps 5                       # the embedded SmolLM2-135M-Instruct on the CPU
    python examples/trl_grpo.py --steps 5 --no-batch-invariant  # the negative control
    python examples/trl_grpo.py --model /path/to/checkpoint --device cuda --dtype bfloat16
"""

import argparse
import re

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def reward_correct(completions, answer, **kwargs) -> list[float]:
    """1 when the first number in the completion is the answer, else a little credit for digits (random-weight
    models get non-zero advantages too)."""
    rewards = []
    for completion, ans in zip(completions, answer, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        match = re.search(r"-?\d+", text)
        if match is not None and int(match.group()) == ans:
            rewards.append(1.0)
        else:
            rewards.append(0.1 * sum(c.isdigit() for c in text) / max(1, len(text)))
    return rewards


def arithmetic_dataset(n: int, seed: int, conversational: bool):
    """``n`` prompts "What is a + b?" with their answers, as TRL's GRPO datasets look."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    pairs = [(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(n)]
    if conversational:
        prompts = [[{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}] for a, b in pairs]
    else:
        prompts = [f"{a}+{b}=" for a, b in pairs]
    return Dataset.from_dict({"prompt": prompts, "answer": [a + b for a, b in pairs]})


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded SmolLM2)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8, help="completions per step (per_device_train_batch_size)")
    ap.add_argument("--num-generations", type=int, default=4, help="completions per prompt (GRPO's group)")
    ap.add_argument("--max-completion-length", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=list(_DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-dir", default="/tmp/lockstep-trl-grpo")
    ap.add_argument("--no-batch-invariant", action="store_true", help="the engine on torch's default kernels")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lockstep import LLM
    from lockstep.rl.trl import use_lockstep

    if args.model is None:
        from lockstep.models.embedded import default_model_path

        args.model = str(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=_DTYPES[args.dtype]).to(args.device)
    dataset = arithmetic_dataset(args.batch_size * args.steps, args.seed, tokenizer.chat_template is not None)
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
        seed=args.seed,
        use_cpu=args.device == "cpu",
        bf16=False,  # the model runs in its own dtype, as the engine does (no autocast)
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward_correct, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    llm = LLM(
        args.model, dtype=args.dtype, device=args.device, seed=args.seed, batch_invariant=not args.no_batch_invariant
    )
    use_lockstep(trainer, llm)

    steps: list[dict] = []

    class PrintMismatch(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "sampling/sampling_logp_difference/max" in logs:
                steps.append(dict(logs))
                print(
                    f"step {state.global_step}: mismatch {logs['sampling/sampling_logp_difference/max']!r} | "
                    f"is-ratio min {logs['sampling/importance_sampling_ratio/min']!r} "
                    f"max {logs['sampling/importance_sampling_ratio/max']!r} | reward {logs['reward']:.3f} | "
                    f"loss {logs['loss']:.4g}",
                    flush=True,
                )

    trainer.add_callback(PrintMismatch())
    mode = "lockstep (batch-invariant)" if not args.no_batch_invariant else "torch default kernels"
    print(f"model {args.model} | engine {mode} | device {args.device} | dtype {args.dtype}", flush=True)
    trainer.train()
    return steps


if __name__ == "__main__":
    main()
