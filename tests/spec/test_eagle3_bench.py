"""bench/eagle3_gpu.py --tiny: the EAGLE-3 bench runs end to end on the CPU (a random head of the published layout
for a tiny Qwen3 target): every step verifies exactly k drafts, and the step splits into draft, observe and
verify times, the draft with the head's graph functions (uncaptured on the CPU) and with its eager loop, whose
proposals and bits the bench asserts are the same."""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "eagle3_gpu.py"


def test_tiny_run(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("eagle3_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.main(["--tiny", "--steps", "2", "--warm-steps", "1", "--ks", "1,3", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "eagle3_gpu.json").read_text())["rows"] == report["rows"]
    assert report["graphs_equal_eager"] is True
    assert report["head_graphs_captured"] is False  # the CPU: the graph functions ran uncaptured
    d = report["draft_graphs_equal_eager"]
    assert d["equal"] is True and d["calls"] > 0 and d["graph_runs"] > 0
    assert report["async_equal_sync"]["equal"] is True and report["async_equal_sync"]["fed_steps"] > 0
    assert report["plain"]["drafts_per_step"] == 0 and report["plain"]["step_ms"] > 0
    for row, k in zip(report["rows"], (1, 3), strict=True):
        assert row["k"] == k and row["drafts_per_step"] == k
        assert row["draft_ms"] > 0 and row["draft_ms_eager"] > 0 and row["observe_ms"] > 0 and row["verify_ms"] > 0
        assert row["tok_s_by_acceptance"]["1.0"] > row["tok_s_by_acceptance"]["0.0"]
