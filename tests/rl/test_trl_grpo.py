"""examples/trl_grpo.py: TRL's GRPOTrainer generating with lockstep reads TRL's own sampler-vs-trainer mismatch
as exactly 0 (importance ratio exactly 1) at every step, and above 0 with the engine on torch's default kernels."""

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "trl_grpo.py"


def _run(model_dir: Path, tmp_path: Path, *extra: str) -> list[dict]:
    spec = importlib.util.spec_from_file_location("trl_grpo_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    argv = ["--model", str(model_dir), "--steps", "3", "--batch-size", "4", "--num-generations", "4",
            "--max-completion-length", "8", "--lr", "0.01", "--output-dir", str(tmp_path), *extra]  # fmt: skip
    return example.main(argv)


def test_grpo_on_lockstep_has_zero_mismatch(tiny_model_dir, tmp_path):
    steps = _run(tiny_model_dir, tmp_path)
    assert len(steps) == 3
    for logs in steps:
        assert logs["sampling/sampling_logp_difference/max"] == 0.0, logs
        assert logs["sampling/importance_sampling_ratio/min"] == logs["sampling/importance_sampling_ratio/max"] == 1.0
    assert any(logs["grad_norm"] > 0 for logs in steps)  # the weights did move (and were synced each step)


def test_grpo_negative_control_sees_a_mismatch(tiny_model_dir, tmp_path):
    steps = _run(tiny_model_dir, tmp_path, "--no-batch-invariant")
    assert len(steps) == 3
    assert all(logs["sampling/sampling_logp_difference/max"] > 0 for logs in steps), steps


def test_grpo_with_peft_lora_has_zero_mismatch(tiny_model_dir, tmp_path):
    """TRL wraps the model in LoRA (``peft_config``); the engine receives the merged weights after each step
    (``sampler_weights``) and the mismatch stays exactly 0 while the adapters train."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from lockstep import LLM
    from lockstep.rl import sampler_weights
    from lockstep.rl.trl import use_lockstep

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]})

    def reward(completions, **kwargs):
        return [sum(c.isdigit() for c in text) + 0.1 * len(text) for text in completions]

    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                        max_completion_length=8, max_steps=3, learning_rate=5e-2, logging_steps=1, report_to=[],
                        save_strategy="no", seed=0, use_cpu=True, bf16=False)  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora)  # fmt: skip
    generation = use_lockstep(trainer, LLM(str(tiny_model_dir), seed=0))
    trainer.train()
    steps = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    assert len(steps) == 3 and generation.num_syncs == 3
    assert all(h["sampling/sampling_logp_difference/max"] == 0.0 for h in steps), steps
    merged = dict(sampler_weights(trainer.model))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )
