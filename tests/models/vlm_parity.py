"""Shared checks of the vision-language models against transformers (tests/models/test_qwen3_vl.py,
test_qwen2_5_vl.py): prompts with images, a prefill and a greedy loop over a paged cache, as the engine runs them."""

from pathlib import Path

import torch
from paged_runner import PagedRunner
from tiny_vlm import expand_prompt, mm_batch, process_images, tiny_image

# Image sizes (width, height) per case: one image; several of different sizes interleaved with text.
CASES = {
    "one-image": [(64, 48)],
    "several-images": [(28, 28), (112, 84), (64, 48)],
}
TEXT = [[40, 41, 42, 3], [5, 6], [7], [8, 9, 10, 11]]


def image_prompt(folder: Path, sizes: list[tuple[int, int]], seed: int = 0):
    """``(input_ids, pixel_values, grid_thw)``: text, then each image followed by more text."""
    images = [tiny_image(w, h, seed + i) for i, (w, h) in enumerate(sizes)]
    pixel_values, grid_thw = process_images(folder, images)
    parts = [TEXT[0]]
    for i in range(len(sizes)):
        parts += ["image", TEXT[1 + i % 3]]
    return expand_prompt(parts, grid_thw), pixel_values, grid_thw


def grids(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    return [tuple(g) for g in grid_thw.tolist()]


def prefill(model, runner: PagedRunner, seq: str, ids, pixel_values, grid_thw) -> tuple[torch.Tensor, int]:
    """fp32 logits at every position of one prompt prefilled alone, and its M-RoPE delta."""
    positions, delta = model.mrope_positions(ids, grids(grid_thw))
    mm = mm_batch(ids, model.encode_images(pixel_values, grid_thw))
    hidden = runner.forward([(seq, ids, 0)], positions=positions, mm=mm)[0]
    return model.compute_logits(hidden), delta


def greedy(model, ids, pixel_values, grid_thw, max_new_tokens: int) -> list[int]:
    """Greedy ids after a prefill, decoding one token a step at position ``index + delta``, positions ``[n]``."""
    runner = PagedRunner(model)
    logits, delta = prefill(model, runner, "a", ids, pixel_values, grid_thw)
    out = [int(logits[-1].argmax())]
    while len(out) < max_new_tokens:
        index = len(ids) + len(out) - 1
        hidden = runner.forward([("a", [out[-1]], index)], positions=torch.tensor([index + delta]))[0]
        out.append(int(model.compute_logits(hidden).argmax()))
    return out


def half_precision_errors(folder: Path, hf32, dtype: torch.dtype, case) -> tuple[float, float]:
    """``(ours, transformers')``: the largest logit error of the model run in ``dtype`` against transformers' fp32
    logits, relative to their largest magnitude. Both models round the same way, so they should be close."""
    from tiny_models import max_rel_err
    from tiny_vlm import hf_vlm_logits
    from transformers import AutoModelForImageTextToText

    from lockstep.models.loader import load_model

    ids, pixel_values, grid_thw = case
    ref = hf_vlm_logits(hf32, ids, pixel_values, grid_thw)
    model = load_model(folder, dtype=dtype)
    features = model.encode_images(pixel_values, grid_thw)
    assert all(f.embeds.dtype == dtype for f in features)
    logits, _ = prefill(model, PagedRunner(model), "a", ids, pixel_values, grid_thw)
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype).eval()
    theirs = hf_vlm_logits(hf, ids, pixel_values.to(dtype), grid_thw)
    return max_rel_err(logits, ref), max_rel_err(theirs, ref)
