"""examples/rl_true_on_policy.py runs end to end on the tiny model with KL exactly 0.0 at every step."""

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "rl_true_on_policy.py"


def test_example_runs_with_zero_kl(tiny_model_dir):
    cmd = [sys.executable, str(EXAMPLE), "--model", str(tiny_model_dir), "--steps", "2", "--group-size", "3",
           "--max-tokens", "8", "--lr", "1e-3"]  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = re.findall(r"^step \d+: .*$", proc.stdout, flags=re.M)
    assert len(steps) == 2, proc.stdout
    for line in steps:
        assert "| max|sampler-trainer| 0.0 |" in line and "| kl 0.0 |" in line, line


def test_example_vlm_mode_runs_with_zero_kl(tmp_path):
    """--vlm: a random Qwen3-VL sampled with images and trained through its vision tower; the weight sync covers
    the tower too (the second step samples with the updated weights and still agrees)."""
    cmd = [sys.executable, str(EXAMPLE), "--vlm", str(tmp_path / "qwen3-vl"), "--steps", "2", "--group-size", "3",
           "--max-tokens", "8", "--lr", "1e-3"]  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = re.findall(r"^step \d+: .*$", proc.stdout, flags=re.M)
    assert len(steps) == 2, proc.stdout
    for line in steps:
        assert "| max|sampler-trainer| 0.0 |" in line and "| kl 0.0 |" in line, line
