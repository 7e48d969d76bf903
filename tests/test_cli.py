import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.cli import build_parser, main


def save_tiny_model(folder: Path) -> Path:
    """A tiny random Llama with vocab 97 and a one-token-per-character tokenizer (printable ASCII)."""
    import string

    import torch
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = string.printable[:95]
    vocab = {c: i for i, c in enumerate(chars)} | {"<unk>": 95, "</s>": 96}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(
        folder
    )
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        eos_token_id=96,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).float().save_pretrained(folder)
    return folder


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


def test_generate_on_the_embedded_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Same cache folder as tests/engine/conftest.py's embedded_model_dir: the session converts once.
    cache = os.environ.get("LOCKSTEP_CACHE") or str(tmp_path_factory.getbasetemp() / "lockstep-cache")
    proc = run_cli("generate", "--raw", "The capital of France is", "--max-tokens", "3", env={"LOCKSTEP_CACHE": cache})
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
