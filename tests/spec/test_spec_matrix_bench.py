"""bench/spec_matrix.py --tiny: the speculative invariance matrix runs end to end on the CPU with every case at plain
decoding's bits and both negative controls differing; and the run fails (report ``ok`` False, so exit status 1)
when a case differs or when the negative control does not differ."""

import contextlib
import importlib.util
import json
from pathlib import Path

import pytest

from lockstep.engine import model_runner
from lockstep.spec import invariance

BENCH = Path(__file__).resolve().parents[2] / "bench" / "spec_matrix.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("spec_matrix_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_matrix(bench, tmp_path: Path) -> None:
    report = bench.main(["--tiny", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "spec_matrix.json").read_text())["rows"] == report["rows"]
    assert report["ok"] and report["problems"] == []
    rows = {r["case"].split(" (")[0]: r for r in report["rows"]}
    assert len(report["rows"]) == 14 and all(r["ok"] and r["error"] is None for r in report["rows"])
    assert rows["plain"]["requests"] == 9  # the JSON-schema request included
    for name in ("ngram k=1", "ngram k=3", "ngram k=7", "garbage drafter k=4", "mixed acceptance k=5", "n=2"):
        assert rows[name]["same"] and rows[name]["draft_tokens"] > 0
    for k in (3, 7):
        oracle = rows[f"oracle k={k}"]
        assert oracle["same"] and oracle["accepted_tokens"] == oracle["draft_tokens"] > 50
    assert rows["chunked prefill"]["prefill_with_verify_steps"] > 0 and rows["preemption"]["preemptions"] > 0
    assert not rows["negative: one noise per chunk"]["same"]
    assert set(rows["negative: one noise per chunk"]["differing"]) == {"sampled", "penalised"}
    # The fast kernels' control is reported only on a CPU: whether their plain decoding even repeats itself depends
    # on the host's BLAS (it did on the 2-core machine's AVX-512 kernels, not on its Haswell ones).
    assert rows["negative: fast kernels verify"]["expect"] == "any"


def test_a_differing_case_fails_the_run(bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every verify row keyed by its chunk's first position, in every case: the oracle's rows differ (or the
    # oracle sees a sequence leave plain decoding's path), and the run says so.
    monkeypatch.setattr(model_runner, "_sample_position", lambda e, j: e.start + e.num_fed)
    report = bench.main(["--tiny", "--cases", "oracle_k3", "--no-fast-control", "--out", str(tmp_path)])
    assert not report["ok"]
    [_, oracle] = report["rows"]
    assert not oracle["ok"] and oracle["differing"] and report["problems"] == [f"case failed: {oracle['case']}"]


def test_a_negative_control_that_sees_nothing_fails_the_run(
    bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(invariance, "one_noise_per_chunk", contextlib.nullcontext)
    report = bench.main(["--tiny", "--cases", "negative", "--no-fast-control", "--out", str(tmp_path)])
    [_, negative] = report["rows"]
    assert negative["same"] and not negative["ok"] and not report["ok"]
