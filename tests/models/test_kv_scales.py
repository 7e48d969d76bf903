"""Calibrated FP8 KV scales read from a checkpoint (``self_attn.k_scale``/``v_scale``, per tensor and per KV head):
the cache holds K / k_scale and V / v_scale, attention reads them back scaled, and a checkpoint whose keys and values
were scaled up by powers of two (and its queries and o_proj down) gives, with its scales, exactly the bits of the
original through an FP8 cache at scale 1; without the scales (the negative control) its keys saturate e4m3 and the
logits move. Bad scales and kv_cache_schemes are refused; a rank keeps its KV heads' scales. (The engine's matrix
with calibrated scales: tests/test_llm_fp8.py, variant fp8_kv_scales.)"""

import json
import shutil

import pytest
import torch
from fp8_checkpoints import save_kv_calibrated
from paged_runner import PagedRunner
from safetensors.torch import load_file, save_file
from tiny_models import max_rel_err

from lockstep.distributed import TPGroup
from lockstep.models.loader import load_model
from lockstep.ops import fp8

TOKENS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 7, 7, 61, 20, 5, 71]
FACTORS = [256.0, 16.0]  # the tiny Llama's two KV heads (256: its keys, up to ~5, saturate e4m3 unscaled)


def _run(folder, fp8_kv: bool = True) -> tuple[torch.Tensor, PagedRunner]:
    model = load_model(folder)
    if fp8_kv:
        model.kv_cache_dtype = fp8.FP8
    runner = PagedRunner(model, block_size=4)
    return runner.prefill_logits("s", TOKENS), runner


def _keys(runner: PagedRunner, layer: int) -> torch.Tensor:
    # the cached keys of the sequence's tokens, in order: [tokens, kv_heads, head_dim] fp32
    k_cache = runner.kv_caches[layer][0]
    rows = torch.cat([k_cache[b] for b in runner.tables["s"]])[: len(TOKENS)]
    return rows.float()


def _without_scales(folder, dst):
    shutil.copytree(folder, dst)
    tensors = {k: v for k, v in load_file(dst / "model.safetensors").items() if not k.endswith(("k_scale", "v_scale"))}
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-tensor"])
def test_calibrated_scales_give_the_original_bits(tiny_model_dir, tmp_path, per_head):
    factors = FACTORS if per_head else [256.0, 256.0]
    calibrated = save_kv_calibrated(tiny_model_dir, tmp_path / "cal", factors, per_head)
    model = load_model(calibrated)
    assert model.model.layers[1].self_attn.attn.k_scale.tolist() == factors
    original, plain_runner = _run(tiny_model_dir)
    logits, runner = _run(calibrated)
    assert torch.equal(logits, original)
    # The cache holds k / k_scale: here the original keys, exactly; the scales did act.
    assert torch.equal(_keys(runner, 0), _keys(plain_runner, 0))
    # Negative control: the same checkpoint read without its scales saturates.
    unscaled, raw = _run(_without_scales(calibrated, tmp_path / "raw"))
    keys = _keys(raw, 0)
    assert keys.abs().max() == fp8.FP8_MAX and not torch.equal(keys, _keys(runner, 0))
    full, _ = _run(calibrated, fp8_kv=False)  # a full-precision cache ignores the scales
    assert max_rel_err(logits, full) < 0.5 * max_rel_err(unscaled, full), (
        max_rel_err(logits, full),
        max_rel_err(unscaled, full),
    )


def test_a_scale_divides_the_cached_values(tiny_model_dir, tmp_path):
    # k_scale 1/4 on head 0 and 2 on head 1 of the original weights: the cache holds 4 k and k / 2, exactly where
    # no value saturates or is an e4m3 subnormal.
    folder = shutil.copytree(tiny_model_dir, tmp_path / "s")
    tensors = load_file(folder / "model.safetensors")
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([0.25, 2.0])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([1.0])
    save_file(tensors, folder / "model.safetensors")
    _, plain = _run(tiny_model_dir)
    logits, scaled = _run(folder)
    base, got = _keys(plain, 0), _keys(scaled, 0)  # layer 0: the keys of the same inputs
    want = base * torch.tensor([4.0, 0.5])[None, :, None]
    normal = (base.abs() >= 2.0**-5) & (want.abs() < fp8.FP8_MAX)
    assert normal.float().mean() > 0.9
    assert torch.equal(got[normal], want[normal])


def test_bad_scales_and_schemes_are_refused(tiny_model_dir, tmp_path):
    folder = shutil.copytree(tiny_model_dir, tmp_path / "bad")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor([1.0, 2.0, 3.0])
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_scale has 3 values: expected 1 \(per tensor\) or 2"):
        load_model(folder)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(-1.0)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="finite and positive"):
        load_model(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "config_groups": {},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="static 8-bit float KV scales per tensor or per head"):
        load_model(folder)


def test_a_compressed_tensors_kv_scheme_alone_loads_and_a_rank_keeps_its_heads(tiny_model_dir, tmp_path):
    folder = save_kv_calibrated(tiny_model_dir, tmp_path / "ct", FACTORS, per_head=True)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "config_groups": {},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False,
                            "symmetric": True},
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    original, _ = _run(tiny_model_dir)
    assert torch.equal(_run(folder)[0], original)
    rank1 = load_model(folder, tp=TPGroup(rank=1, size=2))
    assert rank1.model.layers[0].self_attn.attn.k_scale.tolist() == [FACTORS[1]]
