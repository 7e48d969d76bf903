"""``lockstep audit`` against real servers: ours reports one completion; with --no-batch-invariant it reports
what it finds. On CPU torch's default kernels may well give one completion too (the tiny model's matmuls are
small), so that test asserts a well-formed report, not a difference: the difference is shown on the H200
(bench/audit_gpu.sh). The negative control for the analysis is in tests/audit/test_report.py."""

import asyncio
import json
import socket
import subprocess
import sys

from lockstep.audit.runner import AuditConfig, audit_endpoint

from .conftest import Server


def test_auditor_reports_one_completion_on_our_server(server: Server) -> None:
    cfg = AuditConfig(
        prompt="audit me", n=48, concurrency=(1, 16, 48), max_tokens=10, temperature=0.8, seed=3, filler=16
    )
    report = asyncio.run(audit_endpoint(server.base_url, None, cfg, api_key=server.api_key, progress=False))
    assert report["model"] == server.model
    for level in ("1", "16", "48"):
        rep = report["levels"][level]
        assert (rep["requests"], rep["errors"], rep["unique_completions"]) == (48, 0, 1)
        assert rep["first_divergence_position"] is None and rep["logprobs"]["bitwise_identical"]
        assert rep["distinct_prefixes"] == [1] * len(rep["distinct_prefixes"])
    assert report["overall"]["unique_completions"] == 1
    assert len(report["overall"]["system_fingerprints"]) == 1


def test_audit_cli_with_expect_deterministic(server: Server, tmp_path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "lockstep.cli",
        "audit",
        server.base_url,
        "--chat",
        "--prompt",
        "hello",
        "-n",
        "24",
        "--concurrency",
        "1,24",
        "--max-tokens",
        "6",
        "--api-key",
        server.api_key,
        "--out",
        str(tmp_path),
        "--expect-deterministic",
        "--quiet",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 unique completion" in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["params"]["chat"] and report["overall"]["unique_completions"] == 1
    assert (tmp_path / "distinct_prefixes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_auditor_against_default_kernels_reports_what_it_finds(default_kernels_server: Server) -> None:
    s = default_kernels_server
    assert json.loads(__import__("httpx").get(s.url + "/health").text)["kernels"] == "default"
    cfg = AuditConfig(prompt="audit me", n=48, concurrency=(1, 48), max_tokens=10, filler=16)
    report = asyncio.run(audit_endpoint(s.base_url, None, cfg, progress=False))
    overall = report["overall"]
    assert overall["errors"] == 0 and overall["unique_completions"] >= 1
    # Whatever it found, the report says so consistently.
    if overall["unique_completions"] == 1:
        assert overall["first_divergence_position"] is None
    else:
        assert overall["first_divergence_position"] is not None and overall["competing_continuations"]
    print(f"--no-batch-invariant on CPU: {overall['unique_completions']} unique completion(s) of 96")


def audit_cli(url: str, out, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lockstep.cli", "audit", url, "-n", "2", "--concurrency", "1", "--max-tokens", "2"]
    return subprocess.run([*cmd, "--out", str(out), "--quiet", *args], capture_output=True, text=True, timeout=120)


def test_audit_of_an_endpoint_that_gives_nothing_fails_in_one_line(server: Server, tmp_path) -> None:
    # Nothing listening: one line and a non-zero exit, with or without --model (it used to print a 103-line
    # traceback, or with --model report "2 errors" and exit 0).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    for args in ((), ("--model", "m")):
        proc = audit_cli(dead, tmp_path / "dead", *args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and "cannot reach" in proc.stderr and dead in proc.stderr
        assert not (tmp_path / "dead" / "report.json").exists()
    proc = audit_cli(server.base_url, tmp_path / "key", "--api-key", "wrong")
    assert proc.returncode == 2 and "refused the API key" in proc.stderr and "Traceback" not in proc.stderr
    # Reachable, but no request succeeds (a model it does not serve): the report is written, the exit is 1.
    proc = audit_cli(server.base_url, tmp_path / "none", "--api-key", server.api_key, "--model", "not-served")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no completion came back" in proc.stderr and "not-served" in proc.stderr and "Traceback" not in proc.stderr
    report = json.loads((tmp_path / "none" / "report.json").read_text())
    assert report["overall"]["errors"] == report["overall"]["requests"] == 2
