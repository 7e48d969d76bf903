"""The in-process ``--local`` audit on a tiny random model. (Audits of a running server are in
tests/server/test_audit_server.py, next to the server fixtures.)"""

from pathlib import Path

from lockstep.audit.runner import AuditConfig, audit_local


def test_local_audit_invariant_mode_gives_one_completion(tiny_model_dir: Path) -> None:
    folder = tiny_model_dir
    cfg = AuditConfig(prompt="local", n=6, concurrency=(1, 6), max_tokens=6, temperature=0.8, seed=2, filler=3)
    report = audit_local(str(folder), cfg, device="cpu", progress=False)
    inv = report["modes"]["invariant"]["overall"]
    assert (inv["requests"], inv["unique_completions"]) == (12, 1) and inv["logprobs"]["bitwise_identical"]
    default = report["modes"]["default"]["overall"]
    assert default["requests"] == 12 and default["unique_completions"] >= 1
