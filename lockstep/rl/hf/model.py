"""``patch_model``: make a transformers causal LM compute the engine's bits, in place, and stay a transformers model.

The patch replaces three kinds of ``forward`` on the model's own modules (instance attributes, so the classes and
every other model are untouched; ``unpatch_model`` deletes them):

- the base model's (``model.model``, e.g. ``LlamaModel``): embed, lay the batch out flat as the engine does
  (``batch.flat_layout``: padding dropped, packed sequences split where ``position_ids`` restart), look up the
  engine's rotary table, run the layers carrying ``(hidden, residual)``, the final RMSNorm with the last residual
  add fused, and scatter the rows back to ``[batch, seq, hidden]`` (zeros at padding);
- each decoder layer's (``layers.layer_forward``);
- the LM head's: the invariant linear, logits in the model dtype as the engine's head computes them before its
  fp32 cast (``logprobs.selective_log_softmax`` then takes the engine's log_softmax).

Everything else is transformers': ``*ForCausalLM.forward`` (``logits_to_keep``, ``labels`` and its loss),
``save_pretrained`` (the patch adds no parameters, buffers or config entries), PEFT's wrappers, DDP, gradient
checkpointing's switch. The KV cache of ``generate`` is not supported on a patched model: sample with
``lockstep.LLM`` (or ``unpatch_model`` first).

FSDP2 (``torch.distributed.fsdp.fully_shard``), before or after patching: the wrapper renames each wrapped
module's class (``FSDPQwen3ForCausalLM``, ``FSDPLinear``; ``module_class`` reads the original through it) and holds
the parameters as DTensor shards between calls. Its pre-forward hook gathers a wrapped module's full weights into
plain tensors before ``forward`` runs (the instance-attribute forwards here run inside ``Module.__call__``, hooks
around them), so the kernels read whole weights; the backward re-gathers them before the Functions' backward
reads their saved weights, and reduce-scatters the gradients after. ``sampler_weights`` gathers each DTensor in
turn (every rank walks it). Under FSDP2's mixed precision (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``,
verl's default) the model computes in the bf16 casts of its fp32 masters: the bits of a bf16 sampler of the fp32
weights (``LLM(dtype="bfloat16")``, or ``WeightSender(dtype=torch.bfloat16)``), tests/rl/test_hf_fsdp.py.

``torch.compile``: the patched forwards are marked ``torch.compiler.disable``, so compiling a patched model runs
them eagerly, the same bits. Compiling them would let Inductor generate its own code for the elementwise ops
between the kernels (the CPU rotary, casts, the SiLU tiles), contracting multiplies and adds differently from the
engine's eager ops; the engine is not compiled either, and on CUDA the heavy ops are already lockstep's Triton
kernels.
"""

import types
from dataclasses import dataclass

import torch
from torch import nn

from lockstep.layers.rotary import RotaryEmbedding
from lockstep.models.llama import ModelConfig
from lockstep.rl.hf.batch import flat_layout
from lockstep.rl.hf.layers import K, layer_forward
from lockstep.rl.hf.vlm import is_vlm, mrope_table, vision_tower, vlm_backbone
from lockstep.rl.hf.weights import causal_lm

__all__ = ["is_patched", "patch_model", "unpatch_model"]

_STATE = "_lockstep_patch"


@dataclass(frozen=True)
class LayerSpec:
    """What every decoder layer needs beyond its modules (from the config, parsed as the engine parses it)."""

    eps: float
    heads: tuple[int, int, int]  # (num_heads, num_kv_heads, head_dim)
    top_k: int
    renormalize: bool
    tree: bool
    fp8: bool = False  # online FP8 linear layers, as LLM(quantization="fp8") holds them


class _Patch:
    """The patch's state on the base model (a plain attribute, not a module: nothing is registered)."""

    def __init__(self, config: ModelConfig, tp_invariant: bool, fp8: bool = False):
        self.config = config
        self.tree = tp_invariant
        c = config
        self.spec = LayerSpec(
            c.rms_norm_eps, (c.num_heads, c.num_kv_heads, c.head_dim), c.num_experts_per_tok, c.norm_topk_prob,
            tp_invariant, fp8,
        )  # fmt: skip
        self._tables: dict[tuple[torch.device, torch.dtype], RotaryEmbedding] = {}
        self.tower: nn.Module | None = None  # a vision-language model's (rl.hf.vlm.vision_tower)

    def rotary(self, device: torch.device, dtype: torch.dtype) -> RotaryEmbedding:
        """The engine's cos/sin table (``layers.rotary``, built the same way for every position the config allows)."""
        key = (device, dtype)
        if key not in self._tables:
            c = self.config
            self._tables[key] = RotaryEmbedding(
                c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, dtype, device
            )
        return self._tables[key]

    def mrope(self, device: torch.device, dtype: torch.dtype) -> RotaryEmbedding:
        """A vision-language model's M-RoPE table (the engine's, ``rl.hf.vlm.mrope_table``)."""
        key = (device, dtype, "mrope")
        if key not in self._tables:
            self._tables[key] = mrope_table(self.config, device, dtype)
        return self._tables[key]


def module_class(module: nn.Module) -> type:
    """``module``'s own class under any wrapper class FSDP2 gave it: ``fully_shard`` (and ``replicate``) swap a
    module's class for a subclass ``FSDP<Class>`` of ``FSDPModule`` and the original; the parameters and the
    forward stay the module's own."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without torch.distributed
        return type(module)
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _engine_config(lm: nn.Module) -> ModelConfig:
    hf = lm.config.to_dict()
    hf["architectures"] = [module_class(lm).__name__]
    hf["dtype"] = "float32"  # the engine's default dtype only; the model runs in its parameters' dtype
    config = ModelConfig.from_hf(hf)
    if float(getattr(lm.config, "attention_dropout", 0.0) or 0.0) > 0:
        raise ValueError("attention_dropout > 0 has no counterpart in the sampler; set it to 0")
    if float(getattr(lm.config, "router_jitter_noise", 0.0) or 0.0) > 0:
        raise ValueError("router_jitter_noise > 0 has no counterpart in the sampler; set it to 0")
    return config


def _backbone(self: nn.Module, patch: "_Patch", input_ids, attention_mask, position_ids, inputs_embeds) -> torch.Tensor:
    embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [batch, seq, hidden]
    batch, seq, width = embeds.shape
    layout = flat_layout((batch, seq), attention_mask, position_ids, embeds.device)
    hidden = embeds.reshape(batch * seq, width)
    if layout.rows is not None:
        hidden = hidden.index_select(0, layout.rows)  # [num_tokens, hidden]
    table = patch.rotary(embeds.device, embeds.dtype)
    if int(layout.positions.max()) >= table.max_position:
        raise ValueError(f"a sequence is longer than the model's {table.max_position} positions")
    rope = table(layout.positions)
    residual = None
    for layer in self.layers[: patch.config.num_layers]:
        hidden, residual = layer(hidden, residual, rope, layout, patch.spec)
    hidden, _ = K.rms_norm(hidden, self.norm.weight, patch.spec.eps, residual)
    if layout.rows is not None:
        hidden = hidden.new_zeros(batch * seq, width).index_copy(0, layout.rows, hidden)
    return hidden.view(batch, seq, width)


def no_autocast(device: torch.device):
    """The engine runs no autocast: inside the patched model every op computes in the weights' dtype (train in the
    dtype the sampler runs in), whatever autocast (``bf16=True`` mixed precision) a trainer opened around it."""
    return torch.autocast(device.type, enabled=False)


def _check_call(past, kwargs: dict) -> None:
    """What neither patched forward does: continue from a KV cache, or return attentions, per-layer hidden states
    or router logits (NotImplementedError naming it)."""
    if past is not None and past.get_seq_length() > 0:
        raise NotImplementedError("a lockstep-patched model runs whole sequences; generate with lockstep.LLM")
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states") or kwargs.get("output_router_logits"):
        raise NotImplementedError(
            "a lockstep-patched model returns no attentions, per-layer hidden states or router logits"
        )


@torch.compiler.disable
def _model_forward(
    self: nn.Module,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache=None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    past_key_values=None,
    **kwargs,
):
    """The patched base model's forward (see the module docstring): ``[batch, seq]`` in, ``last_hidden_state:
    [batch, seq, hidden]`` out."""
    from transformers.modeling_outputs import BaseModelOutputWithPast, MoeModelOutputWithPast

    patch: _Patch = getattr(self, _STATE)
    _check_call(cache if cache is not None else past_key_values, kwargs)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    with no_autocast(self.norm.weight.device):
        hidden = _backbone(self, patch, input_ids, attention_mask, position_ids, inputs_embeds)
    out = MoeModelOutputWithPast if patch.config.num_experts else BaseModelOutputWithPast
    return out(last_hidden_state=hidden)


@torch.compiler.disable
def _vlm_model_forward(
    self: nn.Module,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache=None,
    inputs_embeds: torch.Tensor | None = None,
    pixel_values: torch.Tensor | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    use_cache: bool | None = None,
    past_key_values=None,
    **kwargs,
):
    """The patched vision-language base model's forward (``rl.hf.vlm``): ``[batch, seq]`` token ids, with
    ``pixel_values`` and ``image_grid_thw`` for the images, in; ``last_hidden_state: [batch, seq, hidden]`` out.
    ``position_ids``, when given, only mark where packed sequences start (1-D positions, as for text models): the
    M-RoPE positions are computed from the tokens and grids, as the engine computes them."""
    from transformers.modeling_outputs import MultimodalBaseModelOutputWithPast, MultimodalMoeBaseModelOutputWithPast

    patch: _Patch = getattr(self, _STATE)
    _check_call(cache if cache is not None else past_key_values, kwargs)
    if pixel_values_videos is not None or video_grid_thw is not None or kwargs.get("mm_encoder_outputs"):
        raise NotImplementedError("a lockstep-patched vision-language model takes images (pixel_values) only")
    if position_ids is not None and position_ids.dim() == 3:  # transformers' own M-RoPE ids: computed here
        position_ids = None
    with no_autocast(self.language_model.norm.weight.device):
        hidden = vlm_backbone(
            self, patch, input_ids, attention_mask, position_ids, inputs_embeds, pixel_values, image_grid_thw
        )
    out = MultimodalMoeBaseModelOutputWithPast if patch.config.num_experts else MultimodalBaseModelOutputWithPast
    return out(last_hidden_state=hidden)


@torch.compiler.disable
def _head_forward(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    # hidden: [..., hidden] -> logits [..., vocab] in the model dtype (the engine's head before its fp32 cast)
    with no_autocast(hidden.device):
        logits = K.linear(hidden.reshape(-1, hidden.shape[-1]), self.weight, self.bias)  # [rows, vocab]
    # Not a view (FSDP2 warns of an FSDP module returning one): the logits own their storage, as F.linear's do.
    return torch.ops.aten._unsafe_view(logits, (*hidden.shape[:-1], logits.shape[-1]))


def patch_model(model: nn.Module, *, tp_invariant: bool = False, quantization: str | None = None) -> nn.Module:
    """Make ``model`` (a transformers ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
    ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM`` or ``MixtralForCausalLM``, a vision-language
    ``Qwen3VLForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration`` or
    ``Qwen2_5_VLForConditionalGeneration`` (``rl.hf.vlm``: images as ``pixel_values`` and ``image_grid_thw``), or a
    PEFT model of one) run lockstep's invariant kernels, forward and backward, in place; returns ``model``.

    Its per-token logprobs (``selective_log_softmax`` of its logits) then equal bit for bit the ``token_logprobs``
    a ``lockstep.LLM`` with the same weights, dtype and device reported when it sampled those tokens, for padded
    (``attention_mask``, left or right) and packed (``position_ids`` restarting per sequence) batches, with
    gradient checkpointing on or off. ``tp_invariant=True`` reproduces an engine at any
    ``tensor_parallel_size`` (or ``LLM(tp_invariant=True)``) instead of a one-process engine's default numerics.
    ``quantization="fp8"`` reproduces an online-FP8 engine (``LLM(quantization="fp8")``): the attention and MLP
    projections quantize their weights per output channel at each forward, as the engine does when it loads them
    (``sampler_weights`` then syncs them), with a straight-through backward (``ops.autograd.fp8_linear``); the
    experts of a mixture of experts likewise, each expert's gate, up and down per channel
    (``ops.autograd.moe_experts_fp8``), the router in full precision. Patching twice replaces the first patch.
    """
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    lm = causal_lm(model)
    config = _engine_config(lm)
    base = lm.model
    if module_class(lm.lm_head) is not nn.Linear:
        raise NotImplementedError(
            f"the LM head is a {module_class(lm.lm_head).__name__}; patch_model needs a plain nn.Linear"
        )
    if quantization is not None and is_vlm(lm):
        raise NotImplementedError("patch_model(quantization=...) of a vision-language model")
    unpatch_model(model)
    state = _Patch(config, tp_invariant, quantization == "fp8")
    setattr(base, _STATE, state)
    if is_vlm(lm):
        state.tower = vision_tower(config, base.visual)
        base.forward = types.MethodType(_vlm_model_forward, base)
    else:
        base.forward = types.MethodType(_model_forward, base)
    for layer in _layers(lm):
        layer.forward = types.MethodType(torch.compiler.disable(layer_forward), layer)
    lm.lm_head.forward = types.MethodType(_head_forward, lm.lm_head)
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo ``patch_model`` (transformers' own forwards again); a model that is not patched is left as it is."""
    lm = causal_lm(model)
    base = lm.model
    for module in (base, lm.lm_head, *_layers(lm)):
        module.__dict__.pop("forward", None)
    base.__dict__.pop(_STATE, None)
    if lm.__dict__.pop("_lockstep_fused_head", None) is not None:  # fused_head.add_fused_lm_head's
        lm.__dict__.pop("forward", None)
    return model


def _layers(lm: nn.Module) -> nn.ModuleList:
    return lm.model.language_model.layers if is_vlm(lm) else lm.model.layers


def is_patched(model: nn.Module) -> bool:
    """Whether ``patch_model`` has patched ``model``."""
    return _STATE in causal_lm(model).model.__dict__
