"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), SmolLM2 (tied
embeddings), and the mixtures of experts built on them, Qwen3-MoE (Qwen3's attention) and Mixtral (Mistral's), as
one model over one flattened batch. The layers differ only in their MLP: the gated MLP, or a sparse MoE block
(``layers.moe``) where ``ModelConfig.is_moe_layer`` says so.

A forward takes every scheduled token of every sequence at once, prefill chunks and decode steps mixed:
``input_ids`` and ``positions`` are ``[num_tokens]``, and ``AttentionMetadata`` says which sequence each token
belongs to and where its K/V live in the paged cache. It returns the final (normed) hidden states for every
token; ``compute_logits`` applies the LM head to just the rows the caller wants.

All arithmetic runs through the kernel set picked at construction (``layers.kernels``): "invariant"
(lockstep.ops, the bits of a token's output depend only on its own sequence), "default" (torch's kernels, for
comparison), or any other registered set.

Under tensor parallelism (``tp``, a ``TPGroup`` of N ranks) each rank builds the same model with its shard of the
weights: attention heads and the MLP's intermediate (every expert's, in a mixture of experts) split N ways, KV
heads split or replicated, the vocabulary split for the embedding and the head (docs/design.md, "Tensor
parallelism"). With ``tp_invariant`` the row-parallel layers (and the experts' down projections) reduce through
the chunk tree, so the logits have the same bits at every N, one process included.
"""

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lockstep.distributed import Shard, TPGroup, kv_head_range, split_evenly
from lockstep.layers.attention import Attention
from lockstep.layers.batch import AttentionMetadata
from lockstep.layers.embedding import LMHead, VocabEmbedding
from lockstep.layers.kernels import Kernels, get_kernels
from lockstep.layers.linear import Linear, RowParallelLinear
from lockstep.layers.moe import (
    MIXTRAL_NAMES,
    QWEN3_MOE_NAMES,
    QWEN3_VL_MOE_NAMES,
    SparseMoeBlock,
    per_expert_tensors,
)
from lockstep.layers.norm import RMSNorm
from lockstep.layers.rotary import ROPE_TYPES, RotaryEmbedding
from lockstep.models.multimodal import (
    VLM_TEXT_ARCHITECTURES,
    MultimodalConfig,
    VisionConfig,
    multimodal_from_hf,
    text_config_dict,
)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    *VLM_TEXT_ARCHITECTURES,  # vision-language models (models/qwen3_vl.py, qwen2_5_vl.py)
)
# How each mixture of experts names its MoE block's tensors in a checkpoint.
_EXPERT_NAMES = {
    "Qwen3MoeForCausalLM": QWEN3_MOE_NAMES,
    "MixtralForCausalLM": MIXTRAL_NAMES,
    "Qwen3VLMoeForConditionalGeneration": QWEN3_VL_MOE_NAMES,
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoint matrices that this model stacks into one weight, in stacking order.
_STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture, read from a Hugging Face ``config.json`` by ``from_hf``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None, or {"rope_type": "linear" | "llama3", ...} as in HF
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    dtype: torch.dtype = torch.float32  # the checkpoint's dtype: the default to run in
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (0 experts: a dense model). Layers listed in dense_layers keep the gated MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to one
    dense_layers: tuple[int, ...] = ()
    # A vision-language model: its vision tower and image-token settings (None for a text model).
    vision: VisionConfig | None = None
    multimodal: MultimodalConfig | None = None

    @property
    def text_architecture(self) -> str:
        """The text family whose decoder layers this model has (the architecture itself for a text model)."""
        return VLM_TEXT_ARCHITECTURES.get(self.architecture, self.architecture)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.num_experts > 0 and layer_idx not in self.dense_layers

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; lockstep runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}; lockstep supports {', '.join(ROPE_TYPES)}")
        if (self.architecture in VLM_TEXT_ARCHITECTURES) != (self.vision is not None and self.multimodal is not None):
            raise ValueError(f"{self.architecture} with vision={self.vision} and multimodal={self.multimodal}")
        if (self.num_experts > 0) != (self.architecture in _EXPERT_NAMES):
            raise ValueError(f"{self.architecture} with num_experts={self.num_experts}")
        if self.num_experts > 0:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                bounds = f"[1, num_experts={self.num_experts}]"
                raise ValueError(f"num_experts_per_tok must be in {bounds}, got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Parse a Hugging Face ``config.json`` dict (transformers 4 or 5 layout)."""
        archs = hf.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(f"config.json must name exactly one architecture, got {archs!r}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; lockstep runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        if arch in VLM_TEXT_ARCHITECTURES:
            # The decoder is the text family's, read as that family's config; the vision tower comes alongside.
            text = cls.from_hf(text_config_dict(hf))
            vision, mm = multimodal_from_hf(hf, text.head_dim)
            return dataclasses.replace(text, architecture=arch, vision=vision, multimodal=mm)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu' is implemented")

        # transformers 5 writes rope_parameters; older files write rope_theta and rope_scaling ("type" or "rope_type").
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        if "type" in rope:
            rope.setdefault("rope_type", rope.pop("type"))
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        if rope.get("partial_rotary_factor", 1.0) != 1.0 or hf.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
        scaling = rope if rope.get("rope_type", "default") != "default" else None

        max_pos = int(hf.get("max_position_embeddings", 4096))
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and hf.get("use_sliding_window"):
            raise ValueError(f"{arch} with use_sliding_window=true is not supported")
        if hf.get("sliding_window") and arch in ("MistralForCausalLM", "MixtralForCausalLM"):
            # Within the window, sliding-window attention is full attention: cap the length instead.
            max_pos = min(max_pos, int(hf["sliding_window"]))

        dtype_name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        if dtype_name not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype_name!r} in config.json; expected one of {list(_DTYPES)}")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))

        num_heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            # Qwen2 always has q/k/v bias and never an o_proj bias; the others follow attention_bias.
            qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
            o_bias=False if arch == "Qwen2ForCausalLM" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=_DTYPES[dtype_name],
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe_fields(arch, hf),
        )


def _moe_fields(arch: str, hf: dict) -> dict:
    """The mixture-of-experts fields of ``ModelConfig`` from a Hugging Face config (none for a dense model)."""
    num_layers = hf["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        # Every layer is sparse; the experts are intermediate_size wide and the top k always renormalised.
        return dict(
            num_experts=hf["num_local_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["intermediate_size"],
            norm_topk_prob=True,
        )
    if arch == "Qwen3MoeForCausalLM":
        # Released checkpoints write num_experts; transformers 5 saves it as num_local_experts.
        num_experts = hf.get("num_experts", hf.get("num_local_experts"))
        if num_experts is None:
            raise KeyError("num_experts")
        if num_experts <= 0:
            raise ValueError(f"{arch} with num_experts={num_experts} (no experts) is not supported")
        step = int(hf.get("decoder_sparse_step", 1))
        if step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
        mlp_only = set(hf.get("mlp_only_layers") or ())
        # As transformers: a layer is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid.
        dense = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step)
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            dense_layers=dense,
        )
    return {}


def _row_shards(parts: list[tuple[int, int, int]], tp: TPGroup) -> tuple[Shard, ...] | None:
    """Column-parallel shards along dim 0 from ``(start, stop, full)`` per stacked part; None in one process."""
    return tuple(Shard(0, *part) for part in parts) if tp.size > 1 else None


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        kernels: Kernels,
        dtype: torch.dtype,
        device,
        tp: TPGroup,
        tree: bool,
    ):
        super().__init__()
        c = config
        d = c.head_dim
        # This rank's query heads [q0, q1) and the KV heads [kv0, kv1) they read (replicated when fewer than N).
        q0, q1 = split_evenly(c.num_heads, tp.size, tp.rank, "num_attention_heads")
        kv0, kv1 = kv_head_range(c.num_heads, c.num_kv_heads, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, kv1 - kv0, d
        self.kv_head_start = kv0  # which of the checkpoint's KV heads (and their KV scales) this rank holds
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        kv_shard = (kv0 * d, kv1 * d, c.num_kv_heads * d)
        shards = _row_shards([(q0 * d, q1 * d, c.num_heads * d), kv_shard, kv_shard], tp)
        self.qkv_proj = Linear(c.hidden_size, (q_size, kv_size, kv_size), c.qkv_bias, kernels, dtype, device, shards)
        self.o_proj = RowParallelLinear(c.num_heads * d, c.hidden_size, c.o_bias, kernels, dtype, device, tp, tree)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, kernels, dtype, device)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, kernels, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, d, kernels)
        self.kernels = kernels

    def forward(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata
    ) -> torch.Tensor:
        # hidden: [num_tokens, hidden_size]
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.out_parts, dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # Qwen3: RMSNorm over each head's vector, before the rotation. The [n, heads, head_dim] views into the
            # QKV output go in as they are: on CUDA the kernel reads the strided heads, with no copy first, and
            # the invariant set normalizes q's and k's heads in one launch.
            q, k = self.kernels.rms_norm_q_and_k(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        out = self.attn(q, k, v, rope, attn)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, kernels: Kernels, dtype: torch.dtype, device, tp: TPGroup, tree: bool):
        super().__init__()
        c = config
        self.kernels = kernels
        i0, i1 = split_evenly(c.intermediate_size, tp.size, tp.rank, "intermediate_size")
        shards = _row_shards([(i0, i1, c.intermediate_size)] * 2, tp)
        self.gate_up_proj = Linear(c.hidden_size, (i1 - i0, i1 - i0), c.mlp_bias, kernels, dtype, device, shards)
        self.down_proj = RowParallelLinear(
            c.intermediate_size, c.hidden_size, c.mlp_bias, kernels, dtype, device, tp, tree
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden_size] -> gate_up: [num_tokens, 2 * intermediate] -> [num_tokens, hidden_size]
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))


def _mlp(
    config: ModelConfig, layer_idx: int, kernels: Kernels, dtype: torch.dtype, device, tp: TPGroup, tree: bool
) -> nn.Module:
    """Layer ``layer_idx``'s MLP: the gated MLP, or the sparse MoE block in a mixture of experts' sparse layers."""
    if not config.is_moe_layer(layer_idx):
        return LlamaMLP(config, kernels, dtype, device, tp, tree)
    c = config
    names = _EXPERT_NAMES[c.architecture]
    return SparseMoeBlock(
        c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, names,
        kernels, dtype, device, tp, tree,
    )  # fmt: skip


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        kernels: Kernels,
        dtype: torch.dtype,
        device,
        tp: TPGroup,
        tree: bool,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, dtype, device)
        self.self_attn = LlamaAttention(config, layer_idx, kernels, dtype, device, tp, tree)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, dtype, device)
        self.mlp = _mlp(config, layer_idx, kernels, dtype, device, tp, tree)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse the add before it:
        # after this layer, the stream is hidden + residual (HF's hidden_states), summed in the model dtype.
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, attn)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        kernels: Kernels,
        dtype: torch.dtype,
        device,
        max_position: int,
        tp: TPGroup,
        tree: bool,
    ):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype, device, tp)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, max_position, config.rope_theta, config.rope_scaling, dtype, device
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, kernels, dtype, device, tp, tree) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, dtype, device)
        # EAGLE-3 drafting (spec/eagle3.py): the layers whose input residual streams a forward keeps, concatenated
        # in this order into ``aux_hidden`` [num_tokens, len * hidden_size]; () keeps none and costs nothing.
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        rope = self.rotary_emb(positions)
        residual = None
        streams: dict[int, torch.Tensor] | None = {} if self.aux_layers else None
        for i, layer in enumerate(self.layers):
            if streams is not None and i in self.aux_layers:
                # The stream entering layer i, summed as the norm's fused add sums it; the target's bits are untouched.
                streams[i] = hidden if residual is None else hidden + residual
            hidden, residual = layer(hidden, residual, rope, attn)
        if streams is not None:
            self.aux_hidden = torch.cat([streams[i] for i in self.aux_layers], dim=-1)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over one flattened, paged batch.

    Build it empty with ``LlamaForCausalLM(config, ...)`` and fill it with ``load_model`` (loader.py) or by
    copying into ``checkpoint_tensors()``. Parameters are plain tensors (``requires_grad=False``) in ``dtype``.
    """

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
        """``kernels`` is a kernel set or its registered name (``layers.kernels``); ``max_model_len`` caps the
        positions the rotary table covers (default: the config's maximum).

        ``tp`` is this process's tensor-parallel group (default: one process); the model then holds this rank's
        shard only. ``tp_invariant`` selects the chunk-tree reduction for the row-parallel layers, whose bits do
        not depend on the TP size; the default is on exactly when ``tp.size > 1`` and the kernel set is batch
        invariant (a plain all-reduce would follow the batch). It needs a batch-invariant kernel set.
        """
        super().__init__()
        dtype = dtype or config.dtype
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; expected one of {list(_DTYPES.values())}")
        max_position = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        self.config = config
        self.kernels = kernels if isinstance(kernels, Kernels) else get_kernels(kernels)
        self.tp = tp or TPGroup()
        if tp_invariant is None:
            tp_invariant = self.tp.size > 1 and self.kernels.batch_invariant
        if tp_invariant and not self.kernels.batch_invariant:
            raise ValueError(f"tp_invariant=True needs a batch-invariant kernel set, not {self.kernels.name!r}")
        self.tp_invariant = tp_invariant
        self.dtype = dtype
        self.kv_cache_dtype = dtype  # or torch.float8_e4m3fn (EngineConfig.kv_cache_dtype="fp8")
        self.max_model_len = max_position
        self.model = self._build_model(config, dtype, device, max_position)
        tied = self.language_model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(
            config.vocab_size, config.hidden_size, self.kernels, dtype, device, tied_to=tied, tp=self.tp
        )

    def _build_model(self, config: ModelConfig, dtype: torch.dtype, device, max_position: int) -> nn.Module:
        """What ``self.model`` holds: the decoder stack here (a vision-language model adds its vision tower)."""
        return LlamaModel(config, self.kernels, dtype, device, max_position, self.tp, self.tp_invariant)

    @property
    def language_model(self) -> "LlamaModel":
        """The decoder stack: embedding, layers, final norm."""
        return self.model

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """``input_ids, positions: [num_tokens]`` -> final normed hidden states ``[num_tokens, hidden_size]``.

        Writes the tokens' K/V into ``attn.kv_caches`` at ``attn.slot_mapping`` as a side effect.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"expected input_ids and positions of shape [num_tokens], got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        if len(attn.kv_caches) != self.config.num_layers:
            raise ValueError(f"expected {self.config.num_layers} (k_cache, v_cache) pairs, got {len(attn.kv_caches)}")
        return self.model(input_ids, positions, attn)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: [n, hidden_size]`` (rows picked from ``forward``'s output) -> fp32 logits ``[n, vocab_size]``."""
        return self.lm_head(hidden)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank holds (all of them in one process)."""
        return self.language_model.layers[0].self_attn.num_kv_heads

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, block_size, self.num_kv_heads, self.config.head_dim)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one cache block takes across all layers, K and V (this rank's heads)."""
        c = self.config
        return 2 * c.num_layers * block_size * self.num_kv_heads * c.head_dim * self.kv_cache_dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One zeroed ``(k_cache, v_cache)`` pair per layer, for ``AttentionMetadata.kv_caches``."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        return [
            (
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
            )
            for _ in range(self.config.num_layers)
        ]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Map each Hugging Face checkpoint tensor name to the tensor (or slice of a stacked one) it fills.

        With tied embeddings there is no ``lm_head.weight`` entry: the head reads ``model.embed_tokens.weight``.
        Under tensor parallelism each entry takes the slice ``checkpoint_shards()`` names.
        """
        return {name: dest for name, dest, _ in self._checkpoint_entries()}

    def released_names(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs in released checkpoint names: transformers 5's fused expert tensors
        (``layers.moe.per_expert_tensors``) become one pair per expert matrix; every other pair passes unchanged."""
        names = _EXPERT_NAMES.get(self.config.architecture)
        for name, tensor in items:
            parts = None if names is None else per_expert_tensors(name, tensor, names)
            yield from [(name, tensor)] if parts is None else parts

    def checkpoint_name(self, name: str) -> str:
        """The ``checkpoint_tensors`` name of the tensor a checkpoint file calls ``name`` (the same, here)."""
        return name

    def checkpoint_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor read from a checkpoint file, in the layout of its ``checkpoint_tensors`` slot (as read, here)."""
        return tensor

    def checkpoint_shards(self) -> dict[str, Shard]:
        """The slice of each checkpoint tensor this rank holds, for the tensors a rank holds only part of."""
        return {name: shard for name, _, shard in self._checkpoint_entries() if shard is not None}

    def _checkpoint_entries(self):
        moe_prefixes: tuple[str, ...] = ()
        for module_name, module in self.named_modules():
            if module is self.lm_head and self.config.tie_word_embeddings:
                continue
            if isinstance(module, SparseMoeBlock):  # it names its own tensors, those of its router included
                moe_prefixes += (module_name + ".",)
                layer_prefix = module_name.rpartition(".")[0]
                yield from module.checkpoint_entries(layer_prefix)
                continue
            if module_name.startswith(moe_prefixes):
                continue
            parent, _, leaf = module_name.rpartition(".")
            shard_of = getattr(module, "shard_of", lambda param_name, part: None)
            for param_name, param in module.named_parameters(recurse=False):
                if leaf in _STACKED:
                    for part, hf_leaf in enumerate(_STACKED[leaf]):
                        name = f"{parent}.{hf_leaf}.{param_name}"
                        yield name, param.detach()[module.part_slice(part)], shard_of(param_name, part)
                else:
                    shard = shard_of(param_name, None)
                    dest = param.detach()
                    if shard is not None:  # a vocabulary slice may be shorter than its padded rows
                        dest = dest.narrow(shard.dim, 0, shard.stop - shard.start)
                    yield f"{module_name}.{param_name}", dest, shard
