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
