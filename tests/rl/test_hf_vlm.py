"""lockstep.rl.hf on vision-language models: a transformers Qwen3-VL, Qwen3-VL-MoE or Qwen2.5-VL patched with
``patch_model`` gives, bit for bit, the logprobs the engine sampled image prompts with (one forward per prompt, and
one right-padded batch of image and text prompts; with the chunk tree against a tree engine), with gradients
reaching the vision tower; the unpatched model does not (the negative control)."""

import pytest
import torch
from tiny_models import TINY_EOS
from tiny_vlm import IMAGE_PAD, VISION_END, VISION_START, hf_vlm, save_tiny_vlm, tiny_image

from lockstep import LLM, SamplingParams
from lockstep.rl.hf import is_patched, patch_model, selective_log_softmax, unpatch_model

PLACE = [VISION_START, IMAGE_PAD, VISION_END]
A, B, C = tiny_image(96, 64, 1), tiny_image(128, 96, 2), tiny_image(64, 64, 3)


def _text(seed: int, n: int) -> list[int]:
    return [(7 * seed + 3 * j) % 90 + 1 for j in range(n)]


# (prompt token ids with one placeholder per image, images)
PROMPTS = [
    (PLACE + _text(1, 9), [A]),
    (_text(2, 13), []),
    (_text(3, 4) + PLACE + _text(4, 5) + PLACE + _text(5, 3), [B, C]),
    (_text(7, 11) + PLACE, [C]),
]


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl"])
def sampled(request, tmp_path_factory: pytest.TempPathFactory):
    """The folder, and per prompt (expanded ids, completion, the engine's logprobs, pixel_values, grid_thw), sampled
    in one batch with chunked prefill through the images."""
    folder = save_tiny_vlm(tmp_path_factory.mktemp(f"tiny-{request.param}-hf"), request.param)
    llm = LLM(str(folder), block_size=4, num_kv_blocks=512, max_num_batched_tokens=13, max_num_seqs=4)
    requests = [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids for ids, images in PROMPTS
    ]
    params = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=6, ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate(requests, params, use_tqdm=False)
    rows = []
    for (ids, images), out in zip(PROMPTS, outs, strict=True):
        pixels, grids = None, None
        if images:
            expanded, mm = llm.engine.process_images(ids, images)
            assert expanded == out.prompt_token_ids
            pixels = torch.cat([im.pixel_values for im in mm.images])
            grids = torch.tensor([im.grid_thw for im in mm.images])
        rows.append((out.prompt_token_ids, out.outputs[0].token_ids, out.outputs[0].token_logprobs, pixels, grids))
    llm.close()
    return folder, rows


def _images(rows) -> dict:
    pixels = [p for *_, p, _ in rows if p is not None]
    grids = [g for *_, g in rows if g is not None]
    return dict(pixel_values=torch.cat(pixels), image_grid_thw=torch.cat(grids)) if pixels else {}


def _logprobs(model, rows) -> list[torch.Tensor]:
    """Each completion token's logprob from one right-padded forward over ``rows``."""
    seqs = [p + c[:-1] for p, c, *_ in rows]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), TINY_EOS, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    images = _images(rows)
    if images:  # transformers' own forward needs the image token mask for its M-RoPE (the patched one ignores it)
        images["mm_token_type_ids"] = (ids == IMAGE_PAD).int()
    logits = model(input_ids=ids, attention_mask=mask, **images).logits
    out = []
    for i, (p, c, *_) in enumerate(rows):
        out.append(selective_log_softmax(logits[i, len(p) - 1 : len(p) - 1 + len(c)], torch.tensor(c)))
    return out


def _equal(lps: list[torch.Tensor], rows) -> list[bool]:
    return [torch.equal(lp.detach(), torch.tensor(r[2], dtype=torch.float32)) for lp, r in zip(lps, rows, strict=True)]


def test_patched_vlm_gives_the_sampler_logprobs(sampled) -> None:
    folder, rows = sampled
    model = hf_vlm(folder)
    unpatched = [_logprobs(model, [r])[0] for r in rows if r[3] is not None]
    patch_model(model)
    assert is_patched(model)
    with torch.no_grad():
        assert all(_equal([_logprobs(model, [r])[0] for r in rows], rows)), "one prompt a forward"
        assert all(_equal(_logprobs(model, rows), rows)), "one padded batch of image and text prompts"
    # Negative control: transformers' own forward (SDPA, its kernels) does not give the sampler's bits.
    assert not all(_equal(unpatched, [r for r in rows if r[3] is not None]))
    unpatch_model(model)
    assert not is_patched(model)


def test_patched_vlm_with_the_tree_gives_a_tree_engine_logprobs(sampled) -> None:
    """``tp_invariant=True`` against an engine with the chunk tree (the numerics of any tensor-parallel size): equal,
    and different from the plain patch (the row-parallel matmuls reduce another way)."""
    folder, rows = sampled
    llm = LLM(str(folder), block_size=4, num_kv_blocks=512, tp_invariant=True)
    (ids, images), row = PROMPTS[2], rows[2]  # two images among text
    params = SamplingParams(temperature=0.8, seed=102, max_tokens=6, ignore_eos=True)
    [out] = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, params, use_tqdm=False)
    llm.close()
    tree_row = (row[0], out.outputs[0].token_ids, out.outputs[0].token_logprobs, row[3], row[4])
    model = patch_model(hf_vlm(folder), tp_invariant=True)
    with torch.no_grad():
        assert _equal(_logprobs(model, [tree_row]), [tree_row]) == [True]
        assert _equal(_logprobs(patch_model(model), [tree_row]), [tree_row]) == [False]


def test_patched_vlm_gradients_reach_the_vision_tower(sampled) -> None:
    folder, rows = sampled
    model = hf_vlm(folder).train()
    patch_model(model)
    lps = _logprobs(model, rows[:1])
    assert _equal(lps, rows[:1]) == [True]  # the train-mode forward: the same bits
    lps[0].sum().backward()
    visual, text = model.model.visual, model.model.language_model
    for name, p in [("patch_embed", visual.patch_embed.proj.weight), ("block 0", next(visual.blocks[0].parameters())),
                    ("embed_tokens", text.embed_tokens.weight)]:  # fmt: skip
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_patched_vlm_refuses_what_it_cannot_reproduce(sampled) -> None:
    folder, rows = sampled
    model = patch_model(hf_vlm(folder))
    ids, _, _, pixels, grids = rows[0]
    with pytest.raises(ValueError, match="image-token runs than the 0 image grid"):
        model(input_ids=torch.tensor([ids]))
    with pytest.raises(ValueError, match="image placeholder runs"):
        model(input_ids=torch.tensor([ids]), pixel_values=torch.cat([pixels, pixels]),
              image_grid_thw=torch.cat([grids, grids]))  # fmt: skip
    with pytest.raises(NotImplementedError, match="images"):
        model(input_ids=torch.tensor([ids]), pixel_values_videos=pixels, video_grid_thw=grids)
