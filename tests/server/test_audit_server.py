"""``lockstep audit`` against real servers: ours reports one completion; with --no-batch-invariant it reports
what it finds. On CPU torch's default kernels may well give one completion too (the tiny model's matmuls are
small), so that test asserts a well-formed report, not a difference: the difference is shown on the H200
(bench/audit_gpu.sh). The negative control for the analysis is in tests/audit/test_report.py."""

import asyncio
import json
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
