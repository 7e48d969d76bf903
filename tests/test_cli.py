"""``lockstep generate`` on a tiny model: every option changes what is generated the way it says, bad values are
reported, and the entry point runs as a process of its own."""

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny_llama

import lockstep.llm
from lockstep.cli import main
from lockstep.llm import LLM


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep.cli", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def cli_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller tiny Llama (1 layer, hidden 32, 128 positions) with the char tokenizer and its chat template."""
    return save_tiny_llama(tmp_path_factory.mktemp("cli") / "tiny", hidden_size=32, intermediate_size=48,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           max_position_embeddings=128)  # fmt: skip


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]  # as printed, to 6 decimals
    text: str
    stderr: str


def generate(capsys: pytest.CaptureFixture, folder: Path, prompt: str, *args: str) -> Generation:
    """``lockstep generate PROMPT --model FOLDER --logprobs ARGS`` in this process, its printout parsed."""
    assert main(["generate", prompt, "--model", str(folder), "--logprobs", *args]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    blank = lines.index("")  # "id logprob piece" lines, a blank line, the text
    rows = [line.split() for line in lines[:blank]]
    return Generation([int(r[0]) for r in rows], [float(r[1]) for r in rows], "\n".join(lines[blank + 1 :]), err)


def test_greedy_by_default_and_max_tokens(capsys: pytest.CaptureFixture, cli_model_dir: Path) -> None:
    greedy = generate(capsys, cli_model_dir, "abc", "--raw", "--max-tokens", "12")
    assert len(greedy.tokens) == 12 and greedy.stderr == ""  # no seed drawn: nothing was sampled
    assert generate(capsys, cli_model_dir, "abc", "--raw", "--max-tokens", "12", "--temperature", "0") == greedy
    assert generate(capsys, cli_model_dir, "abc", "--raw", "--max-tokens", "3").tokens == greedy.tokens[:3]


def test_sampling_options_change_the_tokens(capsys: pytest.CaptureFixture, cli_model_dir: Path) -> None:
    run = lambda *args: generate(capsys, cli_model_dir, "abc", "--raw", "--max-tokens", "12", *args)
    greedy = run()
    sampled = run("--temperature", "1", "--seed", "3")
    assert sampled.tokens != greedy.tokens and run("--temperature", "1", "--seed", "3") == sampled
    assert run("--temperature", "1", "--seed", "4").tokens != sampled.tokens
    # Each cut leaves only the most likely token, so the sampled request decodes greedily.
    for cut in (["--top-k", "1"], ["--top-p", "0.01"], ["--min-p", "1"]):
        assert run("--temperature", "1", "--seed", "3", *cut).tokens == greedy.tokens, cut
    # "abc" makes the tiny model repeat itself; each penalty steers greedy decoding elsewhere.
    for penalty in (["--repetition-penalty", "1.5"], ["--presence-penalty", "1"], ["--frequency-penalty", "1"]):
        assert run(*penalty).tokens != greedy.tokens, penalty


def test_a_drawn_seed_is_printed_and_reproduces(capsys: pytest.CaptureFixture, cli_model_dir: Path) -> None:
    run = lambda *args: generate(capsys, cli_model_dir, "abc", "--raw", "--max-tokens", "8", *args)
    drawn = run("--temperature", "1")
    seed = re.fullmatch(r"\(seed (\d+)\)\n", drawn.stderr)
    assert seed, drawn.stderr
    again = run("--temperature", "1", "--seed", seed[1])
    assert (again.tokens, again.logprobs, again.text, again.stderr) == (drawn.tokens, drawn.logprobs, drawn.text, "")


def test_chat_template_unless_raw(capsys: pytest.CaptureFixture, cli_model_dir: Path) -> None:
    # The tiny tokenizer's template is "ROLE: CONTENT\n" per message, then "assistant:".
    run = lambda prompt, *args: generate(capsys, cli_model_dir, prompt, "--max-tokens", "8", *args)
    chat = run("hello")
    assert chat == run("user: hello\nassistant:", "--raw")
    assert chat.tokens != run("hello", "--raw").tokens
    assert run("hello", "--system", "be brief") == run("system: be brief\nuser: hello\nassistant:", "--raw")


def test_kernel_and_dtype_options_reach_the_engine(
    capsys: pytest.CaptureFixture, cli_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[LLM] = []

    class RecordingLLM(LLM):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(lockstep.llm, "LLM", RecordingLLM)
    run = lambda *args: generate(capsys, cli_model_dir, "abc", "--raw", "--max-tokens", "8", *args)
    fp32 = run()
    default = run("--no-batch-invariant", "--device", "cpu")
    bf16 = run("--dtype", "bfloat16")
    overlapped = run("--async-scheduling")
    invariant_engine, default_engine, bf16_engine, async_engine = (llm.engine for llm in built)
    assert async_engine.config.async_scheduling and not invariant_engine.config.async_scheduling
    assert overlapped == fp32  # the same ids and logprobs, printed alike
    assert invariant_engine.config.kernels == "invariant" and default_engine.config.kernels == "default"
    assert next(default_engine.runner.model.parameters()).device.type == "cpu"
    assert next(bf16_engine.runner.model.parameters()).dtype == torch.bfloat16
    # torch's kernels give the same greedy tokens with logprobs equal to rounding; bf16 weights move them more.
    err = lambda g: max(abs(a - b) for a, b in zip(g.logprobs, fp32.logprobs, strict=True))
    assert default.tokens == fp32.tokens and err(default) < 1e-3
    assert bf16.tokens == fp32.tokens and 5e-3 < err(bf16) < 0.1


def test_tensor_parallel_generate_prints_what_one_process_with_the_tree_prints(
    capsys: pytest.CaptureFixture, cli_model_dir: Path
) -> None:
    # A process of its own that starts a gloo worker, generates and stops it; the same printout (ids, logprobs to
    # 6 decimals, text) as one process with the chunk tree. tests/test_llm_tp.py checks the bits.
    args = ["generate", "--raw", "hello", "--model", str(cli_model_dir), "--max-tokens", "8", "--logprobs"]
    proc = run_cli(*args, "--tensor-parallel-size", "2")
    assert proc.returncode == 0, proc.stderr
    assert main([*args, "--tp-invariant"]) == 0
    assert proc.stdout == capsys.readouterr().out
    proc = run_cli(*args, "--tensor-parallel-size", "3")
    assert proc.returncode != 0 and "tensor-parallel sizes dividing 8" in proc.stderr


def test_python_m_lockstep_cli_prints_what_main_prints(capsys: pytest.CaptureFixture, cli_model_dir: Path) -> None:
    args = ["generate", "--raw", "hello", "--model", str(cli_model_dir), "--max-tokens", "5", "--logprobs"]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert main(args) == 0
    assert proc.stdout == capsys.readouterr().out
    lines = proc.stdout.splitlines()
    assert len(lines) >= 7 and lines[5] == ""  # five "id logprob piece" lines, a blank line, the text
    assert all(float(line.split()[1]) <= 0 for line in lines[:5])


def test_generate_reports_bad_input(cli_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    folder = cli_model_dir
    assert main(["generate", "--raw", "x", "--model", str(folder), "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--raw", "x", "--model", str(folder), "--repetition-penalty", "0"]) == 2
    assert "repetition_penalty" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(folder)])  # no prompt: argparse's usage error
    assert exit_.value.code == 2 and "prompt" in capsys.readouterr().err


def test_generate_on_the_embedded_model(embedded_model_dir: Path) -> None:
    # The CLI finds the folder the session's fixture converted through LOCKSTEP_CACHE.
    env = {"LOCKSTEP_CACHE": str(embedded_model_dir.parent)}
    proc = run_cli("generate", "--raw", "The capital of France is", "--max-tokens", "3", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_a_device_torch_cannot_use_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, cli_model_dir: Path
) -> None:
    import lockstep.server.state

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model loaded before the device was checked")

    monkeypatch.setattr(lockstep.server.state, "create_state", must_not_load)
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU-only build, whatever this machine has
    for argv in (["generate", "hi", "--model", str(cli_model_dir), "--device", "cuda"], ["serve", "--device", "cuda"]):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "CPU-only build" in err and "--device cpu" in err, err
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        LLM(str(cli_model_dir), device="cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="there are 1 CUDA GPUs"):
        LLM(str(cli_model_dir), device="cuda:1")
    with pytest.raises(ValueError, match="cuda:N"):
        LLM(str(cli_model_dir), device="cuda:x")


def test_serve_finds_a_port_in_use_before_loading(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    import socket

    import lockstep.server.state

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model loaded before the port was checked")

    monkeypatch.setattr(lockstep.server.state, "create_state", must_not_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"port {port} on 127.0.0.1 is already in use" in err, err
