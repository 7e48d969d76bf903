"""What a vision-language model (Qwen3-VL, Qwen3-VL-MoE, Qwen2.5-VL) adds to a text model's configuration and
forward: the vision tower's settings, the image-token and M-RoPE settings the engine needs, one image's encoded
features, and the image rows of one flattened batch.

A VLM's ``config.json`` nests the text model under ``text_config`` (released Qwen2.5-VL checkpoints keep it at the
top level) and the vision tower under ``vision_config``. ``text_config_dict`` turns it into a text model's config,
read by ``ModelConfig.from_hf`` with the matching text architecture (Qwen2, Qwen3, Qwen3-MoE), so the decoder
layers are the text family's own.
"""

from dataclasses import dataclass

import torch

# Each VLM architecture and the text architecture its decoder is.
VLM_TEXT_ARCHITECTURES = {
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",
}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class MultimodalConfig:
    """The image-token and position settings of a VLM, what the engine needs besides the text model's config.

    An image of ``t x h x w`` patches (``grid_thw``, as the image processor returns it) becomes
    ``t * h * w // spatial_merge_size**2`` image tokens. M-RoPE rotates frequency ``j`` of a head by the position's
    component ``mrope_components[j]`` (0 = t, 1 = h, 2 = w): sections of ``mrope_section`` frequencies in order
    (Qwen2.5-VL), or interleaved t, h, w, t, h, w, ... (Qwen3-VL, ``mrope_interleaved``).
    """

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_deepstack_layers: int
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool

    def __post_init__(self) -> None:
        if len(self.mrope_section) != 3 or min(self.mrope_section) < 0:
            raise ValueError(f"mrope_section must be three non-negative sizes, got {list(self.mrope_section)}")

    @property
    def mrope_components(self) -> tuple[int, ...]:
        """Which position component (0 = t, 1 = h, 2 = w) each of the ``sum(mrope_section)`` frequencies takes."""
        t, h, w = self.mrope_section
        if not self.mrope_interleaved:
            return (0,) * t + (1,) * h + (2,) * w
        # As transformers: frequency j takes h where j % 3 == 1 and j < 3h, w where j % 3 == 2 and j < 3w, else t.
        n = t + h + w
        comps = [0] * n
        for j in range(1, min(3 * h, n), 3):
            comps[j] = 1
        for j in range(2, min(3 * w, n), 3):
            comps[j] = 2
        return tuple(comps)

    def num_image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size**2


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (``vision_config``). Qwen3-VL: LayerNorm blocks, a learned position grid of
    ``num_position_embeddings`` (a square) and DeepStack mergers after the blocks in ``deepstack_visual_indexes``;
    Qwen2.5-VL: RMSNorm blocks, window attention (``window_size`` pixels) except in ``fullatt_block_indexes``."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    activation: str  # "silu" (the gated MLP), or "tanh" / "none": GELU's approximation
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: ``C * T * P * P``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"vision_config {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(
                f"vision hidden_size {self.hidden_size} over {self.num_heads} heads must give a head_dim that is a "
                "multiple of 4 (the 2-D rotary)"
            )
        bad = [i for i in self.deepstack_visual_indexes + self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"vision block indexes {bad} out of range for depth {self.depth}")
        side = round(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings must be a square, got {self.num_position_embeddings}")


def _int_tuple(value, name: str) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) for v in value):
        raise ValueError(f"{name} must be a list of integers, got {value!r}")
    return tuple(value)


def _size(value, name: str) -> int:
    # patch_size may be written as [p, p] by some configs.
    sizes = set(_int_tuple(value, name))
    if len(sizes) != 1:
        raise ValueError(f"{name} must be one size, got {value!r}")
    return sizes.pop()


def text_config_dict(hf: dict) -> dict:
    """The text model's Hugging Face config from a VLM's: ``text_config`` (or the top level, as released
    Qwen2.5-VL files write it) over the top-level keys, named as its text architecture, with M-RoPE's keys taken
    out of the rope parameters (the rotation itself is the default one, per component)."""
    arch = hf["architectures"][0]
    nested = hf.get("text_config")
    if nested is not None and not isinstance(nested, dict):
        raise ValueError("text_config must be a JSON object")
    top = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
    text = {**top, **(nested or {})}
    text["architectures"] = [VLM_TEXT_ARCHITECTURES[arch]]
    # The top level decides the head's tying (transformers reads the top-level config); Qwen2.5-VL also ties when
    # its text_config says so.
    tie = bool(top.get("tie_word_embeddings", False))
    if arch == "Qwen2_5_VLForConditionalGeneration":
        tie = tie or bool((nested or {}).get("tie_word_embeddings", False))
    text["tie_word_embeddings"] = tie
    if arch == "Qwen3VLMoeForConditionalGeneration":
        text["norm_topk_prob"] = True  # its router always renormalises the top k
    if text.get("dtype") is None and text.get("torch_dtype") is None:
        text["dtype"] = top.get("dtype") or top.get("torch_dtype")
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict):
            rope = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
            if rope.get("rope_type", rope.get("type")) == "mrope":
                rope.pop("type", None)
                rope["rope_type"] = "default"
            text[key] = rope
    return text


def _rope_dict(hf: dict) -> dict:
    nested = hf.get("text_config") or {}
    for source in (nested, hf):
        for key in ("rope_parameters", "rope_scaling"):
            if isinstance(source.get(key), dict) and "mrope_section" in source[key]:
                return source[key]
    return {}


def multimodal_from_hf(hf: dict, head_dim: int) -> tuple[VisionConfig, MultimodalConfig]:
    """The vision tower's and the image tokens' settings from a VLM's ``config.json`` dict."""
    arch = hf["architectures"][0]
    v = hf.get("vision_config")
    if not isinstance(v, dict):
        raise ValueError("a vision-language config needs a vision_config object")
    act = v.get("hidden_act", "silu" if arch == "Qwen2_5_VLForConditionalGeneration" else "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise ValueError(f"unsupported vision hidden_act {act!r}; expected one of {list(_ACTIVATIONS)}")
    qwen3 = arch != "Qwen2_5_VLForConditionalGeneration"
    if qwen3 == (act == "silu"):
        raise ValueError(f"{arch} with vision hidden_act {act!r} is not supported")
    rope = v.get("rope_parameters") or {}
    vision = VisionConfig(
        depth=v["depth"],
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_heads=v["num_heads"],
        out_hidden_size=v.get("out_hidden_size", v["hidden_size"]),
        activation=_ACTIVATIONS[act],
        in_channels=v.get("in_channels", v.get("in_chans", 3)),
        patch_size=_size(v.get("patch_size", 16 if qwen3 else 14), "patch_size"),
        temporal_patch_size=_size(v.get("temporal_patch_size", 2), "temporal_patch_size"),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        num_position_embeddings=v["num_position_embeddings"] if qwen3 else 0,
        deepstack_visual_indexes=_int_tuple(v.get("deepstack_visual_indexes", ()), "deepstack_visual_indexes"),
        window_size=0 if qwen3 else int(v.get("window_size", 112)),
        fullatt_block_indexes=()
        if qwen3
        else _int_tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31)), "fullatt_block_indexes"),
    )
    if not qwen3 and vision.window_size % (vision.patch_size * vision.spatial_merge_size):
        raise ValueError(
            f"window_size {vision.window_size} is not a multiple of patch_size * spatial_merge_size "
            f"({vision.patch_size * vision.spatial_merge_size})"
        )
    rope = _rope_dict(hf)
    section = _int_tuple(rope.get("mrope_section", (24, 20, 20) if qwen3 else (16, 24, 24)), "mrope_section")
    if sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section {list(section)} must add up to head_dim / 2 = {head_dim // 2}")
    mm = MultimodalConfig(
        image_token_id=hf.get("image_token_id", 151655),
        video_token_id=hf.get("video_token_id", 151656),
        vision_start_token_id=hf.get("vision_start_token_id", 151652),
        vision_end_token_id=hf.get("vision_end_token_id", 151653),
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        spatial_merge_size=vision.spatial_merge_size,
        num_deepstack_layers=len(vision.deepstack_visual_indexes),
        mrope_section=section,  # type: ignore[arg-type]
        mrope_interleaved=qwen3,
    )
    return vision, mm


@dataclass
class ImageFeatures:
    """One image's encoded features: ``embeds: [num_image_tokens, hidden]`` replace its image tokens' embeddings;
    ``deepstack: [num_deepstack_layers, num_image_tokens, hidden]`` (Qwen3-VL; None for Qwen2.5-VL) are added to
    those rows' hidden states after the first decoder layers."""

    embeds: torch.Tensor
    deepstack: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[0]


@dataclass
class MultimodalBatch:
    """The image rows of one flattened forward. ``rows: [m]`` int64, ascending indices of the rows that are image
    tokens (their ``input_ids`` hold the image token id); ``embeds: [m, hidden]`` their embeddings;
    ``deepstack: [num_deepstack_layers, m, hidden] | None`` what is added to them after decoder layer i."""

    rows: torch.Tensor
    embeds: torch.Tensor
    deepstack: torch.Tensor | None = None
