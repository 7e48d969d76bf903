"""bench/spec_async_gpu.py --tiny: the async-vs-sync speculative bench runs end to end on the CPU, and its outputs
are plain synchronous decoding's (the bench asserts it; the report says so). No timing value is asserted."""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "spec_async_gpu.py"


def test_tiny_run(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("spec_async_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = ["--tiny", "--batches", "1,2", "--hit-rates", "0,0.5", "--tokens", "12", "--input-len", "16"]
    report = module.main([*args, "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "spec_async_gpu.json").read_text())["rows"]
    assert rows == report["rows"] and len(rows) == 4
    assert all(r["identical"] for r in rows)
    # The drafter's hits shorten the run: fewer steps than plain decoding at hit rate 0.5.
    assert all(r["steps"]["spec_sync"] < r["steps"]["plain_sync"] for r in rows if r["hit_rate"] == 0.5)
