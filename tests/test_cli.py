import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny_llama

from lockstep.cli import build_parser, main


def save_tiny_model(folder: Path) -> Path:
    return save_tiny_llama(folder, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)  # fmt: skip


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep.cli", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )


def test_parser_has_generate_options() -> None:
    args = build_parser().parse_args(
        ["generate", "hi", "--raw", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "5", "--seed", "3"]
        + ["--max-tokens", "7", "--logprobs", "--no-batch-invariant", "--device", "cpu", "--model", "m"]
    )
    assert (args.prompt, args.raw, args.temperature, args.top_p, args.top_k, args.seed) == ("hi", True, 0.5, 0.9, 5, 3)
    assert (args.max_tokens, args.logprobs, args.no_batch_invariant, args.device, args.model) == (
        7,
        True,
        True,
        "cpu",
        "m",
    )
    args = build_parser().parse_args(
        ["generate", "hi", "--min-p", "0.1", "--repetition-penalty", "1.2", "--presence-penalty", "0.5"]
        + ["--frequency-penalty", "-0.5"]
    )
    assert (args.min_p, args.repetition_penalty, args.presence_penalty, args.frequency_penalty) == (0.1, 1.2, 0.5, -0.5)
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


def test_generate_raw_on_a_tiny_model(tmp_path: Path) -> None:
    folder = save_tiny_model(tmp_path / "tiny")
    proc = run_cli("generate", "--raw", "hello", "--model", str(folder), "--max-tokens", "5", "--logprobs")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) >= 6  # five "id logprob piece" lines, a blank line, the text
    assert all(float(line.split()[1]) <= 0 for line in lines[:5])


def test_generate_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = save_tiny_model(tmp_path / "tiny")
    assert main(["generate", "--raw", "x", "--model", str(folder), "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--raw", "x", "--model", str(folder), "--repetition-penalty", "0"]) == 2
    assert "repetition_penalty" in capsys.readouterr().err


def test_generate_on_the_embedded_model(embedded_model_dir: Path) -> None:
    # The CLI finds the folder the session's fixture converted through LOCKSTEP_CACHE.
    env = {"LOCKSTEP_CACHE": str(embedded_model_dir.parent)}
    proc = run_cli("generate", "--raw", "The capital of France is", "--max-tokens", "3", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
