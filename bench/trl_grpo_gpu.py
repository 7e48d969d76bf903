"""TRL's GRPOTrainer on a Qwen3-8B-shape transformers model with random weights and a colocated lockstep ``LLM``
(``lockstep.rl.trl.use_lockstep``), on one GPU: TRL's own sampler-vs-trainer mismatch at every step, each step's
time split into sampling (``LLM.generate``), weight sync (``LLM.load_weights`` of the trainer's 16 GB, in
process) and training (the rest of TRL's step: its logprob forward, the loss, backward and AdamW), then the
in-process sync alone, timed again.

    python bench/trl_grpo_gpu.py                     # Qwen3-8B shape, 36 layers, bf16, 20 steps
    python bench/trl_grpo_gpu.py --layers 4 --steps 5
    python bench/trl_grpo_gpu.py --attention-backward reference   # the trainer on the reference attention backward
    python bench/trl_grpo_gpu.py --sync-only         # the 16 GB in-process sync alone
    python bench/trl_grpo_gpu.py --tiny              # a tiny Qwen3 on the CPU, fp32, 3 steps (checks the bench runs)

The trainer's model is built in memory (transformers' own random init) and the engine starts from dummy weights:
``use_lockstep`` syncs the trainer's weights into it before the first generation, so nothing 16 GB is written or
read from disk. Prompts are random token ids (the bench tokenizer has one word ``<i>`` per id); the reward is the
share of even ids in a completion, so groups differ and every step moves the weights.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import QWEN3_8B, QWEN3_TINY, build_checkpoint  # noqa: E402


def reward_even_ids(completions, **kwargs) -> list[float]:
    """The share of even token ids among a completion's words (``<i>``)."""
    rewards = []
    for text in completions:
        ids = [int(w[1:-1]) for w in text.split() if w.startswith("<") and w.endswith(">") and w[1:-1].isdigit()]
        rewards.append(sum(i % 2 == 0 for i in ids) / max(1, len(ids)))
    return rewards


def time_sync(llm, model, weight_bytes: int, device: torch.device) -> None:
    """``LLM.load_weights(sampler_weights(model))`` (the in-process sync ``use_lockstep`` runs), three times."""
    from lockstep.rl.hf import sampler_weights

    times = []
    for _ in range(3):
        _sync(device)
        t = time.perf_counter()
        llm.load_weights(sampler_weights(model))
        _sync(device)
        times.append(time.perf_counter() - t)
    best = min(times)
    held = llm.engine.runner.model.checkpoint_tensors()
    exact = all(torch.equal(held[name], t) for name, t in sampler_weights(model))
    print(f"in-process weight sync (LLM.load_weights(sampler_weights(model))): {weight_bytes / 1e9:.2f} GB in "
          f"{best:.3f} s ({weight_bytes / best / 1e9:.1f} GB/s); runs {', '.join(f'{t:.3f}' for t in times)} s; "
          f"the engine's weights equal the trainer's bit for bit: {exact}", flush=True)  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="cut the depth (default: the shape's 36)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=16, help="completions per step")
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-completion-length", type=int, default=128)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.15, help="of the memory free after the trainer")
    ap.add_argument("--no-batch-invariant", action="store_true", help="the engine on torch's kernels (control)")
    ap.add_argument("--attention-backward", default="auto", choices=["auto", "reference", "triton"],
                    help="the trainer's attention backward (lockstep.rl.attention.BACKWARD)")  # fmt: skip
    ap.add_argument("--sync-only", action="store_true", help="time the in-process weight sync alone (no TRL)")
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen3 on the CPU, fp32, 3 steps")
    args = ap.parse_args()
    if args.tiny:
        args.steps, args.batch_size, args.prompt_len, args.max_completion_length = 3, 8, 8, 12
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shape = QWEN3_TINY if args.tiny else QWEN3_8B

    import transformers
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback

    from lockstep import LLM
    from lockstep.rl import attention

    attention.BACKWARD = args.attention_backward
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        info = build_checkpoint(Path(tmp), shape, args.layers, device, weights=False)  # config + tokenizer
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        tokenizer.pad_token = tokenizer.eos_token
        config = transformers.AutoConfig.from_pretrained(tmp)
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.Qwen3ForCausalLM._from_config(config, dtype=dtype)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        vocab = shape["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        n_prompts = args.steps * args.batch_size // args.num_generations
        prompts = [" ".join(f"<{int(i)}>" for i in torch.randint(0, vocab - 1, (args.prompt_len,), generator=gen))
                   for _ in range(n_prompts)]  # fmt: skip
        if args.sync_only:
            llm = LLM(tmp, load_format="dummy", dtype=str(dtype).removeprefix("torch."), device=str(device),
                      gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.batch_size)  # fmt: skip
            print(f"{info['num_hidden_layers']} layers, {weight_bytes / 1e9:.2f} GB of {dtype} weights, {device}",
                  flush=True)  # fmt: skip
            time_sync(llm, model, weight_bytes, device)
            llm.close()
            return 0
        from datasets import Dataset  # TRL's, not needed for the sync alone
        from trl import GRPOConfig, GRPOTrainer

        from lockstep.rl.trl import use_lockstep

        grpo = GRPOConfig(
            output_dir=f"{tmp}/out", per_device_train_batch_size=args.batch_size,
            num_generations=args.num_generations, max_completion_length=args.max_completion_length,
            max_steps=args.steps, learning_rate=1e-6, logging_steps=1, report_to=[], save_strategy="no", seed=0,
            use_cpu=device.type == "cpu", bf16=False, disable_tqdm=True,
        )  # fmt: skip
        trainer = GRPOTrainer(model=model, reward_funcs=reward_even_ids, args=grpo, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": prompts}))  # fmt: skip
        llm = LLM(tmp, load_format="dummy", dtype=str(dtype).removeprefix("torch."), device=str(device), seed=0,
                  gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.batch_size,
                  batch_invariant=not args.no_batch_invariant)  # fmt: skip
        generation = use_lockstep(trainer, llm)
        print(f"{info['num_hidden_layers']} layers, {weight_bytes / 1e9:.2f} GB of {dtype} weights, {device}; "
              f"{args.batch_size} completions a step ({args.num_generations} per prompt) of up to "
              f"{args.max_completion_length} tokens after {args.prompt_len}-token prompts; attention backward "
              f"{args.attention_backward}; set up in "
              f"{time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip

        spent: dict[str, float] = {"sampling": 0.0, "sync": 0.0}

        def timed(name: str, fn):
            def run(*a, **k):
                _sync(device)
                t = time.perf_counter()
                result = fn(*a, **k)
                _sync(device)
                spent[name] += time.perf_counter() - t
                return result

            return run

        generation.generate = timed("sampling", generation.generate)
        generation.sync_weights = timed("sync", generation.sync_weights)
        rows: list[dict] = []

        class Report(TrainerCallback):
            def on_step_begin(self, _args, state, control, **kwargs):
                spent.update(sampling=0.0, sync=0.0)
                _sync(device)
                self.t = time.perf_counter()

            def on_step_end(self, _args, state, control, **kwargs):
                _sync(device)
                self.row = dict(spent, total=time.perf_counter() - self.t)

            def on_log(self, _args, state, control, logs=None, **kwargs):
                if not logs or "sampling/sampling_logp_difference/max" not in logs:
                    return
                row = self.row | {"mismatch": logs["sampling/sampling_logp_difference/max"],
                                  "reward": logs.get("reward", float("nan")),
                                  "grad_norm": logs.get("grad_norm", float("nan"))}  # fmt: skip
                rows.append(row)
                train = row["total"] - row["sampling"] - row["sync"]
                print(f"step {state.global_step:>2}: mismatch {row['mismatch']!r} | sampling {row['sampling']:.2f} s"
                      f" | training {train:.2f} s | weight sync {row['sync']:.3f} s | total {row['total']:.2f} s"
                      f" | reward {row['reward']:.3f} | grad norm {row['grad_norm']:.3g}", flush=True)  # fmt: skip

        trainer.remove_callback(PrinterCallback)  # TRL's whole log dict at every step; Report prints a line
        trainer.add_callback(Report())
        trainer.train()
        later = rows[1:] or rows  # the first step also compiles kernels
        mean = {k: sum(r[k] for r in later) / len(later) for k in ("sampling", "sync", "total")}
        print(f"steps 2-{len(rows)} mean: sampling {mean['sampling']:.2f} s, training "
              f"{mean['total'] - mean['sampling'] - mean['sync']:.2f} s, weight sync {mean['sync']:.3f} s, "
              f"total {mean['total']:.2f} s; mismatch max over all steps {max(r['mismatch'] for r in rows)!r}",
              flush=True)  # fmt: skip

        time_sync(llm, model, weight_bytes, device)
        llm.close()
    zero = all(r["mismatch"] == 0.0 for r in rows)
    ok = (not zero) if args.no_batch_invariant else zero
    print("PASS" if ok and len(rows) == args.steps else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
