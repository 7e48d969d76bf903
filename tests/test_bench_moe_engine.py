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


def test_mixtral_shape_and_the_tp_digest(moe_engine, tmp_path):
    # Mixtral's layout written shard by shard; the references' digest is the same at TP 1 with the tree and at TP 2
    # (gloo processes). The negative controls of TP are tests/test_llm_moe_tp.py's.
    def digest(*extra: str) -> str:  # each run writes the same seeded checkpoint
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        args = ["--smoke", "--model", "mixtral-8x7b", "--modes", "invariant", "--no-throughput", "--out", str(out)]
        report = moe_engine.main([*args, "--load-format", "auto", "--workdir", str(out / "ckpt"), *extra])
        assert report["failures"] == []
        index = json.loads((out / "ckpt" / "mixtral-8x7b-shape" / "model.safetensors.index.json").read_text())
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in index["weight_map"]
        return report["modes"]["invariant"]["matrix"]["references_digest"]

    tree = digest("--tp-invariant")
    assert digest("--tensor-parallel-size", "2") == tree
