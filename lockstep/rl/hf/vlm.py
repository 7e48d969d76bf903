"""``patch_model`` for transformers' vision-language models (``Qwen3VLForConditionalGeneration``,
``Qwen3VLMoeForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``): the base model's forward
(``model.model``, e.g. ``Qwen3VLModel``) computed as the engine computes a prompt with images.

- The vision tower is lockstep's own (``models.qwen3_vl`` / ``models.qwen2_5_vl``) on the trainer's kernel set,
  built on the meta device and bound to the Hugging Face tower's parameters (the same ``Parameter`` objects, so
  gradients reach them; nothing is copied or registered). Qwen2.5-VL's gate and up projections, one stacked matrix
  in the engine, run through ``layers.stacked_linear`` on the two modules. All images of the batch go through one
  call: an image's features have the same bits alone or among others (the towers' contract), so they equal the
  engine's, which encoded each request's images in whatever step reached them.
- The decoder is ``model.layer_forward`` per layer over the batch laid out flat (``batch.flat_layout``), as
  ``models.vlm.VLTextModel``: the image tokens' embeddings replaced by the features in order, M-RoPE positions from
  the engine's ``models.mrope.mrope_positions`` per sequence (the same integers transformers' ``get_rope_index``
  gives; the engine's table, ``layers.rotary.MRotaryEmbedding``), the residual stream summed out after each of the
  first ``num_deepstack_layers`` layers and the DeepStack features added to the image rows there.

Images are passed as transformers takes them: ``pixel_values [total_patches, C*T*P*P]`` and ``image_grid_thw
[num_images, 3]``, images in the order their placeholder runs appear in the batch (row by row). Videos are not
supported.
"""

import torch
from torch import nn

from lockstep.layers.rotary import MRotaryEmbedding
from lockstep.models.llama import ModelConfig
from lockstep.models.mrope import mrope_positions
from lockstep.rl.hf.batch import flat_layout
from lockstep.rl.hf.layers import K, stacked_linear

_TOWERS = {
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}


def is_vlm(lm: nn.Module) -> bool:
    return hasattr(lm.model, "visual") and hasattr(lm.model, "language_model")


class _StackedModules(nn.Module):
    """A lockstep stacked ``Linear`` (``out_parts`` > 1) run on the Hugging Face modules it stacks."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self._parts = parts  # a plain list: not registered, the patch adds no parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stacked_linear(x, self._parts)


def vision_tower(config: ModelConfig, hf_visual: nn.Module) -> nn.Module:
    """lockstep's tower for ``config`` on the trainer's kernels, its parameters those of ``hf_visual``."""
    family = _TOWERS.get(config.architecture)
    if family is None:
        raise NotImplementedError(f"patch_model does not know the vision tower of {config.architecture}")
    if family == "qwen3_vl":
        from lockstep.models.qwen3_vl import Qwen3VisionModel as Tower
    else:
        from lockstep.models.qwen2_5_vl import Qwen25VisionModel as Tower
    dtype = next(hf_visual.parameters()).dtype
    tower = Tower(config.vision, K, dtype, "meta")
    theirs = dict(hf_visual.named_parameters())
    for name in [n for n, _ in tower.named_modules()]:
        if name.endswith("gate_up_proj"):  # Qwen2.5-VL's MLP: gate and up are separate modules there
            mlp = hf_visual.get_submodule(name.rpartition(".")[0])
            parent = tower.get_submodule(name.rpartition(".")[0])
            parent.gate_up_proj = _StackedModules([mlp.gate_proj, mlp.up_proj])
    for name, param in list(tower.named_parameters()):
        hf_param = theirs.get(name)
        if hf_param is None or hf_param.shape != param.shape:
            raise NotImplementedError(
                f"the Hugging Face vision tower has no parameter {name} of shape {tuple(param.shape)}"
            )
        owner, _, leaf = name.rpartition(".")
        setattr(tower.get_submodule(owner), leaf, hf_param)
    tower.rotary.inv_freq = tower.rotary.inv_freq.to("cpu")  # a host table, never on meta
    return tower


def _sequences(layout) -> list[tuple[int, int]]:
    """``(first flat row, length)`` of each sequence of the flat layout."""
    starts = layout.attn.query_start_loc.tolist()
    return [(a, b - a) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def vlm_backbone(self: nn.Module, patch, input_ids, attention_mask, position_ids, inputs_embeds, pixel_values,
                 image_grid_thw) -> torch.Tensor:  # fmt: skip
    """The patched VLM base model's forward: ``[batch, seq]`` in, last hidden states ``[batch, seq, hidden]``."""
    if input_ids is None:
        raise NotImplementedError("a lockstep-patched vision-language model takes input_ids (not inputs_embeds)")
    config = patch.config
    mm = config.multimodal
    text = self.language_model
    embeds = text.embed_tokens(input_ids)  # [batch, seq, hidden]
    batch, seq, width = embeds.shape
    device = embeds.device
    layout = flat_layout((batch, seq), attention_mask, position_ids, device)
    flat_ids = input_ids.reshape(-1)
    hidden = embeds.reshape(batch * seq, width)
    if layout.rows is not None:
        flat_ids = flat_ids.index_select(0, layout.rows)
        hidden = hidden.index_select(0, layout.rows)  # [num_tokens, hidden]
    # Each sequence's M-RoPE positions, its images taken in order from image_grid_thw.
    grids = [] if image_grid_thw is None else [tuple(int(v) for v in g) for g in image_grid_thw.tolist()]
    host_ids = flat_ids.tolist()
    positions = torch.empty(3, len(host_ids), dtype=torch.int64)
    used = 0
    for first, length in _sequences(layout):
        ids = host_ids[first : first + length]
        runs = sum(1 for j, t in enumerate(ids) if t == mm.image_token_id and (j == 0 or ids[j - 1] != t))
        pos, _ = mrope_positions(mm, ids, grids[used : used + runs])
        positions[:, first : first + length] = pos
        used += runs
    if used != len(grids):
        raise ValueError(f"{len(grids)} images in image_grid_thw for {used} image placeholder runs in input_ids")
    positions = positions.to(device)
    rows = (flat_ids == mm.image_token_id).nonzero()[:, 0]
    deepstack = None
    if grids:
        if pixel_values is None:
            raise ValueError("image_grid_thw without pixel_values")
        features = patch.tower(pixel_values, image_grid_thw)  # per image, in order; autograd on
        image_embeds = torch.cat([f.embeds for f in features])
        if image_embeds.shape[0] != rows.shape[0]:
            raise ValueError(f"{rows.shape[0]} image tokens in input_ids for {image_embeds.shape[0]} image features")
        hidden[rows] = image_embeds.to(hidden.dtype)
        if features[0].deepstack is not None:
            deepstack = torch.cat([f.deepstack for f in features], dim=1)  # [D, image tokens, hidden]
    table = patch.mrope(device, hidden.dtype)
    if int(positions.max()) >= table.max_position:
        raise ValueError(f"a sequence is longer than the model's {table.max_position} positions")
    rope = table(positions)
    num_deepstack = min(mm.num_deepstack_layers, config.num_layers)
    residual = None
    for i, layer in enumerate(text.layers[: config.num_layers]):
        hidden, residual = layer(hidden, residual, rope, layout, patch.spec)
        if i < num_deepstack:
            hidden, residual = hidden + residual, None
            if deepstack is not None:
                hidden[rows] = hidden[rows] + deepstack[i].to(hidden.dtype)
    if residual is None:
        hidden = K.rms_norm(hidden, text.norm.weight, patch.spec.eps, None)
    else:
        hidden, _ = K.rms_norm(hidden, text.norm.weight, patch.spec.eps, residual)
    if layout.rows is not None:
        hidden = hidden.new_zeros(batch * seq, width).index_copy(0, layout.rows, hidden)
    return hidden.view(batch, seq, width)


def mrope_table(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> MRotaryEmbedding:
    """The engine's M-RoPE table (``models.vlm.VLTextModel``'s)."""
    return MRotaryEmbedding(
        config.head_dim, config.max_position_embeddings, config.rope_theta, config.multimodal.mrope_components,
        dtype, device,
    )  # fmt: skip
