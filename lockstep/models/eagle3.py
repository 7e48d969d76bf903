"""EAGLE-3 draft heads: the checkpoint format vLLM and SGLang load as ``LlamaForCausalLMEagle3``.

An EAGLE-3 head is one Llama decoder layer that drafts from the target's own hidden states. Its inputs at position
``p`` are the embedding of the token at ``p + 1`` and a hidden state: for the first draft step ``fc`` of the
concatenated residual streams of the target entering three of its layers (low, middle, high: ``aux_layers``) at
``p``; for later steps the head's own pre-norm output of the step before. The layer's attention takes the two,
each normed (``input_layernorm`` the embedding, ``hidden_norm`` the hidden state), side by side: ``2 * hidden``
inputs. The head's LM head covers a smaller draft vocabulary; ``d2t`` maps draft id ``i`` to target id
``i + d2t[i]`` (``t2d``, a mask over the target vocabulary, is the same map the other way; it is checked, not
used). The embedding is the target's unless the checkpoint ships its own ``embed_tokens.weight``.

Checkpoint tensors (the published names): ``fc.weight [H, 3H]``, ``midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight`` (q/k/v ``[*, 2H]``),
``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight [draft_vocab, H]``, ``d2t``, ``t2d``,
optionally ``embed_tokens.weight``; in safetensors, or in a ``pytorch_model.bin`` read tensors-only
(``models/torch_bin.py``), as many published heads ship. The layer runs on the kernel set it is given, like any
lockstep layer.

The same heads in vLLM's "speculators" format (``models/speculators.py``: the layer's config nested in
``transformer_layer_config``, the layer's tensors under ``layers.0.``) load into the same ``Eagle3Head``; a layer
of ``model_type`` "qwen3" adds Qwen3's ``self_attn.q_norm`` / ``k_norm``.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from lockstep.distributed import TPGroup
from lockstep.layers.batch import AttentionMetadata
from lockstep.layers.embedding import LMHead, VocabEmbedding
from lockstep.layers.kernels import Kernels
from lockstep.layers.linear import Linear
from lockstep.layers.norm import RMSNorm
from lockstep.layers.rotary import RotaryEmbedding
from lockstep.models.llama import LlamaAttention, LlamaMLP, ModelConfig
from lockstep.models.speculators import EAGLE3_ARCHITECTURES, is_speculators, published_name, speculators_name
from lockstep.models.speculators import eagle3_config as speculators_eagle3_config

_OPTIONAL = ("embed_tokens.weight", "d2t", "t2d")


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 head's ``config.json``, checked against its target's ``ModelConfig`` (``read_eagle3_config``)."""

    layer: ModelConfig  # the decoder layer's shapes, read as a one-layer Llama
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # the target layers whose input streams feed fc, in fc's input order
    norm_before_residual: bool = False  # the residual is hidden_norm(hidden) rather than hidden
    speculators: bool = False  # vLLM's "speculators" format: its layer's tensors are named layers.0.*


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's choice for a head whose config names none: layers 2, L // 2 and L - 3 of an L-layer target."""
    return (2, num_layers // 2, num_layers - 3)


def read_eagle3_config(path: str | Path, target: ModelConfig) -> Eagle3Config:
    """Parse ``path/config.json``; ValueError naming the head unless it is an EAGLE-3 head this target can run."""
    import json

    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found")
    hf = json.loads(file.read_text())
    speculators = is_speculators(hf)
    if speculators:
        hf = speculators_eagle3_config(hf, path)  # the flat published layout; its architecture is the layer's
        layer_arch = hf["architectures"][0]
    else:
        archs = hf.get("architectures") or []
        if not any(a in EAGLE3_ARCHITECTURES for a in archs):
            raise ValueError(
                f"{path}: an EAGLE-3 head names architecture {EAGLE3_ARCHITECTURES[0]!r} (or is in vLLM's "
                f"speculators format, with speculators_model_type), this one {archs!r}"
            )
        layer_arch = "LlamaForCausalLM"
    if hf.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{path}: EAGLE-3 heads of {hf['num_hidden_layers']} layers are not supported (only 1)")
    layer = ModelConfig.from_hf(hf | {"architectures": [layer_arch], "num_hidden_layers": 1})
    H = target.hidden_size
    target_hidden = hf.get("target_hidden_size") or layer.hidden_size
    if layer.hidden_size != H or target_hidden != H:
        raise ValueError(
            f"{path}: the EAGLE-3 head has hidden_size {layer.hidden_size} (target_hidden_size {target_hidden}), "
            f"its target {H}: a head drafts for the model it was trained on"
        )
    if layer.vocab_size != target.vocab_size:
        raise ValueError(f"{path}: vocab_size {layer.vocab_size}, the target's is {target.vocab_size}")
    draft_vocab = int(hf.get("draft_vocab_size") or layer.vocab_size)
    if not 0 < draft_vocab <= layer.vocab_size:
        raise ValueError(f"{path}: draft_vocab_size {draft_vocab} must be in [1, vocab_size={layer.vocab_size}]")
    eagle = hf.get("eagle_config") or {}
    ids = hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    aux = tuple(int(i) for i in ids) if ids else default_aux_layers(target.num_layers)
    if len(aux) != 3 or not all(0 <= i < target.num_layers for i in aux):
        raise ValueError(
            f"{path}: the aux hidden-state layers {aux} must be 3 layers of the target's {target.num_layers} "
            f"(set eagle_aux_hidden_state_layer_ids)"
        )
    return Eagle3Config(layer, draft_vocab, aux, bool(hf.get("norm_before_residual", False)), speculators)


class Eagle3Head(nn.Module):
    """The head over one flattened, paged batch of draft rows (``forward``), with ``fc`` (``combine``) and the
    draft-vocabulary LM head (``compute_logits``, ``to_target``). ``embed``: the target's embedding, shared (None:
    the head has its own, filled from the checkpoint). ``max_position``: rows of the rotary table."""

    def __init__(
        self,
        config: Eagle3Config,
        kernels: Kernels,
        dtype: torch.dtype,
        device: torch.device | str,
        max_position: int,
        embed: VocabEmbedding | None = None,
    ) -> None:
        super().__init__()
        c = config.layer
        H, tp = c.hidden_size, TPGroup()
        self.config = config
        self.dtype = dtype
        self.fc = Linear(3 * H, H, False, kernels, dtype, device)
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps, kernels, dtype, device)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps, kernels, dtype, device)
        self.self_attn = LlamaAttention(c, 0, kernels, dtype, device, tp, False)
        d = c.head_dim
        parts = (c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d)
        self.self_attn.qkv_proj = Linear(2 * H, parts, c.qkv_bias, kernels, dtype, device)  # [embed, hidden] in
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps, kernels, dtype, device)
        self.mlp = LlamaMLP(c, kernels, dtype, device, tp, False)
        self.norm = RMSNorm(H, c.rms_norm_eps, kernels, dtype, device)
        self.lm_head = LMHead(config.draft_vocab_size, H, kernels, dtype, device)
        self.rotary_emb = RotaryEmbedding(d, max_position, c.rope_theta, c.rope_scaling, dtype, device)
        self.own_embed = embed is None
        self.embed_tokens = VocabEmbedding(c.vocab_size, H, dtype, device) if embed is None else embed
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64, device=device))

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @torch.inference_mode()
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """``aux: [n, 3H]``, the target's streams at three layers -> the first draft step's hidden ``[n, H]``."""
        return self.fc(aux)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids, positions: [n]``, ``hidden: [n, H]`` -> ``(normed, prenorm)``, each ``[n, H]``: the rows
        the LM head reads and the hidden state the next draft step takes. Writes the rows' K/V at
        ``attn.slot_mapping`` into ``attn.kv_caches[0]``."""
        embeds = self.input_layernorm(self.embed_tokens(input_ids))
        if self.config.norm_before_residual:
            hidden = residual = self.hidden_norm(hidden)
        else:
            hidden, residual = self.hidden_norm(hidden), hidden
        x = torch.cat([embeds, hidden], dim=-1)  # [n, 2H]
        x = self.self_attn(x, self.rotary_emb(positions), attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.norm(self.mlp(x), residual)

    @torch.inference_mode()
    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` -> fp32 logits over the draft vocabulary ``[n, draft_vocab_size]``."""
        return self.lm_head(normed)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (``id + d2t[id]``)."""
        return draft_ids + self.d2t[draft_ids]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        c = self.config.layer
        return (num_blocks, block_size, c.num_kv_heads, c.head_dim)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Each published checkpoint name -> the tensor (or the slice of a stacked one) it fills."""
        attn, mlp = self.self_attn, self.mlp
        slots = {
            "fc.weight": self.fc.weight,
            "norm.weight": self.norm.weight,
            "lm_head.weight": self.lm_head.weight,
            "d2t": self.d2t,
            "midlayer.self_attn.o_proj.weight": attn.o_proj.weight,
            "midlayer.mlp.down_proj.weight": mlp.down_proj.weight,
        }
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            slots[f"midlayer.{name}.weight"] = getattr(self, name).weight
        for part, leaf in enumerate(("q_proj", "k_proj", "v_proj")):
            slots[f"midlayer.self_attn.{leaf}.weight"] = attn.qkv_proj.weight[attn.qkv_proj.part_slice(part)]
            if attn.qkv_proj.bias is not None:
                slots[f"midlayer.self_attn.{leaf}.bias"] = attn.qkv_proj.bias[attn.qkv_proj.part_slice(part)]
        if attn.o_proj.bias is not None:
            slots["midlayer.self_attn.o_proj.bias"] = attn.o_proj.bias
        if attn.q_norm is not None:  # a Qwen3 layer (speculators' model_type "qwen3")
            slots["midlayer.self_attn.q_norm.weight"] = attn.q_norm.weight
            slots["midlayer.self_attn.k_norm.weight"] = attn.k_norm.weight
        for part, leaf in enumerate(("gate_proj", "up_proj")):
            slots[f"midlayer.mlp.{leaf}.weight"] = mlp.gate_up_proj.weight[mlp.gate_up_proj.part_slice(part)]
            if mlp.gate_up_proj.bias is not None:
                slots[f"midlayer.mlp.{leaf}.bias"] = mlp.gate_up_proj.bias[mlp.gate_up_proj.part_slice(part)]
        if mlp.down_proj.bias is not None:
            slots["midlayer.mlp.down_proj.bias"] = mlp.down_proj.bias
        if self.own_embed:
            slots["embed_tokens.weight"] = self.embed_tokens.weight
        return {name: t.detach() for name, t in slots.items()}


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's weight files, by name (a leading ``model.`` dropped): its safetensors files, or,
    in a folder that has none, ``pytorch_model.bin`` (or its shards) read tensors-only (``models/torch_bin.py``).
    """
    from lockstep.models.loader import weight_files
    from lockstep.models.torch_bin import bin_files, load_bin

    folder = Path(path)
    pickled = [] if _has_safetensors(folder) else bin_files(folder)
    tensors: dict[str, torch.Tensor] = {}
    for file in pickled:
        for name, tensor in load_bin(file).items():
            tensors[name.removeprefix("model.")] = tensor
    for file in [] if pickled else weight_files(folder):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name.removeprefix("model.")] = f.get_tensor(name)
    return tensors


def resolve_head(model: str) -> str:
    """The head's folder: ``model`` when it is one, else the Hugging Face snapshot (``models.hub``), whose
    ``pytorch_model.bin`` is fetched too when the repo has no safetensors weights (as many published heads)."""
    from lockstep.models.hub import resolve_model

    path = resolve_model(model)
    if _has_safetensors(Path(path)) or Path(model).expanduser().is_dir():
        return path
    return resolve_model(model, torch_bin=True)


def _has_safetensors(folder: Path) -> bool:
    from lockstep.models.loader import INDEX_FILE

    return (folder / INDEX_FILE).is_file() or any(folder.glob("*.safetensors"))


def shared_embedding(target) -> VocabEmbedding | None:
    """The target's embedding to share, when this process holds all of it (None under tensor parallelism)."""
    embed = target.language_model.embed_tokens
    return embed if embed.tp.size == 1 else None


@torch.inference_mode()
def load_eagle3(
    path: str | Path,
    target,
    kernels: Kernels,
    max_position: int,
    target_path: str | Path | None = None,
) -> Eagle3Head:
    """Build the head at ``path`` for ``target`` (a ``LlamaForCausalLM``: its dtype, device and embedding) and load
    its weights. ValueError before anything is used for a missing, unexpected or mis-shaped tensor, a ``d2t``
    mapping outside the target vocabulary, or a ``t2d`` that disagrees with it. ``target_path``: the target's
    folder, read for its embedding when the head has none and the target's is sharded (tensor parallelism)."""
    config = read_eagle3_config(path, target.config)
    tensors = read_tensors(path)
    shown = str  # a tensor's name in the checkpoint's own format, for the errors
    if config.speculators:
        stray = sorted(n for n in tensors if n.startswith("midlayer."))
        if stray:
            names = ", ".join(stray)
            raise ValueError(f"{path}: unexpected tensor(s) {names} in a speculators checkpoint (layers.0.*)")
        tensors = {published_name(name): t for name, t in tensors.items()}
        shown = speculators_name
    embed = None if "embed_tokens.weight" in tensors else shared_embedding(target)
    if embed is None and "embed_tokens.weight" not in tensors:
        if target_path is None:
            raise ValueError(f"{path}: the EAGLE-3 head has no embed_tokens and the target's embedding is sharded")
        tensors["embed_tokens.weight"] = _target_embedding(target_path)
    head = Eagle3Head(config, kernels, target.dtype, target.device, max_position, embed)
    slots = head.checkpoint_tensors()
    V, Vd = config.layer.vocab_size, config.draft_vocab_size
    lm_head = tensors.get("lm_head.weight")
    if lm_head is not None and lm_head.shape[0] != Vd:
        raise ValueError(
            f"{path}: lm_head.weight has {lm_head.shape[0]} rows and draft_vocab_size is {Vd}: the draft vocabulary "
            f"does not match the config"
        )
    missing = sorted(set(slots) - set(tensors) - set(_OPTIONAL))
    if "d2t" not in tensors and Vd != V:
        missing.append("d2t")
    if missing:
        raise ValueError(f"{path}: the EAGLE-3 checkpoint lacks {', '.join(map(shown, missing))}")
    unexpected = sorted(set(tensors) - set(slots) - {"t2d"})
    if unexpected:
        raise ValueError(f"{path}: unexpected tensor(s) {', '.join(map(shown, unexpected))} in an EAGLE-3 checkpoint")
    for name, dest in slots.items():
        if name in tensors and tuple(tensors[name].shape) != tuple(dest.shape):
            got, want = list(tensors[name].shape), list(dest.shape)
            raise ValueError(f"{path}: {shown(name)} has shape {got}, expected {want}")
    _check_vocab_maps(path, tensors.get("d2t"), tensors.get("t2d"), V, Vd)
    for name, dest in slots.items():
        if name in tensors:
            dest.copy_(tensors[name].to(dest.dtype))
    return head


def _check_vocab_maps(path, d2t: torch.Tensor | None, t2d: torch.Tensor | None, V: int, Vd: int) -> None:
    if d2t is None:
        return
    targets = torch.arange(Vd) + d2t.long()
    if targets.min() < 0 or targets.max() >= V:
        raise ValueError(f"{path}: d2t maps draft ids outside the target vocabulary [0, {V})")
    if t2d is None:
        return
    if tuple(t2d.shape) != (V,):
        raise ValueError(f"{path}: t2d has shape {list(t2d.shape)}, expected [{V}] (a mask over the target vocab)")
    mask = t2d.bool()
    if int(mask.sum()) != Vd or not bool(mask[targets].all()):
        raise ValueError(f"{path}: t2d does not mark exactly the target ids d2t maps the draft vocabulary to")


def _target_embedding(target_path: str | Path) -> torch.Tensor:
    from lockstep.models.loader import weight_files

    for file in weight_files(target_path):
        with safe_open(file, framework="pt", device="cpu") as f:
            if "model.embed_tokens.weight" in f.keys():
                return f.get_tensor("model.embed_tokens.weight")
    raise ValueError(f"{target_path}: no model.embed_tokens.weight to give the EAGLE-3 head")
