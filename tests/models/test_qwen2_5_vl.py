"""Qwen2.5-VL: parity with transformers in fp32 (image features through window attention, logits, greedy ids),
bitwise invariance of the vision tower, and the checkpoint layouts (released names and config, transformers 5
names, tied embeddings)."""

import dataclasses
import json
import shutil

import pytest
import torch
from paged_runner import PagedRunner
from safetensors.torch import load_file, save_file
from tiny_models import max_rel_err
from tiny_vlm import IMAGE_PAD, hf_image_features, hf_vlm, hf_vlm_greedy, hf_vlm_logits, save_tiny_vlm
from vlm_parity import CASES, greedy, grids, half_precision_errors, image_prompt, prefill

from lockstep.layers.kernels import get_kernels
from lockstep.layers.torch_kernels import torch_vision_attention
from lockstep.models.loader import load_model, read_config
from lockstep.models.qwen2_5_vl import window_order

# Measured on the CPU (fp32, invariant kernels): features <= 1.9e-6, logits <= 1.8e-5 of the largest magnitude.
FEATURE_TOL = 1e-5
LOGIT_TOL = 5e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl")


@pytest.fixture(scope="module")
def hf(folder):
    return hf_vlm(folder)


@pytest.fixture(scope="module")
def ours(folder):
    return load_model(folder)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, folder):
    return image_prompt(folder, CASES[request.param])


def test_config(folder):
    config = read_config(folder)
    assert config.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert config.text_architecture == "Qwen2ForCausalLM" and config.qkv_bias and not config.qk_norm
    assert config.multimodal.mrope_components == (0, 0, 1, 1, 1, 2, 2, 2)  # sections of 2, 3, 3
    assert config.multimodal.num_deepstack_layers == 0
    assert config.vision.fullatt_block_indexes == (1, 3) and config.vision.window_size == 56


def test_window_order():
    # 6 x 8 patches = 3 x 4 merged tokens, windows of 2 x 2: [0 1 4 5] [2 3 6 7] [8 9] [10 11].
    order, lengths = window_order((1, 6, 8), 2, 2)
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 10, 11] and lengths == (4, 4, 2, 2)


def test_image_features_match_transformers(case, hf, ours):
    _, pixel_values, grid_thw = case
    ref = hf_image_features(hf, pixel_values, grid_thw)
    got = ours.encode_images(pixel_values, grid_thw)
    assert len(got) == len(ref)
    for (embeds, _), f in zip(ref, got, strict=True):
        assert f.deepstack is None
        assert max_rel_err(f.embeds, embeds) <= FEATURE_TOL


def test_mrope_positions_match_transformers(case, hf, ours):
    ids, _, grid_thw = case
    t = torch.tensor([ids])
    ref, ref_delta = hf.model.get_rope_index(t, (t == IMAGE_PAD).int(), image_grid_thw=grid_thw)
    positions, delta = ours.mrope_positions(ids, grids(grid_thw))
    assert torch.equal(positions, ref[:, 0]) and delta == int(ref_delta) < 0


@pytest.mark.parametrize("kernels", ["invariant", "default"])
def test_logits_match_transformers(case, hf, folder, ours, kernels):
    ids, pixel_values, grid_thw = case
    model = ours if kernels == "invariant" else load_model(folder, kernels=kernels)
    logits, _ = prefill(model, PagedRunner(model), "a", ids, pixel_values, grid_thw)
    assert max_rel_err(logits, hf_vlm_logits(hf, ids, pixel_values, grid_thw)) <= LOGIT_TOL


def test_greedy_matches_transformers(case, hf, ours):
    ids, pixel_values, grid_thw = case
    assert greedy(ours, ids, pixel_values, grid_thw, 8) == hf_vlm_greedy(hf, ids, pixel_values, grid_thw, 8)


def _alone_vs_batched(model, folder) -> list[bool]:
    _, pixel_values, grid_thw = image_prompt(folder, [(28, 28), (112, 84), (64, 48), (200, 150)])
    batched = model.encode_images(pixel_values, grid_thw)
    same, start = [], 0
    for i, g in enumerate(grids(grid_thw)):
        n = g[0] * g[1] * g[2]
        alone = model.encode_images(pixel_values[start : start + n], grid_thw[i : i + 1])[0]
        same.append(torch.equal(alone.embeds, batched[i].embeds))
        start += n
    return same


def test_encode_images_alone_equals_batched(ours, folder):
    assert _alone_vs_batched(ours, folder) == [True] * 4


def test_encode_images_negative_control(folder):
    # Windows that ignore image boundaries (attention over the whole call): the same check sees the images mix.
    leaky = dataclasses.replace(
        get_kernels("invariant"),
        name="test-leaky-vision",
        vision_attention=lambda q, k, v, cu, scale: torch_vision_attention(q, k, v, cu[[0, -1]], scale),
    )
    assert not any(_alone_vs_batched(load_model(folder, kernels=leaky), folder))


# --- checkpoint layouts ---------------------------------------------------------------------------------------


def _copy_side_files(src, dst) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "config.json"):
        shutil.copy(src / name, dst / name)


def _same_weights(a, b) -> None:
    for (name, x), (_, y) in zip(a.checkpoint_tensors().items(), b.checkpoint_tensors().items(), strict=True):
        assert torch.equal(x, y), name


def test_released_names(folder):
    # transformers saves Qwen2.5-VL under its released names.
    names = load_file(folder / "model.safetensors").keys()
    assert any(n.startswith("visual.") for n in names) and any(n.startswith("model.layers.") for n in names)


def test_transformers_5_names_load(folder, ours, tmp_path):
    _copy_side_files(folder, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    renamed = {ours.checkpoint_name(k): v for k, v in tensors.items()}
    assert any(k.startswith("model.visual.") for k in renamed)
    assert any(k.startswith("model.language_model.layers.") for k in renamed)
    save_file(renamed, tmp_path / "model.safetensors")
    _same_weights(ours, load_model(tmp_path))


def test_released_flat_config(folder, tmp_path):
    # Released Qwen2.5-VL config.json files keep the text model's keys at the top level, with
    # rope_scaling {"type": "mrope", "mrope_section": [...]} and torch_dtype.
    hf = json.loads((folder / "config.json").read_text())
    text = hf.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**hf, **text, "rope_theta": rope["rope_theta"]}
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    flat["torch_dtype"] = flat.pop("dtype")
    flat.pop("model_type", None)
    (tmp_path / "config.json").write_text(json.dumps(flat))
    assert read_config(tmp_path) == read_config(folder)


def test_tied_embeddings(tmp_path):
    folder = save_tiny_vlm(tmp_path / "tied", "qwen2_5_vl", tie_word_embeddings=True)
    assert read_config(folder).tie_word_embeddings
    model = load_model(folder)
    assert model.lm_head.weight is model.language_model.embed_tokens.weight
    ids, pixel_values, grid_thw = image_prompt(folder, CASES["one-image"])
    logits, _ = prefill(model, PagedRunner(model), "a", ids, pixel_values, grid_thw)
    assert max_rel_err(logits, hf_vlm_logits(hf_vlm(folder), ids, pixel_values, grid_thw)) <= LOGIT_TOL


def test_released_names_map_a_state_dict(folder, ours, hf):
    # What an RL trainer syncs: transformers' in-memory state_dict (model.visual.*, model.language_model.*).
    items = list(ours.released_names(hf.state_dict().items()))
    slots = ours.checkpoint_tensors()
    assert {n for n, _ in items} >= set(slots)
    for name, tensor in items:
        if name in slots:
            assert torch.equal(slots[name], tensor), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_as_close_as_transformers(folder, case, hf, dtype):
    # Measured: bf16 within 0.02-0.10 of the fp32 logits' largest magnitude, as transformers' own bf16 run
    # (0.02-0.09); fp16 within 0.003-0.016, transformers 0.003-0.017.
    ours, theirs = half_precision_errors(folder, hf, dtype, case)
    assert ours <= 2 * theirs + 0.01
