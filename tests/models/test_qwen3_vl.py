"""Qwen3-VL (and Qwen3-VL-MoE): parity with transformers in fp32 (image features, DeepStack features, logits, greedy
ids), bitwise invariance of the vision tower and of the M-RoPE position forms, and checkpoint layouts."""

import dataclasses
import json

import pytest
import torch
from paged_runner import PagedRunner
from safetensors.torch import load_file, save_file
from tiny_models import max_rel_err
from tiny_vlm import IMAGE_PAD, hf_image_features, hf_vlm, hf_vlm_greedy, hf_vlm_logits, mm_batch, save_tiny_vlm
from vlm_parity import CASES, greedy, grids, half_precision_errors, image_prompt, prefill

from lockstep.layers.kernels import get_kernels
from lockstep.layers.torch_kernels import torch_vision_attention
from lockstep.models.loader import load_model, read_config
from lockstep.models.qwen3_vl import Qwen3VLForConditionalGeneration

# Measured on the CPU (fp32, invariant kernels): features <= 1.1e-6, logits <= 2.2e-6 of the largest magnitude.
FEATURE_TOL = 1e-5
LOGIT_TOL = 2e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("qwen3_vl"), "qwen3_vl")


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
    assert config.architecture == "Qwen3VLForConditionalGeneration"
    assert config.text_architecture == "Qwen3ForCausalLM" and config.qk_norm and not config.qkv_bias
    mm = config.multimodal
    assert (mm.image_token_id, mm.patch_size, mm.spatial_merge_size, mm.num_deepstack_layers) == (IMAGE_PAD, 16, 2, 2)
    # Interleaved: h at 1, 4, 7, ..., w at 2, 5, 8, ... (5 each), t at the rest.
    assert mm.mrope_components == (0, 1, 2) * 5 + (0,)
    assert config.vision.deepstack_visual_indexes == (0, 2) and config.vision.activation == "tanh"


def test_image_features_match_transformers(case, hf, ours):
    _, pixel_values, grid_thw = case
    ref = hf_image_features(hf, pixel_values, grid_thw)
    got = ours.encode_images(pixel_values, grid_thw)
    assert len(got) == len(ref)
    for (embeds, deep), f in zip(ref, got, strict=True):
        assert max_rel_err(f.embeds, embeds) <= FEATURE_TOL
        assert f.deepstack.shape == deep.shape == (2, *embeds.shape)
        assert max_rel_err(f.deepstack, deep) <= FEATURE_TOL


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


def test_text_only_logits_match_transformers(hf, ours):
    ids = [40, 41, 42, 3, 5, 6, 7, 8, 9]
    logits = PagedRunner(ours).prefill_logits("a", ids)
    assert max_rel_err(logits, hf_vlm_logits(hf, ids)) <= LOGIT_TOL


def test_greedy_matches_transformers(case, hf, ours):
    ids, pixel_values, grid_thw = case
    assert greedy(ours, ids, pixel_values, grid_thw, 8) == hf_vlm_greedy(hf, ids, pixel_values, grid_thw, 8)


# --- invariance ---------------------------------------------------------------------------------------------------


def _alone_vs_batched(model, folder) -> list[bool]:
    """Each image's features (and DeepStack features) encoded alone vs with images of other sizes, bitwise."""
    _, pixel_values, grid_thw = image_prompt(folder, [(28, 28), (112, 84), (64, 48), (200, 150)])
    batched = model.encode_images(pixel_values, grid_thw)
    same, start = [], 0
    for i, g in enumerate(grids(grid_thw)):
        n = g[0] * g[1] * g[2]
        alone = model.encode_images(pixel_values[start : start + n], grid_thw[i : i + 1])[0]
        same.append(torch.equal(alone.embeds, batched[i].embeds) and torch.equal(alone.deepstack, batched[i].deepstack))
        start += n
    return same


def test_encode_images_alone_equals_batched(ours, folder):
    assert _alone_vs_batched(ours, folder) == [True] * 4


def test_encode_images_negative_control(folder):
    # A tower whose attention runs over the whole call, not per image: the same check sees the images mix.
    leaky = dataclasses.replace(
        get_kernels("invariant"),
        name="test-leaky-vision",
        vision_attention=lambda q, k, v, cu, scale: torch_vision_attention(q, k, v, cu[[0, -1]], scale),
    )
    assert not any(_alone_vs_batched(load_model(folder, kernels=leaky), folder))


def test_positions_1d_equal_3d_with_equal_components(ours):
    ids = [40, 41, 42, 3, 5, 6, 7, 8, 9, 10, 11]
    flat = torch.arange(len(ids))
    one = PagedRunner(ours).forward([("a", ids, 0)], positions=flat)[0]
    three = PagedRunner(ours).forward([("a", ids, 0)], positions=flat.expand(3, -1).clone())[0]
    assert torch.equal(one, three)
    # Negative control: a different h component changes the bits.
    shifted = flat.expand(3, -1).clone()
    shifted[1] += 1
    assert not torch.equal(one, PagedRunner(ours).forward([("a", ids, 0)], positions=shifted)[0])


def test_chunked_and_batched_prefill_equal_one_shot(ours, folder):
    # Cut through the second image's tokens, with a text sequence in the same forward: the same logits bits.
    ids, pixel_values, grid_thw = image_prompt(folder, CASES["several-images"])
    full, _ = prefill(ours, PagedRunner(ours), "a", ids, pixel_values, grid_thw)
    positions, _ = ours.mrope_positions(ids, grids(grid_thw))
    mm = mm_batch(ids, ours.encode_images(pixel_values, grid_thw))
    rows = mm.rows.tolist()
    cut = rows[len(rows) // 2]
    runner = PagedRunner(ours)
    parts = []
    other = [40, 41, 42, 43, 44]
    for lo, hi in ((0, cut), (cut, len(ids))):
        keep = [j for j, r in enumerate(rows) if lo <= r < hi]
        # The text sequence comes first in the batch, so this chunk's rows sit after its tokens.
        sub = dataclasses.replace(
            mm,
            rows=torch.tensor([rows[j] - lo + len(other) for j in keep], dtype=torch.int64),
            embeds=mm.embeds[keep],
            deepstack=mm.deepstack[:, keep],
        )
        text = torch.arange(len(other)).expand(3, -1)
        pos = torch.cat([text, positions[:, lo:hi]], dim=1)
        hidden = runner.forward([(f"t{lo}", other, 0), ("a", ids[lo:hi], lo)], positions=pos, mm=sub)[1]
        parts.append(hidden)
    chunked = ours.compute_logits(torch.cat(parts))
    assert torch.equal(chunked, full), f"{int((chunked != full).sum())} logits differ"


# --- checkpoints, dtypes, the mixture of experts --------------------------------------------------------------


def test_tensor_parallel_splits_the_decoder_and_keeps_the_tower_whole(folder):
    # (tests/test_llm_vlm_tp.py runs TP 2 end to end against TP 1.)
    from lockstep.distributed import TPGroup

    one = Qwen3VLForConditionalGeneration(read_config(folder), device="meta").checkpoint_tensors()
    two = Qwen3VLForConditionalGeneration(read_config(folder), device="meta", tp=TPGroup(1, 2)).checkpoint_tensors()
    assert one.keys() == two.keys()
    split = [n for n in one if one[n].shape != two[n].shape]
    assert split and all(n.startswith("model.language_model.") or n == "lm_head.weight" for n in split)
    assert all(one[n].shape == two[n].shape for n in one if n.startswith("model.visual."))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_as_close_as_transformers(folder, case, hf, dtype):
    # Measured: bf16 within 0.02-0.10 of the fp32 logits' largest magnitude, as transformers' own bf16 run
    # (0.02-0.09); fp16 within 0.003-0.016, transformers 0.003-0.017.
    ours, theirs = half_precision_errors(folder, hf, dtype, case)
    assert ours <= 2 * theirs + 0.01


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("qwen3_vl_moe"), "qwen3_vl_moe")


def test_moe_logits_match_transformers(moe_folder):
    config = read_config(moe_folder)
    assert config.architecture == "Qwen3VLMoeForConditionalGeneration" and config.num_experts == 4
    assert config.dense_layers == (1,) and config.norm_topk_prob
    hf = hf_vlm(moe_folder)
    model = load_model(moe_folder)
    for sizes in CASES.values():
        ids, pixel_values, grid_thw = image_prompt(moe_folder, sizes)
        logits, _ = prefill(model, PagedRunner(model), "a", ids, pixel_values, grid_thw)
        assert max_rel_err(logits, hf_vlm_logits(hf, ids, pixel_values, grid_thw)) <= LOGIT_TOL
    assert greedy(model, ids, pixel_values, grid_thw, 6) == hf_vlm_greedy(hf, ids, pixel_values, grid_thw, 6)


def test_moe_released_expert_layout_loads(moe_folder, tmp_path):
    # Released Qwen3-VL-MoE files hold gate_up_proj as [E, H, 2I] and down_proj as [E, I, H]; transformers 5
    # saves [E, 2I, H] / [E, H, I]. Both load to the same model.
    import shutil

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copy(moe_folder / name, tmp_path / name)
    tensors = load_file(moe_folder / "model.safetensors")
    released = {k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in tensors.items()}
    assert any(".experts.gate_up_proj" in k for k in released)
    save_file(released, tmp_path / "model.safetensors")
    a, b = load_model(moe_folder), load_model(tmp_path)
    for (name, x), (_, y) in zip(a.checkpoint_tensors().items(), b.checkpoint_tensors().items(), strict=True):
        assert torch.equal(x, y), name


def test_released_qwen3_vl_8b_config_builds(tmp_path):
    # The shape of Qwen/Qwen3-VL-8B-Instruct's config.json (text under text_config, M-RoPE in rope_scaling),
    # built on the meta device: the parse and the module tree, no weights.
    config = {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "tie_word_embeddings": False,
        "text_config": {
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "max_position_embeddings": 262144,
            "num_attention_heads": 32,
            "num_hidden_layers": 36,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
            "rope_theta": 5000000,
            "dtype": "bfloat16",
            "vocab_size": 151936,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
        },
        "vision_config": {
            "deepstack_visual_indexes": [8, 16, 24],
            "depth": 27,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 1152,
            "in_channels": 3,
            "intermediate_size": 4304,
            "num_heads": 16,
            "num_position_embeddings": 2304,
            "out_hidden_size": 4096,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    c = read_config(tmp_path)
    assert (c.num_layers, c.head_dim, c.rope_theta, c.rope_scaling, c.dtype) == (36, 128, 5e6, None, torch.bfloat16)
    assert c.eos_token_ids == (151645,) and c.multimodal.mrope_section == (24, 20, 20)
    model = Qwen3VLForConditionalGeneration(c, device="meta", max_model_len=4096)
    names = model.checkpoint_tensors()
    assert names["model.visual.patch_embed.proj.weight"].shape == (1152, 3, 2, 16, 16)
    assert names["model.visual.deepstack_merger_list.2.linear_fc2.weight"].shape == (4096, 4 * 1152)
    assert names["model.language_model.layers.35.self_attn.q_norm.weight"].shape == (128,)
    assert "lm_head.weight" in names


def test_dummy_load(folder, case):
    ids, pixel_values, grid_thw = case
    model = load_model(folder, load_format="dummy")
    logits, _ = prefill(model, PagedRunner(model), "a", ids, pixel_values, grid_thw)
    assert torch.isfinite(logits).all() and 0.1 < logits.std() < 100


def test_mrope_positions_refuse_mismatched_grids(ours):
    ids = [1, 97] + [IMAGE_PAD] * 4 + [99, 2]
    positions, delta = ours.mrope_positions(ids, [(1, 4, 4)])
    # Text 0..1, the 2 x 2 image at 2 + (row, column), text again from 2 + 2.
    assert positions.tolist() == [
        [0, 1, 2, 2, 2, 2, 4, 5],
        [0, 1, 2, 2, 3, 3, 4, 5],
        [0, 1, 2, 3, 2, 3, 4, 5],
    ]
    assert delta == 6 - 8
    with pytest.raises(ValueError, match="makes 1"):
        ours.mrope_positions(ids, [(1, 2, 2)])
    with pytest.raises(ValueError, match="more image-token runs"):
        ours.mrope_positions(ids, [])
    with pytest.raises(ValueError, match="2 image grid"):
        ours.mrope_positions(ids, [(1, 4, 4), (1, 4, 4)])
