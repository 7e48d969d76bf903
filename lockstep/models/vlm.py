"""What the Qwen vision-language models share: the text side (the text family's own decoder layers, M-RoPE, image
embeddings in place of the image tokens' and DeepStack features added after the first layers), the engine-facing
surface (``LlamaForCausalLM``'s plus ``encode_images`` and ``mrope_positions``), and the checkpoint names.

The model's modules are named as transformers 5 names them: ``model.visual.*``, ``model.language_model.*`` and
``lm_head.weight``. Released Qwen2.5-VL files name them ``visual.*``, ``model.*`` and ``lm_head.weight``;
``checkpoint_name`` maps those. The vision towers are in qwen3_vl.py and qwen2_5_vl.py.

A forward runs one flattened batch of any mix of text and image requests, as the text models do. Positions are
``[n]`` (every component equal: text, decode) or ``[3, n]`` (t, h, w); M-RoPE gathers each frequency's cos/sin
from the one 1-D table (``layers.rotary.MRotaryEmbedding``), so a row's bits do not depend on the form.
"""

import torch
from torch import nn

from lockstep.distributed import TPGroup
from lockstep.layers.batch import AttentionMetadata
from lockstep.layers.kernels import Kernels, get_kernels
from lockstep.layers.rotary import MRotaryEmbedding
from lockstep.models.llama import LlamaForCausalLM, LlamaModel, ModelConfig
from lockstep.models.mrope import mrope_positions
from lockstep.models.multimodal import ImageFeatures, MultimodalBatch, MultimodalConfig
from lockstep.models.vision import check_vision_kernels


class VLTextModel(LlamaModel):
    """The decoder stack of a VLM: ``LlamaModel``'s layers with M-RoPE, image rows' embeddings replaced by their
    features, and DeepStack features added to the image rows' hidden states after layers ``0 .. D - 1``.

    After each of those D layers the residual stream is summed out (``hidden + residual``, transformers' order)
    for every batch, with images or without, so a text row takes one code path whatever else is in the batch."""

    def __init__(self, config: ModelConfig, kernels: Kernels, dtype, device, max_position: int, tp, tree: bool):
        super().__init__(config, kernels, dtype, device, max_position, tp, tree)
        mm = config.multimodal
        self.rotary_emb = MRotaryEmbedding(
            config.head_dim, max_position, config.rope_theta, mm.mrope_components, dtype, device
        )
        self.num_deepstack = min(mm.num_deepstack_layers, config.num_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        mm: MultimodalBatch | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        images = mm is not None and mm.rows.numel() > 0
        if images:
            hidden[mm.rows] = mm.embeds.to(hidden.dtype)
        rope = self.rotary_emb(positions)
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, rope, attn)
            if i < self.num_deepstack:
                hidden, residual = hidden + residual, None
                if images and mm.deepstack is not None:
                    hidden[mm.rows] = hidden[mm.rows] + mm.deepstack[i].to(hidden.dtype)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class _Body(nn.Module):
    """``model``: the vision tower (``visual``) and the decoder stack (``language_model``), transformers' layout.
    Calling it runs the decoder, as a text model's ``model`` does (the RL trainer calls ``model.model`` to run the
    forward with autograd, outside ``forward``'s inference mode)."""

    def __init__(self, visual: nn.Module, language_model: VLTextModel):
        super().__init__()
        self.visual = visual
        self.language_model = language_model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        mm: MultimodalBatch | None = None,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, attn, mm)


class VisionLanguageModel(LlamaForCausalLM):
    """A Qwen vision-language model over one flattened, paged batch: ``LlamaForCausalLM``'s interface, plus
    ``encode_images`` and ``mrope_positions``, and ``forward``'s ``mm`` (the batch's image rows).

    Subclasses build the vision tower (``_build_visual``). Under tensor parallelism the decoder is split as a text
    model's; the vision tower is whole on every rank (its weights replicated), and only rank 0 runs it: the model
    runner broadcasts the step's image rows (engine/model_runner.py)."""

    is_multimodal = True

    def __init__(
        self,
        config: ModelConfig,
        *,
        kernels: str | Kernels = "invariant",
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        max_model_len: int | None = None,
        tp: TPGroup | None = None,
        tp_invariant: bool | None = None,
    ):
        if config.vision is None or config.multimodal is None:
            raise ValueError(f"{type(self).__name__} needs a vision-language config, got {config.architecture}")
        check_vision_kernels(kernels if isinstance(kernels, Kernels) else get_kernels(kernels))
        super().__init__(
            config, kernels=kernels, dtype=dtype, device=device, max_model_len=max_model_len, tp=tp,
            tp_invariant=tp_invariant,
        )  # fmt: skip

    def _build_visual(self, config: ModelConfig, dtype: torch.dtype, device) -> nn.Module:
        raise NotImplementedError

    def _build_model(self, config: ModelConfig, dtype: torch.dtype, device, max_position: int) -> nn.Module:
        text = VLTextModel(config, self.kernels, dtype, device, max_position, self.tp, self.tp_invariant)
        return _Body(self._build_visual(config, dtype, device), text)

    @property
    def language_model(self) -> VLTextModel:
        return self.model.language_model

    @property
    def mm_config(self) -> MultimodalConfig:
        return self.config.multimodal

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        mm: MultimodalBatch | None = None,
    ) -> torch.Tensor:
        """``input_ids: [n]``, ``positions: [n]`` or ``[3, n]`` (t, h, w), ``mm``: the image rows -> final normed
        hidden states ``[n, hidden_size]``. Writes the tokens' K/V into ``attn.kv_caches`` as a side effect."""
        n = input_ids.shape[0]
        if input_ids.dim() != 1 or positions.shape not in ((n,), (3, n)):
            raise ValueError(
                f"expected input_ids [num_tokens] and positions [num_tokens] or [3, num_tokens], got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        if len(attn.kv_caches) != self.config.num_layers:
            raise ValueError(f"expected {self.config.num_layers} (k_cache, v_cache) pairs, got {len(attn.kv_caches)}")
        if mm is not None:
            m, hidden = mm.rows.shape[0], self.config.hidden_size
            if mm.rows.dim() != 1 or mm.embeds.shape != (m, hidden):
                raise ValueError(f"mm.embeds must be [{m}, {hidden}] for {m} rows, got {tuple(mm.embeds.shape)}")
            depth = self.mm_config.num_deepstack_layers
            if depth and (mm.deepstack is None or mm.deepstack.shape != (depth, m, hidden)):
                shape = None if mm.deepstack is None else tuple(mm.deepstack.shape)
                raise ValueError(f"mm.deepstack must be [{depth}, {m}, {hidden}], got {shape}")
        return self.language_model(input_ids, positions, attn, mm)

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[ImageFeatures]:
        """The features of each image, in order, from what the Qwen2-VL image processor returns for them:
        ``pixel_values: [total_patches, C*T*P*P]``, ``grid_thw: [num_images, 3]``. An image's bits never depend on
        the other images of the call (every op is per patch, attention per image or window)."""
        return self.model.visual(pixel_values, grid_thw)

    def mrope_positions(
        self, prompt_token_ids: list[int], image_grid_thw: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, int]:
        """``(positions [3, len(prompt)], delta)``: see ``models.mrope.mrope_positions``."""
        return mrope_positions(self.mm_config, prompt_token_ids, image_grid_thw)

    def checkpoint_name(self, name: str) -> str:
        """Released Qwen2.5-VL names (``visual.*``, ``model.*``) as transformers 5 names them (``model.visual.*``,
        ``model.language_model.*``); other names unchanged."""
        if name.startswith("visual."):
            return "model." + name
        if name.startswith("model.") and not name.startswith(("model.visual.", "model.language_model.")):
            return "model.language_model." + name.removeprefix("model.")
        return name

    def checkpoint_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Fused expert tensors as the released Qwen3-VL-MoE files hold them (``gate_up_proj [E, H, 2I]``,
        ``down_proj [E, I, H]``) transposed to transformers 5's ``[E, 2I, H]`` / ``[E, H, I]``; as transformers, a
        tensor already of that shape is taken as it is."""
        c = self.config
        leaf = name.rpartition(".experts.")[2]
        if c.num_experts == 0 or leaf not in ("gate_up_proj", "down_proj") or tensor.dim() != 3:
            return tensor
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        expected = (e, 2 * i, h) if leaf == "gate_up_proj" else (e, h, i)
        if tuple(tensor.shape) != expected and tuple(tensor.shape) == (e, expected[2], expected[1]):
            return tensor.transpose(1, 2)
        return tensor

    def released_names(self, items):
        """``(name, tensor)`` pairs (a transformers model's ``state_dict()``, or a checkpoint's) in this model's
        names and layouts (``checkpoint_name``, ``checkpoint_layout``)."""
        for name, tensor in items:
            name = self.checkpoint_name(name)
            yield name, self.checkpoint_layout(name, tensor)
