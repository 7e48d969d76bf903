"""A vision-language prompt made ready for the engine: its images through the model folder's own Hugging Face image
processor, each image placeholder expanded to the image's tokens, and the prompt's M-RoPE positions.

A prompt marks each image with one ``<|image_pad|>`` token (the chat template writes
``<|vision_start|><|image_pad|><|vision_end|>``), in the order of the images; ``process`` replaces it with
``num_image_tokens = t * h * w / merge**2`` copies, as Hugging Face's processor does to the text. A prompt of token
ids whose placeholders are already expanded (a run of exactly that many) is taken as it is, so a prompt and its
completion can be sent back as a prompt. The image processor is ``Qwen2VLImageProcessorPil`` (no torchvision), built
from the folder's ``preprocessor_config.json``; each image is processed on its own, so its pixels never depend on the
other images of the prompt.
"""

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch

from lockstep.config import MM_PROCESSOR_KWARGS
from lockstep.engine.multimodal import ImageInput, MultimodalInputs


class ImageProcessor:
    """Preprocessing for one vision-language model: ``process(prompt_token_ids, images)``.

    ``model`` gives ``mm_config`` (the special token ids, patch and merge sizes) and ``mrope_positions``;
    ``limit`` is the most images a prompt may hold (None: no limit); ``defaults`` are ``mm_processor_kwargs``
    (min/max pixels) for every request, which a request's own override. Thread-safe: the server preprocesses in
    its worker threads.
    """

    def __init__(self, folder: str | Path, model, limit: int | None = None, defaults: dict | None = None) -> None:
        from transformers import Qwen2VLImageProcessorPil

        if not (Path(folder) / "preprocessor_config.json").is_file():
            raise FileNotFoundError(f"{folder} has no preprocessor_config.json: the vision model's image processor")
        self.hf = Qwen2VLImageProcessorPil.from_pretrained(str(folder))
        self.mm_config = model.mm_config
        self.mrope_positions = model.mrope_positions
        self.limit = limit
        self.defaults = dict(defaults or {})
        cfg = self.mm_config
        if (self.hf.patch_size, self.hf.merge_size) != (cfg.patch_size, cfg.spatial_merge_size):
            raise ValueError(
                f"{folder}: preprocessor_config.json has patch_size {self.hf.patch_size}, merge_size "
                f"{self.hf.merge_size}; the model's vision config {cfg.patch_size}, {cfg.spatial_merge_size}"
            )

    @property
    def image_token_id(self) -> int:
        return self.mm_config.image_token_id

    @property
    def max_pixels(self) -> int:
        """The largest image area (pixels) images are resized to without a request's own options."""
        return self.defaults.get("max_pixels", self.hf.size.longest_edge)

    def process(
        self, prompt_token_ids: Sequence[int], images: Sequence, mm_processor_kwargs: dict | None = None
    ) -> tuple[list[int], MultimodalInputs]:
        """The prompt with its placeholders expanded, and its ``MultimodalInputs``. ``images`` are decoded PIL
        images in prompt order. Raises ValueError naming the problem (too many images, a count of placeholders
        other than the count of images, an unknown processor option)."""
        if self.limit is not None and len(images) > self.limit:
            raise ValueError(
                f"the prompt has {len(images)} images; at most {self.limit} are allowed per prompt "
                "(limit_mm_per_prompt)"
            )
        runs = placeholder_runs(prompt_token_ids, self.image_token_id)
        if len(runs) != len(images):
            raise ValueError(
                f"the prompt has {len(runs)} image placeholder(s) ({self.image_token_id}, <|image_pad|>) for "
                f"{len(images)} image(s): each image needs one, in order"
            )
        if not images:
            raise ValueError("a multimodal prompt needs at least one image")
        pixels, grids = self._pixels(images, mm_processor_kwargs)
        merge = self.mm_config.spatial_merge_size
        ids: list[int] = []
        inputs: list[ImageInput] = []
        at = 0
        for (start, length), pix, grid in zip(runs, pixels, grids, strict=True):
            num_tokens = grid[0] * grid[1] * grid[2] // merge**2
            if length not in (1, num_tokens):
                raise ValueError(
                    f"an image placeholder run of {length} tokens at index {start}: one token per image, or the "
                    f"image's {num_tokens} tokens already expanded"
                )
            ids += prompt_token_ids[at:start]
            inputs.append(ImageInput(pix, grid, len(ids), num_tokens, pixel_hash(pix, grid)))
            ids += [self.image_token_id] * num_tokens
            at = start + length
        ids += prompt_token_ids[at:]
        positions, delta = self.mrope_positions(ids, [im.grid_thw for im in inputs])
        positions = torch.as_tensor(positions, dtype=torch.int64).cpu().contiguous()
        if tuple(positions.shape) != (3, len(ids)):
            raise RuntimeError(f"mrope_positions gave shape {tuple(positions.shape)} for a prompt of {len(ids)}")
        return ids, MultimodalInputs(tuple(inputs), positions, int(delta))

    def _pixels(self, images: Sequence, kwargs: dict | None) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
        """Each image's ``pixel_values`` and ``(t, h, w)`` grid, processed alone."""
        options = self.defaults | dict(kwargs or {})
        unknown = sorted(set(options) - set(MM_PROCESSOR_KWARGS))
        if unknown:
            raise ValueError(f"mm_processor_kwargs takes {', '.join(MM_PROCESSOR_KWARGS)}, not {', '.join(unknown)}")
        size = {"shortest_edge": self.hf.size.shortest_edge, "longest_edge": self.hf.size.longest_edge}
        if "min_pixels" in options:
            size["shortest_edge"] = options["min_pixels"]
        if "max_pixels" in options:
            size["longest_edge"] = options["max_pixels"]
        if size["shortest_edge"] > size["longest_edge"]:
            raise ValueError(f"mm_processor_kwargs: min_pixels {size['shortest_edge']} > max_pixels")
        pixels, grids = [], []
        for image in images:
            try:
                out = self.hf(images=[image], size=size, return_tensors="pt")
            except Exception as e:  # an image the processor cannot take (a mode it cannot convert, ...)
                raise ValueError(f"the image processor failed on an image: {type(e).__name__}: {e}") from None
            pixels.append(out["pixel_values"].to(torch.float32).contiguous())
            grids.append(tuple(int(x) for x in out["image_grid_thw"][0].tolist()))
        return pixels, grids


def placeholder_runs(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each maximal run of ``image_token_id`` in ``token_ids``."""
    runs: list[tuple[int, int]] = []
    i, n = 0, len(token_ids)
    while i < n:
        if token_ids[i] == image_token_id:
            j = i
            while j < n and token_ids[j] == image_token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def pixel_hash(pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> bytes:
    """blake2b of an image's grid and preprocessed pixels: equal for the same pixels, whatever process computes it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(tuple(grid_thw)).encode())
    h.update(pixel_values.to(torch.float32).contiguous().numpy().tobytes())
    return h.digest()
