"""FP8 checkpoints and online FP8, dense and mixture of experts: each layout loads its bits into FP8 layers and
experts, the model tracks the dequantized full-precision model it stands for, online quantization
equals a per-channel checkpoint of the same weights, dummy weights take a checkpoint's layout, bad configs fail."""

import json

import pytest
import torch
from fp8_checkpoints import LAYOUTS, save_dequantized, save_fp8
from paged_runner import PagedRunner
from safetensors.torch import load_file
from tiny_models import save_tiny_hf

from lockstep.models.loader import load_model
from lockstep.models.quantization import fp8_scheme
from lockstep.ops import fp8

TOKENS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 7, 7, 61, 20]
# K of 192 (two scale blocks, the second ragged) and an MLP of 272 (three), so blocks and tails are exercised.
SIZE = dict(hidden_size=192, intermediate_size=272)


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def full_dir(request, tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp(request.param), request.param, **SIZE)


def _logits(model) -> torch.Tensor:
    return PagedRunner(model).prefill_logits("s", TOKENS)


def _row_scales(tensors: dict, prefix: str, layout: str, rows: int) -> torch.Tensor:
    if layout == "fp8-block":
        return fp8.expand_block_scale(tensors[f"{prefix}.weight_scale_inv"], rows, 128)
    if layout == "ct-block":
        return fp8.expand_block_scale(tensors[f"{prefix}.weight_scale"], rows, 128)
    return tensors[f"{prefix}.weight_scale"].float().reshape(-1, 1).expand(rows, 1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_checkpoint_loads_its_bits_and_tracks_the_dequantized_model(full_dir, layout, tmp_path):
    folder = save_fp8(full_dir, tmp_path / "fp8", layout)
    tensors = load_file(folder / "model.safetensors")
    model = load_model(folder)
    layer = model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert qkv.weight.dtype == fp8.FP8 and qkv.act_group == (128 if layout.endswith("block") else None)
    want = torch.cat([tensors[f"{n}.weight"] for n in names])
    assert torch.equal(qkv.weight.view(torch.uint8), want.view(torch.uint8))
    scales = [_row_scales(tensors, n, layout, tensors[f"{n}.weight"].shape[0]) for n in names]
    assert torch.equal(qkv.weight_scale, torch.cat(scales))
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
    if hasattr(layer.mlp, "w13"):  # the experts in e4m3 with their row scales; the router as it was
        assert layer.mlp.gate.weight.dtype == torch.float32 and layer.mlp.w13.dtype == fp8.FP8
        e1 = "model.layers.0.mlp.experts.1.up_proj"
        up, rows = tensors[f"{e1}.weight"], tensors[f"{e1}.weight"].shape[0]
        assert torch.equal(layer.mlp.w13[1, rows:].view(torch.uint8), up.view(torch.uint8))
        assert torch.equal(layer.mlp.w13_scale[1, rows:], _row_scales(tensors, e1, layout, rows))
        e2 = "model.layers.2.mlp.experts.5.down_proj"
        assert torch.equal(model.model.layers[2].mlp.w2[5].view(torch.uint8), tensors[f"{e2}.weight"].view(torch.uint8))
    else:
        assert layer.mlp.down_proj.weight.dtype == fp8.FP8
    # Against the full-precision model of the dequantized weights: only the activations' e4m3 rounding differs.
    reference = _logits(load_model(save_dequantized(folder, tmp_path / "deq")))
    logits = _logits(model)
    err = ((logits.double() - reference.double()).norm() / reference.double().norm()).item()
    top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"fp8 vs dequantized: rel err {err:.4f}, top-1 agreement {top1:.2f}")
    # (a mixture of experts moves further: a token whose router scores are close may pick other experts)
    assert 0 < err < (0.2 if hasattr(layer.mlp, "w13") else 0.1) and top1 >= 0.6, (err, top1)


def test_online_fp8_is_a_per_channel_checkpoint_of_the_same_weights(full_dir, tmp_path):
    online = load_model(full_dir, quantization="fp8")
    assert online.model.layers[0].self_attn.o_proj.weight.dtype == fp8.FP8
    checkpoint = load_model(save_fp8(full_dir, tmp_path / "ct", "ct-channel"))
    assert torch.equal(_logits(online), _logits(checkpoint))


def test_dummy_weights_take_the_checkpoint_layout(full_dir, tmp_path):
    folder = save_fp8(full_dir, tmp_path / "fp8", "fp8-block")
    model = load_model(folder, load_format="dummy")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == fp8.FP8 and qkv.weight_scale.shape == (qkv.weight.shape[0], 2)
    assert torch.isfinite(_logits(model)).all()


def test_quantization_configs_that_are_refused():
    with pytest.raises(ValueError, match="quantization must be"):
        fp8_scheme({}, "int8")
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        fp8_scheme({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="dynamic activations"):
        fp8_scheme({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})
    ct = json.loads(json.dumps(__import__("fp8_checkpoints")._ct_config("channel")))
    ct["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(ValueError, match="dynamic 8-bit float activations"):
        fp8_scheme({"quantization_config": ct})
    with pytest.raises(ValueError, match=r"blocks must be \[N, 128\]"):
        fp8_scheme({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}})
    assert fp8_scheme({"quantization_config": {"quant_method": "fp8"}}).weight == "tensor"
