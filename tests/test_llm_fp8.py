"""The invariance matrix with FP8: weights from a Qwen3-style block-FP8 checkpoint, an FP8 KV cache (at scale 1, and
with a checkpoint's calibrated per-head scales), both, and both on a mixture of experts (FP8 experts). A
request's tokens, logprobs and prompt logprobs are the same bits alone, batched, chunked, after a prefix-cache hit
and after preemption; on the default kernels an FP8 cache does not protect them (the negative control)."""

from pathlib import Path

import pytest
from fp8_checkpoints import save_fp8, save_kv_calibrated
from test_llm import (
    TARGET_PARAMS,
    TARGET_PROMPTS,
    bits,
    make_llm,
    run_after_prefix_warmup,
    run_mixed,
    run_preempted,
)
from tiny_models import save_tiny_moe

from lockstep.ops import fp8

# Which model folder and engine settings each variant runs.
VARIANTS = {
    "fp8_weights": ("fp8", {}),
    "fp8_kv": ("full", {"kv_cache_dtype": "fp8"}),
    "fp8_both": ("fp8", {"kv_cache_dtype": "fp8"}),
    "fp8_moe_both": ("moe_fp8", {"kv_cache_dtype": "fp8"}),  # Qwen3-MoE: FP8 experts (ops.moe_fp8) too
    # calibrated per-head KV scales (models/kv_scales.py): the scaled-up keys and values of save_kv_calibrated
    "fp8_kv_scales": ("kv_scales", {"kv_cache_dtype": "fp8"}),
}
CASES = {
    "batch_of_34": ({}, 31, 1),
    "chunked_16": ({"max_num_batched_tokens": 16, "max_num_seqs": 16}, 8, 2),
    "async_chunked_16": ({"async_scheduling": True, "max_num_batched_tokens": 16, "max_num_seqs": 16}, 8, 10),
}


@pytest.fixture(scope="module")
def folders(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    moe = save_tiny_moe(tmp_path_factory.mktemp("moe"), "qwen3_moe")
    return {
        "full": tiny_model_dir,
        "fp8": save_fp8(tiny_model_dir, tmp_path_factory.mktemp("fp8"), "fp8-block"),
        "moe": moe,
        "moe_fp8": save_fp8(moe, tmp_path_factory.mktemp("moe-fp8"), "fp8-block"),
        "kv_scales": save_kv_calibrated(tiny_model_dir, tmp_path_factory.mktemp("kv"), [256.0, 16.0], per_head=True),
    }


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, folders) -> tuple[str, Path, dict, list[tuple]]:
    """(name, folder, engine settings, each target's bits when run alone on a fresh engine)."""
    which, settings = VARIANTS[request.param]
    folder = folders[which]
    refs = []
    for prompt, p in zip(TARGET_PROMPTS, TARGET_PARAMS, strict=True):
        [out] = make_llm(folder, **settings).generate([prompt], p, use_tqdm=False)
        refs.append(bits(out))
    return request.param, folder, settings, refs


def test_the_variants_run_fp8(folders) -> None:
    llm = make_llm(folders["fp8"], kv_cache_dtype="fp8")
    runner = llm.engine.runner if hasattr(llm.engine, "runner") else llm.engine.model_runner
    assert runner.kv_caches[0][0].dtype == fp8.FP8
    assert runner.model.model.layers[0].self_attn.qkv_proj.weight.dtype == fp8.FP8


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_invariance_matrix(variant, case: str) -> None:
    _, folder, settings, refs = variant
    kwargs, num_others, seed = CASES[case]
    outs = run_mixed(make_llm(folder, **settings, **kwargs), num_others, seed)
    assert [bits(o) for o in outs] == refs


def test_fp8_invariance_after_preemption_and_prefix_hits(variant, monkeypatch) -> None:
    _, folder, settings, refs = variant
    original = make_llm

    def with_settings(f, **kwargs):
        return original(f, **settings, **kwargs)

    monkeypatch.setattr("test_llm.make_llm", with_settings)
    assert [bits(o) for o in run_preempted(folder)] == refs
    outs, _ = run_after_prefix_warmup(folder)
    assert [bits(o) for o in outs] == refs


def test_fp8_results_differ_from_full_precision(folders, variant) -> None:
    # The FP8 variants compute something else than the full-precision model (the harness is not comparing a
    # model with itself), and on the default kernels an FP8 cache leaves the batch in the bits.
    name, folder, settings, refs = variant
    full = [bits(o) for o in run_mixed(make_llm(folders["moe" if "moe" in name else "full"]), 2, 0)]
    assert full != refs
    if name == "fp8_kv":
        default = run_mixed(make_llm(folder, **settings, batch_invariant=False), 31, 1)
        assert [bits(o) for o in default] != refs


def test_calibrated_kv_scales_give_the_scale_one_bits_of_the_original(folders) -> None:
    # Keys and values scaled up by powers of two with their scales: exactly the original's bits through an FP8
    # cache at scale 1, in a batch too; the calibrated checkpoint without an FP8 cache is another model.
    original = [bits(o) for o in run_mixed(make_llm(folders["full"], kv_cache_dtype="fp8"), 6, 4)]
    assert [bits(o) for o in run_mixed(make_llm(folders["kv_scales"], kv_cache_dtype="fp8"), 6, 4)] == original
    assert [bits(o) for o in run_mixed(make_llm(folders["kv_scales"]), 6, 4)] != original


def test_llm_quantizes_online_and_the_cli_takes_the_flags(folders) -> None:
    from lockstep.cli import build_parser, kernel_args
    from lockstep.config import EngineConfig

    llm = make_llm(folders["full"], quantization="fp8", kv_cache_dtype="fp8")
    assert llm.engine.runner.model.model.layers[1].mlp.down_proj.weight.dtype == fp8.FP8
    [out] = llm.generate([TARGET_PROMPTS[0]], TARGET_PARAMS[0], use_tqdm=False)
    assert len(out.token_ids) == TARGET_PARAMS[0].max_tokens
    args = build_parser().parse_args(["generate", "--quantization", "fp8", "--kv-cache-dtype", "fp8", "hi"])
    assert kernel_args(args)["quantization"] == "fp8"
    assert kernel_args(args)["kv_cache_dtype"] == "fp8"
    assert llm.load_weights({}) == []  # (into FP8 layers: tests/rl/test_rl_fp8.py)
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype="fp16")


def test_bench_fp8_check_runs_on_the_cpu(tmp_path) -> None:
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "bench" / "fp8_check.py"
    done = subprocess.run([sys.executable, str(script), "--tiny", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "fp8_check.json").read_text())
    assert report["failures"] == [] and report["fused_write_ok"]
    assert all(r["fp8_equals_dequantized_bf16"] and r["alone_equals_batched"] for r in report["kv"])
    tree = [kind for shape in report["tree"].values() for kind in shape.values()]
    assert tree and all(not t["tp_sizes_differing"] and t["all_reduce_control_differs"] for t in tree)


def test_bench_fp8_sweep_runs_on_the_cpu(tmp_path) -> None:
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "bench" / "fp8_check.py"
    done = subprocess.run([sys.executable, str(script), "--tiny", "--sweep", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "fp8_sweep.json").read_text())
    assert report["failures"] == [] and [r["M"] for r in report["sweep"]] == [3, 130]
    cells = [c for r in report["sweep"] for tile in r["tiles"].values() for c in tile.values()]
    assert len(cells) >= 8 and all(c["bits_equal"] for c in cells)  # the fused and unfused linear, every tile
    assert "fp8_check.json" not in [p.name for p in tmp_path.iterdir()]  # --sweep runs the sweep alone


def test_bench_fp8_engine_runs_on_the_cpu(tmp_path) -> None:
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "bench" / "fp8_engine.py"
    done = subprocess.run([sys.executable, str(script), "--tiny", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "fp8_engine.json").read_text())
    assert [r["config"] for r in report["results"]] == ["bf16", "fp8", "fp8+kv"]
    assert all(r["run"]["alone_equals_batched"] for r in report["results"])
    weights = {r["config"]: r["weight_gb"] for r in report["results"]}
    assert weights["fp8"] < 0.7 * weights["bf16"]  # the linear layers in one byte a weight (fp32 here: four)
