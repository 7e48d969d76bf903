"""Trainer logprobs for image prompts (lockstep.rl.token_logprobs on a vision-language policy) equal the engine's
sampled logprobs bit for bit: tiny random Qwen3-VL and Qwen2.5-VL, image prompts alone and micro-batched with text
prompts, in each of the prompt forms; the torch kernels and another image show the comparison can see a difference.
"""

from pathlib import Path

import pytest
import torch
from tiny_vlm import IMAGE_PAD, VISION_END, VISION_START, save_tiny_vlm, tiny_image

from lockstep import LLM, SamplingParams
from lockstep.rl import load_policy, token_logprobs

PLACE = [VISION_START, IMAGE_PAD, VISION_END]
# Qwen3-VL: patch 16, merge 2, so W x H pixels is (W / 32) * (H / 32) image tokens; Qwen2.5-VL: patch 14.
A, B, C = tiny_image(96, 64, 1), tiny_image(128, 96, 2), tiny_image(64, 64, 3)
A2 = tiny_image(96, 64, 9)  # A's size, other pixels


def _text(seed: int, n: int) -> list[int]:
    return [(7 * seed + 3 * j) % 90 + 1 for j in range(n)]


def _requests() -> list[dict | list[int]]:
    """Image prompts (one image, two images of other sizes, an image after text) among text prompts."""
    return [
        {"prompt_token_ids": PLACE + _text(1, 9), "multi_modal_data": {"image": A}},
        _text(2, 13),
        {
            "prompt_token_ids": _text(3, 4) + PLACE + _text(4, 5) + PLACE + _text(5, 3),
            "multi_modal_data": {"image": [B, C]},
        },
        _text(6, 5),
        {"prompt_token_ids": _text(7, 11) + PLACE, "multi_modal_data": {"image": [C]}},
    ]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=5 + 3 * i, ignore_eos=True) for i in range(5)]


def _sample(folder: Path, requests: list, **engine_args) -> list:
    llm = LLM(str(folder), block_size=4, num_kv_blocks=512, **engine_args)
    return llm.generate(requests, _params()[: len(requests)], use_tqdm=False)


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-qwen3-vl-rl"), "qwen3_vl")


@pytest.fixture(scope="module")
def sampled(qwen3_vl: Path) -> list:
    """The requests in one batch with chunked prefill cutting through the image tokens."""
    return _sample(qwen3_vl, _requests(), max_num_batched_tokens=13, max_num_seqs=4)


@pytest.fixture(scope="module")
def policy(qwen3_vl: Path):
    return load_policy(qwen3_vl)


def _assert_bitwise(lps: list[torch.Tensor], outs: list) -> None:
    assert len(lps) == len(outs)
    for i, (lp, out) in enumerate(zip(lps, outs, strict=True)):
        assert lp.dtype == torch.float32 and lp.requires_grad
        assert torch.equal(lp.detach(), torch.tensor(out.token_logprobs, dtype=torch.float32)), f"sequence {i}"


@pytest.mark.parametrize("packing", [dict(micro_batch_size=1), dict(micro_batch_size=2), dict()])
def test_image_prompts_bitwise(policy, sampled, packing):
    """The dict prompts as LLM.generate took them (one placeholder per image), alone and micro-batched with text."""
    completions = [out.token_ids for out in sampled]
    _assert_bitwise(token_logprobs(policy, _requests(), completions, **packing), sampled)


def test_expanded_and_processed_forms(policy, sampled):
    """RequestOutput.prompt_token_ids (placeholders expanded) with the images, and (ids, MultimodalInputs) as the
    policy's image processor gives them: the same bits."""
    completions = [out.token_ids for out in sampled]
    expanded, processed = [], []
    for req, out in zip(_requests(), sampled, strict=True):
        if isinstance(req, dict):
            expanded.append({"prompt_token_ids": out.prompt_token_ids, "multi_modal_data": req["multi_modal_data"]})
            images = req["multi_modal_data"]["image"]
            processed.append(
                policy.image_processor.process(
                    req["prompt_token_ids"], images if isinstance(images, list) else [images]
                )
            )
        else:
            expanded.append(out.prompt_token_ids)
            processed.append(out.prompt_token_ids)
    assert [p[0] for p in processed if isinstance(p, tuple)] == [sampled[i].prompt_token_ids for i in (0, 2, 4)]
    _assert_bitwise(token_logprobs(policy, expanded, completions, micro_batch_size=3), sampled)
    _assert_bitwise(token_logprobs(policy, processed, completions), sampled)


def test_gradients_reach_the_vision_tower(policy, sampled):
    """The logprobs are differentiable through the decoder and the vision tower (patch embedding to merger)."""
    policy.zero_grad(set_to_none=True)
    lps = token_logprobs(policy, _requests()[:1], [sampled[0].token_ids])
    torch.stack([lp.sum() for lp in lps]).sum().backward()
    visual, text = policy.model.visual, policy.model.language_model
    grads = {
        "patch_embed": next(visual.patch_embed.parameters()).grad,
        "embed_tokens": text.embed_tokens.weight.grad,
        "layer0": next(text.layers[0].parameters()).grad,
    }
    for name, g in grads.items():
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name
    policy.zero_grad(set_to_none=True)


def test_negative_controls(qwen3_vl, policy, sampled):
    """The torch kernels (the usual trainer) and another image of the same size give other logprobs: the
    comparison above can see a difference."""
    completions = [out.token_ids for out in sampled]
    torch_lps = token_logprobs(load_policy(qwen3_vl, batch_invariant=False), _requests(), completions)
    pairs = zip(torch_lps, sampled, strict=True)
    differ = [not torch.equal(lp.detach(), torch.tensor(o.token_logprobs)) for lp, o in pairs]
    assert any(differ[i] for i in (0, 2, 4))
    other = dict(_requests()[0], multi_modal_data={"image": A2})
    [lp] = token_logprobs(policy, [other], completions[:1])
    assert not torch.equal(lp.detach(), torch.tensor(sampled[0].token_logprobs))


def test_bad_image_prompts(policy, tiny_model_dir):
    text_policy = load_policy(tiny_model_dir)
    with pytest.raises(ValueError, match="prompt 0: the model is text-only"):
        token_logprobs(text_policy, [{"prompt_token_ids": [1, 2], "multi_modal_data": {"image": A}}], [[3]])
    with pytest.raises(ValueError, match="prompt 1: the prompt has 1 image placeholder"):
        token_logprobs(policy, [[1, 2], {"prompt_token_ids": PLACE, "multi_modal_data": {"image": [A, B]}}], [[3], [3]])
    with pytest.raises(ValueError, match="prompt 1: image placeholder token 98 .* without an image"):
        token_logprobs(policy, [[1, 2], PLACE + [5]], [[3], [3]])
    with pytest.raises(ValueError, match="prompt 0: a dict prompt takes"):
        token_logprobs(policy, [{"prompt": "hi", "multi_modal_data": {"image": A}}], [[3]])


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl_moe"])
def test_other_families_bitwise(tmp_path: Path, arch: str):
    """Qwen2.5-VL (window attention, RMSNorm blocks, no DeepStack) and Qwen3-VL-MoE (the experts' autograd path):
    the mixed batch, micro-batched."""
    folder = save_tiny_vlm(tmp_path, arch)
    requests = _requests()[:3]
    outs = _sample(folder, requests, max_num_batched_tokens=11, max_num_seqs=3)
    lps = token_logprobs(load_policy(folder), requests, [o.token_ids for o in outs], micro_batch_size=2)
    _assert_bitwise(lps, outs)
