"""bench/long_context.py --tiny runs end to end on the CPU: both kernel sets' time to first token and decode step
rows, each with a positive floor, the JSON and the printed table agree, a context past the model's
max_position_embeddings is skipped and said so; and the prefill FLOP count is the model's own weights' count."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "long_context.py"


@pytest.fixture(scope="module")
def long_context():
    spec = importlib.util.spec_from_file_location("long_context_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run(long_context, tmp_path, capsys):
    args = ["--tiny", "--out", str(tmp_path), "--steps", "2", "--warm-steps", "1", "--repeats", "1", "--batches", "1,2"]
    report = long_context.main(args)
    saved = json.loads((tmp_path / "long_context.json").read_text())
    assert saved["results"] == report["results"]
    keys = {(r["mode"], r["what"], r["context"], r["batch"]) for r in saved["results"]}
    expected = {(m, "ttft", n, 1) for m in ("invariant", "default") for n in (64, 128)}
    expected |= {(m, "decode", n, b) for m in ("invariant", "default") for n in (64, 128) for b in (1, 2)}
    assert keys == expected and len(saved["results"]) == len(expected)
    for r in saved["results"]:
        assert r["ms"] > 0 and r["floor_ms"] > 0 and r["x_floor"] == pytest.approx(r["ms"] / r["floor_ms"])
    assert saved["copy_bandwidth"] > 0 and saved["matmul_flops_per_s"] > 0
    # A decode step's floor grows with its K/V: batch 2 reads twice the rows' K/V of batch 1 on the same weights.
    floors = {(r["mode"], r["context"], r["batch"]): r["floor_ms"] for r in saved["results"] if r["what"] == "decode"}
    assert floors["invariant", 128, 2] > floors["invariant", 128, 1] > floors["invariant", 64, 1]
    assert [s["context"] for s in saved["skipped"]] == [131072]
    assert "max_position_embeddings (1,024" in saved["skipped"][0]["why"]
    # The table printed last: one parsable line per result, then the skipped context.
    lines = capsys.readouterr().out.strip().splitlines()
    table = [line.split() for line in lines[-len(expected) - 1 : -1]]
    assert [(t[0], t[1], int(t[2]), int(t[3])) for t in table] == [
        (r["mode"], r["what"], r["context"], r["batch"]) for r in saved["results"]
    ]
    assert all(float(t[5]) > 0 for t in table)
    assert lines[-1].startswith("skipped: context 131,072")


def test_prefill_flops_count_the_models_weights(long_context):
    import transformers

    shape = dict(long_context.QWEN3_TINY)
    config = transformers.Qwen3Config(**{k: v for k, v in shape.items() if k != "arch"})
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM._from_config(config)
    linear = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2)
    head = model.lm_head.weight.numel()
    layers, n = config.num_hidden_layers, 37
    attention = layers * 4 * shape["head_dim"] * shape["num_attention_heads"] * sum(range(1, n + 1))
    assert long_context.prefill_flops(shape, layers, n) == 2 * n * linear + attention + 2 * head
