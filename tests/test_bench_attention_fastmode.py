"""bench/attention_check.py --smoke --only fastmode runs through the Triton interpreter: the fast kernel set's decode
launches (a CUDA graph's, an eager step's, the old rule's and fixed split sizes) agree with the invariant launch to
bf16 rounding, a graph step's gives the invariant bits, and the run exits 0 (it exits 1 on any failure)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fastmode_table_smoke():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "attention_check.py"), "--smoke", "--only", "fastmode"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [line.split() for line in run.stdout.splitlines() if line.strip()[:1].isdigit()]
    # One row per (context, batch) of the smoke config: batch, context, the rule's split / the old rule's.
    assert [(int(r[0]), int(r[1])) for r in lines] == [(1, 100), (3, 100), (1, 600), (3, 600)]
    assert all(r[2].split("/")[0] == "512" for r in lines)  # the invariant split: too little work for a larger one
    assert "ALL CHECKS PASSED" in run.stdout
