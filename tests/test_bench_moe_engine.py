"""bench/moe_engine.py --smoke: a tiny Qwen3-MoE checkpoint written shard by shard loads (or the engine draws its
weights: load_format="dummy"), and the engine-level MoE bench runs end to end on the CPU: the invariant set shows
no difference in its matrix and its decode steps, the default set (the negative control) shows some, and the
throughput run finishes every request."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "moe_engine.py"


@pytest.fixture(scope="module")
def moe_engine():
    spec = importlib.util.spec_from_file_location("moe_engine_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_smoke_run(moe_engine, tmp_path, load_format):
    args = ["--smoke", "--out", str(tmp_path), "--workdir", str(tmp_path / "ckpt"), "--load-format", load_format]
    report = moe_engine.main(args)
    assert json.loads((tmp_path / "moe_engine.json").read_text())["failures"] == report["failures"] == []
    if load_format == "auto":  # the checkpoint written shard by shard
        index = json.loads((tmp_path / "ckpt" / "qwen3-30b-a3b-shape" / "model.safetensors.index.json").read_text())
        assert "model.layers.1.mlp.experts.15.down_proj.weight" in index["weight_map"]
    inv, default = report["modes"]["invariant"], report["modes"]["default"]
    cases = inv["matrix"]["cases"]
    assert {c["case"] for c in cases} >= {"rerun_alone", "batch_8", "chunked_16", "preemption"}
    assert all("skipped" not in c and c["seqs_differing"] == 0 and c["steps"] > 0 for c in cases)
    assert inv["matrix"]["distinct_target_outputs"] > 1  # the random weights do not collapse onto one output
    assert next(c for c in cases if c["case"] == "preemption")["preemptions"] > 0
    assert inv["decode"][0]["graphs_equal_eager"] and inv["decode"][0]["eager_ms"] > 0
    # The negative control: the default kernels change some bits when batched or chunked.
    assert any(c.get("seqs_differing", 0) for c in default["matrix"]["cases"])
    for res in (inv, default):
        tp = res["throughput"]
        assert not tp["partial"] and tp["full"]["output_tokens"] == 6 * 8
