"""Image prompts for the trainer: the same preprocessing, vision tower and M-RoPE positions as the sampler's, so a
vision-language policy's logprobs equal the engine's bit for bit.

A prompt is what ``LLM.generate`` takes in token-id form, ``{"prompt_token_ids": ids, "multi_modal_data":
{"image": image or [images]}, "mm_processor_kwargs": {...}}`` (each image placeholder one ``<|image_pad|>`` or
already expanded, so ``RequestOutput.prompt_token_ids`` can be sent back as it is), or the engine's processed form
``(prompt_token_ids, MultimodalInputs)``; a plain token-id list is a text prompt. The dict form runs the model
folder's own image processor (``multimodal.processor.ImageProcessor``, which ``load_policy`` attaches as
``image_processor``), so the pixel values are the ones the engine encoded.

The engine encodes each image once and slices its features into whichever steps prefill its tokens; the trainer
runs the whole prompt in one prefill, so it encodes every image of a micro-batch in one call of the vision tower,
outside inference mode. An image's features have the same bits alone or among other images (every op of the tower
is per patch, attention per image or window), and a chunk of the engine's reads exactly the rows of the whole, so
the trainer's image rows carry the engine's bits, with autograd through the tower where the kernel set has it.
Positions are given as ``[3, n]`` whenever the micro-batch holds an image: a text row's three components are equal,
which the model maps to the bits of the ``[n]`` form the engine uses for text and decode rows.
"""

from collections.abc import Sequence

import torch

from lockstep.engine.multimodal import MultimodalInputs
from lockstep.models.multimodal import MultimodalBatch

__all__ = ["Prompt", "image_batch", "prompt_inputs"]

Prompt = Sequence[int] | dict | tuple[Sequence[int], MultimodalInputs]
_KEYS = {"prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}


def prompt_inputs(model, i: int, prompt: Prompt) -> tuple[list[int], MultimodalInputs | None]:
    """Prompt ``i``'s token ids (image placeholders expanded) and its images, or None for a text prompt. Raises
    ValueError naming the prompt for images to a text-only model, a dict with other keys, or images that do not
    match the placeholders."""
    if isinstance(prompt, tuple) and len(prompt) == 2 and isinstance(prompt[1], MultimodalInputs):
        _check_multimodal(model, i)
        if prompt[1].num_prompt_tokens != len(prompt[0]):
            raise ValueError(
                f"prompt {i}: {len(prompt[0])} token ids for MultimodalInputs of {prompt[1].num_prompt_tokens}"
            )
        return list(prompt[0]), prompt[1]
    if not isinstance(prompt, dict):
        return _text_prompt(model, i, list(prompt))
    if set(prompt) - _KEYS or "prompt_token_ids" not in prompt:
        raise ValueError(
            f"prompt {i}: a dict prompt takes 'prompt_token_ids' (and 'multi_modal_data', 'mm_processor_kwargs'), "
            f"got keys {sorted(prompt)}"
        )
    ids = list(prompt["prompt_token_ids"])
    data = prompt.get("multi_modal_data")
    if data is None:
        return _text_prompt(model, i, ids)
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f'prompt {i}: multi_modal_data takes {{"image": image or list of images}}')
    images = data.get("image")
    if images is None:
        return _text_prompt(model, i, ids)
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    _check_multimodal(model, i)
    processor = getattr(model, "image_processor", None)
    if processor is None:
        raise ValueError(
            f"prompt {i}: this policy has no image processor (load it with load_policy(folder)), or pass the "
            "prompt as (prompt_token_ids, MultimodalInputs)"
        )
    from lockstep.multimodal.media import MediaPolicy, load_image

    try:
        loaded = [load_image(image, MediaPolicy()) for image in images]
        return processor.process(ids, loaded, prompt.get("mm_processor_kwargs"))
    except ValueError as e:
        raise ValueError(f"prompt {i}: {e}") from None


def _text_prompt(model, i: int, ids: list[int]) -> tuple[list[int], None]:
    """A prompt without images; on a vision-language model it may not hold the image token (the engine refuses a
    placeholder without an image, and the trainer would read the token's embedding instead of an image's)."""
    if getattr(model, "is_multimodal", False) and model.mm_config.image_token_id in ids:
        raise ValueError(
            f"prompt {i}: image placeholder token {model.mm_config.image_token_id} (<|image_pad|>) without an image"
        )
    return ids, None


def _check_multimodal(model, i: int) -> None:
    if not getattr(model, "is_multimodal", False):
        raise ValueError(f"prompt {i}: the model is text-only: it takes no images")


def image_batch(
    model, seqs: list[list[int]], inputs: list[MultimodalInputs | None], positions: torch.Tensor
) -> tuple[torch.Tensor, MultimodalBatch | None]:
    """For one packed micro-batch of ``seqs`` (``positions: [n]``, each sequence counting from 0): the positions the
    model takes (``[3, n]`` M-RoPE when any sequence has images, else ``positions`` itself) and the image rows,
    their features from one call of the vision tower over every image of the micro-batch, with autograd."""
    if all(mm is None for mm in inputs):
        return positions, None
    device = positions.device
    rows: list[torch.Tensor] = []
    images = []
    out = positions.expand(3, -1).clone()  # [3, n]: text rows keep equal components
    offset = 0
    for tokens, mm in zip(seqs, inputs, strict=True):
        if mm is not None:
            out[:, offset : offset + len(tokens)] = mm.positions_of(0, len(tokens)).to(device)
            for image in mm.images:
                rows.append(torch.arange(offset + image.offset, offset + image.end, dtype=torch.int64))
                images.append(image)
        offset += len(tokens)
    pixel_values = torch.cat([im.pixel_values for im in images]).to(device)
    grid_thw = torch.tensor([im.grid_thw for im in images], dtype=torch.int64, device=device)
    features = model.model.visual(pixel_values, grid_thw)  # per image, in order; autograd on
    deepstack = [f.deepstack for f in features if f.deepstack is not None]
    mm_batch = MultimodalBatch(
        rows=torch.cat(rows).to(device),
        embeds=torch.cat([f.embeds for f in features]),
        deepstack=torch.cat(deepstack, dim=1) if deepstack else None,
    )
    return out, mm_batch
