"""A request's images as the engine sees them: what each image is, where its tokens sit in the prompt, and the
prompt's M-RoPE positions.

``MultimodalInputs`` is built once per request by the preprocessing (``lockstep.multimodal.processor``) and never
changes afterwards, so the ``n`` choices of a prompt may share it. The engine reads it to

- schedule: which images a chunk of prefill overlaps (``overlapping``), to encode them first;
- key the prefix cache: the bytes a KV block's hash takes besides its token ids (``block_extra``), so a block that
  covers image tokens is found again only for the same pixels;
- lay out a step: each row's M-RoPE position (``positions_of``) and which rows take image features.

An image's features live in the ``EncoderCache`` (engine/encoder_cache.py), not here: they exist only while the
image's tokens are still to be prefilled.
"""

import struct
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt, preprocessed.

    ``pixel_values: [num_patches, C*T*P*P]`` float32 on the CPU and ``grid_thw`` are what Hugging Face's Qwen2-VL
    image processor returns for the image alone; its ``num_tokens`` placeholder tokens are prompt positions
    ``[offset, offset + num_tokens)``. ``hash`` identifies the pixels (and grid): blake2b, stable across processes.
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    offset: int
    num_tokens: int
    hash: bytes

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass(frozen=True, eq=False)
class MultimodalInputs:
    """A prompt's images in prompt order, and the prompt's M-RoPE positions.

    ``positions: [3, num_prompt_tokens]`` int64 (t, h, w); a token at index ``i >= num_prompt_tokens`` (an output
    token) has position ``i + delta`` in all three. Text tokens have all three components equal.
    """

    images: tuple[ImageInput, ...]
    positions: torch.Tensor
    delta: int

    @property
    def num_prompt_tokens(self) -> int:
        return self.positions.shape[1]

    @property
    def num_image_tokens(self) -> int:
        return sum(image.num_tokens for image in self.images)

    def overlapping(self, start: int, end: int) -> list[tuple[int, ImageInput]]:
        """The images (with their index) that have tokens in positions ``[start, end)``, in order."""
        return [(k, im) for k, im in enumerate(self.images) if im.offset < end and start < im.end]

    def block_extra(self, index: int, block_size: int) -> bytes:
        """What KV block ``index``'s hash takes besides its tokens: for each image with tokens in the block, its hash
        and the index of the block's first token of it within the image. Empty for a block of text alone (so text
        blocks hash as a text-only request's do)."""
        lo, hi = index * block_size, (index + 1) * block_size
        parts = [im.hash + struct.pack("<q", max(lo, im.offset) - im.offset) for _, im in self.overlapping(lo, hi)]
        return b"".join(parts)

    def positions_of(self, start: int, end: int) -> torch.Tensor:
        """``[3, end - start]`` int64: the M-RoPE positions of tokens ``[start, end)``."""
        num_prompt = self.num_prompt_tokens
        head = self.positions[:, start : min(end, num_prompt)]
        if end <= num_prompt:
            return head
        tail = torch.arange(max(start, num_prompt) + self.delta, end + self.delta, dtype=torch.int64)
        return torch.cat([head, tail.expand(3, -1)], dim=1)

    def text_positions(self, start: int, end: int) -> list[int]:
        """The first component of ``positions_of(start, end)``: every row's position when the rows hold no image
        token (all three components are equal then)."""
        num_prompt = self.num_prompt_tokens
        head = self.positions[0, start : min(end, num_prompt)].tolist()
        return head + list(range(max(start, num_prompt) + self.delta, end + self.delta))
