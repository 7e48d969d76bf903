"""Tiny random-weight vision-language checkpoints (Qwen3-VL, Qwen3-VL-MoE, Qwen2.5-VL) written by transformers'
own classes, with the char tokenizer of ``tiny_models`` plus the vision special tokens, a chat template that
renders image parts, and a ``Qwen2VLImageProcessorPil`` config with small images; and transformers' outputs for the
same inputs, for parity tests.

The configs are small enough for fast CPU tests yet reach every code path: Qwen3-VL's DeepStack indexes hit
(features go into the first two of three decoder layers), its learned position grid (8 x 8) is smaller than most
images' patch grids so the bilinear interpolation is real, and Qwen2.5-VL's 56-pixel windows give several windows
per image with full attention in blocks 1 and 3.
"""

from pathlib import Path

import numpy as np
import torch
from tiny_models import TINY_CHARS, TINY_EOS, randomize_

# The char tokenizer's 97 tokens, then the vision special tokens, then room to spare.
VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = 97, 98, 99, 100
VLM_VOCAB = 104
VISION_TOKENS = {"<|vision_start|>": VISION_START, "<|image_pad|>": IMAGE_PAD, "<|vision_end|>": VISION_END}
VLM_ARCHS = ("qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl")
# What the chat template writes for one image content part (before placeholder expansion).
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

_TEXT = dict(
    vocab_size=VLM_VOCAB,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=TINY_EOS,
    pad_token_id=None,
)
# Qwen3-VL: head_dim 32, so 16 frequencies: interleaved t h w t h w ... (h and w 5 each, t the other 6).
_QWEN3_TEXT = dict(
    head_dim=32,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[6, 5, 5], mrope_interleaved=True),
)
_QWEN3_MOE_TEXT = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[1]
)
# Qwen2.5-VL: head_dim 16, 8 frequencies in sections of 2 (t), 3 (h), 3 (w).
_QWEN25_TEXT = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))
_QWEN3_VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=64,
    deepstack_visual_indexes=[0, 2],
)
_QWEN25_VISION = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=56,
    fullatt_block_indexes=[1, 3],
)
# Smallest and largest image areas the processor resizes to: one merged token up to 8 x 8 of them.
MIN_PIXELS = {"qwen3_vl": 32 * 32, "qwen3_vl_moe": 32 * 32, "qwen2_5_vl": 28 * 28}
MAX_PIXELS = {"qwen3_vl": 256 * 256, "qwen3_vl_moe": 256 * 256, "qwen2_5_vl": 224 * 224}

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}"
    "{% elif p['type'] in ('image', 'image_url') %}" + IMAGE_PLACEHOLDER + "{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}assistant:"
)


def _classes(arch: str):
    import transformers

    return {
        "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration),
        "qwen3_vl_moe": (transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration),
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
    }[arch]


def save_vlm_tokenizer(folder: Path) -> None:
    """The char tokenizer (``tiny_models.save_char_tokenizer``) plus ``<|vision_start|>`` = 97,
    ``<|image_pad|>`` = 98, ``<|vision_end|>`` = 99, ``<|video_pad|>`` = 100, and ``CHAT_TEMPLATE``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(TINY_CHARS)} | {"<unk>": TINY_EOS - 1, "</s>": TINY_EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    names = [*VISION_TOKENS, "<|video_pad|>"]
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def save_image_processor(folder: Path, arch: str, min_pixels: int | None = None, max_pixels: int | None = None):
    """``preprocessor_config.json`` for ``Qwen2VLImageProcessorPil`` with the model's patch and merge sizes."""
    from transformers import Qwen2VLImageProcessorPil

    vision = _QWEN25_VISION if arch == "qwen2_5_vl" else _QWEN3_VISION
    Qwen2VLImageProcessorPil(
        min_pixels=min_pixels or MIN_PIXELS[arch],
        max_pixels=max_pixels or MAX_PIXELS[arch],
        patch_size=vision["patch_size"],
        merge_size=vision["spatial_merge_size"],
        temporal_patch_size=vision["temporal_patch_size"],
    ).save_pretrained(folder)


def save_tiny_vlm(
    folder: Path,
    arch: str,
    seed: int = 0,
    *,
    text_config: dict | None = None,
    vision_config: dict | None = None,
    scale: float = 2.0,
    **overrides,
) -> Path:
    """Save a tiny random-weight HF checkpoint of ``arch`` ("qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl") to ``folder``,
    with its tokenizer and image processor. ``text_config`` / ``vision_config`` update the sub-configs, the other
    keywords the top-level config (``tie_word_embeddings``, say). Weights as ``tiny_models.randomize_`` (``scale``
    2 gives peaked distributions, so greedy runs see real structure)."""
    cls_config, cls_model = _classes(arch)
    text = dict(_TEXT)
    text.update(_QWEN25_TEXT if arch == "qwen2_5_vl" else _QWEN3_TEXT)
    if arch == "qwen3_vl_moe":
        text.update(_QWEN3_MOE_TEXT)
    text.update(text_config or {})
    vision = dict(_QWEN25_VISION if arch == "qwen2_5_vl" else _QWEN3_VISION)
    vision.update(vision_config or {})
    config = cls_config(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        **overrides,
    )
    torch.manual_seed(seed)
    model = cls_model(config).float().eval()
    randomize_(model, seed, scale)
    model.save_pretrained(folder)
    save_vlm_tokenizer(folder)
    save_image_processor(folder, arch)
    return folder


# --- inputs ----------------------------------------------------------------------------------------------------


def tiny_image(width: int, height: int, seed: int = 0):
    """A random RGB ``PIL.Image`` of ``width`` x ``height`` pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def process_images(folder: Path, images: list) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values [total_patches, C*T*P*P], grid_thw [num_images, 3])`` from the folder's image processor."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def expand_prompt(parts: list, grid_thw: torch.Tensor, merge: int = 2) -> list[int]:
    """Token ids of a prompt from ``parts``: lists of token ids and the string "image" (the next image's
    ``<|vision_start|>``, one ``<|image_pad|>`` per image token, ``<|vision_end|>``), in order."""
    ids: list[int] = []
    grids = iter(grid_thw.tolist())
    for part in parts:
        if part == "image":
            t, h, w = next(grids)
            ids += [VISION_START] + [IMAGE_PAD] * (t * h * w // merge**2) + [VISION_END]
        else:
            ids += list(part)
    return ids


# --- transformers' outputs -------------------------------------------------------------------------------------


def hf_vlm(folder: Path):
    """transformers' own model for the folder, fp32, eval mode (SDPA attention)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def hf_image_features(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
    """Per image, transformers' ``(embeds [tokens, hidden], deepstack [layers, tokens, hidden] | None)``."""
    out = model.model.get_image_features(pixel_values, grid_thw, return_dict=True)
    embeds = list(out.pooler_output)
    deep = getattr(out, "deepstack_features", None)
    if not deep:
        return [(e, None) for e in embeds]
    return [(e, torch.stack([layer[i] for layer in deep])) for i, e in enumerate(embeds)]


@torch.no_grad()
def hf_vlm_logits(
    model, input_ids: list[int], pixel_values: torch.Tensor | None = None, grid_thw: torch.Tensor | None = None
) -> torch.Tensor:
    """transformers' fp32 logits for one sequence, images included: ``[len(input_ids), vocab]``."""
    ids = torch.tensor([input_ids])
    kwargs = {}
    if pixel_values is not None:
        kwargs = dict(pixel_values=pixel_values, image_grid_thw=grid_thw, mm_token_type_ids=(ids == IMAGE_PAD).int())
    return model(input_ids=ids, **kwargs).logits[0].float()


@torch.no_grad()
def hf_vlm_greedy(
    model, input_ids: list[int], pixel_values: torch.Tensor, grid_thw: torch.Tensor, max_new_tokens: int
) -> list[int]:
    """transformers' greedy continuation of one image prompt, EOS not special: a plain loop that runs the whole
    sequence through the model each step (its own M-RoPE positions for the prompt and the tokens after it)."""
    ids = list(input_ids)
    for _ in range(max_new_tokens):
        ids.append(int(hf_vlm_logits(model, ids, pixel_values, grid_thw)[-1].argmax()))
    return ids[len(input_ids) :]


# --- lockstep's side -------------------------------------------------------------------------------------------


def mm_batch(input_ids: list[int], features: list, device="cpu"):
    """The ``MultimodalBatch`` of one prompt laid out alone: its image-token rows, the images' features in order."""
    from lockstep.models.multimodal import MultimodalBatch

    rows = torch.tensor([i for i, t in enumerate(input_ids) if t == IMAGE_PAD], dtype=torch.int64, device=device)
    embeds = torch.cat([f.embeds for f in features])
    deep = None if features[0].deepstack is None else torch.cat([f.deepstack for f in features], dim=1)
    return MultimodalBatch(rows, embeds, deep)
