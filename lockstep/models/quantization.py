"""FP8 checkpoints and online FP8: which layers hold e4m3 weights, with which scales, and how a checkpoint's
tensors fill them.

Three checkpoint layouts, read from ``config.json``'s ``quantization_config``:
- ``quant_method: "fp8"`` with ``weight_block_size: [128, 128]`` (Qwen3-*-FP8, DeepSeek-V3): ``{layer}.weight`` in
  e4m3 and ``{layer}.weight_scale_inv`` ``[cdiv(N, 128), cdiv(K, 128)]``, the factor that turns e4m3 back into the
  weight; activations quantized per token and 128-column group. Without ``weight_block_size``: one
  ``weight_scale`` per tensor, activations per token.
- ``quant_method: "compressed-tensors"`` with ``format: "float-quantized"`` (llm-compressor's FP8-dynamic): one
  config group of 8-bit float weights, ``strategy`` "channel" (``weight_scale [N, 1]``), "tensor"
  (``weight_scale [1]``) or "block" (``block_structure [bn, 128]``), and dynamic activations per token ("token")
  or per 128-column group ("group", ``group_size`` 128). Static activation scales are refused.
- online (``LLM(model, quantization="fp8")`` of a bf16/fp32 checkpoint): the checkpoint loads as it is, then each
  linear layer's weight is quantized per output channel from the weight alone (``ops.fp8.quantize_weight``),
  activations per token.

A layer is FP8 where the checkpoint stores a scale for it, so a checkpoint's ignore list (the router, the LM head)
needs no reading. Every FP8 layer keeps ``weight_scale: [N, KB]`` fp32, one row of scales per output row (block
scales repeated over their 128 rows, so stacked q/k/v or gate/up parts of any width keep their own) and runs
``ops.fp8.fp8_linear``. The experts of a mixture of experts likewise hold ``w13``/``w2`` in e4m3 with row scales
``[E, 2I, KB]``/``[E, H, KB]`` and run ``ops.moe_fp8``; the LM head, the embedding and the router stay in the model
dtype. A full-precision destination of an FP8 matrix (a checkpoint that quantizes the router) gets the dequantized
values.

Tensor parallelism: the scales are sharded with their weights. A column-parallel layer holds its rows' scales (a
block scale's 128 rows may start mid-block on a rank: its rows are cut out of the expanded scales); a row-parallel
one holds all rows and the K blocks of a block scale its columns touch (a dense layer's whole blocks only:
``ops.fp8_tree.check_tree`` names a layer whose K the tree's 8 chunks would cut mid-block). Scales computed from
the weights (online, dummy weights) are those of the whole checkpoint matrix: a per-channel scale of a row-parallel
layer, or a per-tensor one, takes the max over the ranks (an all-gather, exact). FP8 experts are sharded along I as
the bf16 experts are: each expert's gate and up scales as a column-parallel layer's, its down scales as a
row-parallel one's; a rank's I' may cut a 128-column block (Qwen3-30B-A3B's I = 768 at TP 4 and 8), which both
ranks that share it then hold the scale of. With the tree they run ``ops.moe_fp8_tree``.

Training (``train_fp8``, ``lockstep.rl.load_policy``): a trainer's FP8 layer holds a full-precision master weight
that its forward quantizes as the sampler holds it (``Fp8Train``): online FP8 recomputes the per-channel scales from
the weight at each forward, as ``LLM.load_weights`` of full-precision weights into an online-FP8 engine does; a
checkpoint's layout keeps the checkpoint's scales and quantizes the weight with them (saturating), as
``load_weights`` of full-precision weights into that engine does (``load_weights_slots``). FP8 experts likewise
(``Fp8ExpertsTrain``; ``ops.autograd.moe_experts_fp8``, a straight-through backward into the masters).
"""

from dataclasses import dataclass

import torch
from torch import nn

from lockstep.distributed import Shard, TPGroup
from lockstep.layers.linear import Linear, RowParallelLinear
from lockstep.layers.moe import SparseMoeBlock
from lockstep.ops import fp8, fp8_tree, tp_linear

QUANTIZATIONS = (None, "fp8")


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's FP8 layers are laid out. ``weight``: "block" (``block`` = (bn, bk) scale tiles), "channel" or
    "tensor"; ``act_group``: the activations' scale block (``fp8.GROUP_K``) or None (per token); ``scale_name``: the
    checkpoint's name for a weight scale; ``online``: quantize a full-precision checkpoint after loading it."""

    weight: str
    act_group: int | None
    scale_name: str = "weight_scale"
    block: tuple[int, int] | None = None
    online: bool = False

    def __post_init__(self) -> None:
        if self.weight not in ("block", "channel", "tensor"):
            raise ValueError(f"unknown FP8 weight layout {self.weight!r}")
        if (self.weight == "block") != (self.block is not None):
            raise ValueError("a block layout needs its block size, and only it")
        if self.block is not None and (self.block[1] != fp8.GROUP_K or self.block[0] <= 0):
            raise ValueError(f"FP8 weight blocks must be [N, {fp8.GROUP_K}], got {list(self.block)}")


ONLINE = Fp8Scheme(weight="channel", act_group=None, online=True)


def _compressed_tensors(qc: dict) -> Fp8Scheme | None:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups and qc.get("kv_cache_scheme"):
        return None  # the KV cache alone is quantized (models/kv_scales.py); the weights are as they are
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: expected one config group, got {len(groups)}")
    if qc.get("format") not in ("float-quantized", "naive-quantized", None):
        raise ValueError(f"compressed-tensors: unsupported format {qc.get('format')!r} (FP8 is 'float-quantized')")
    w, a = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors: only 8-bit float weights are supported, got {w}")
    if not a or a.get("type") != "float" or a.get("num_bits") != 8 or not a.get("dynamic"):
        raise ValueError(f"compressed-tensors: only dynamic 8-bit float activations are supported, got {a}")
    if a.get("strategy") == "token":
        act_group = None
    elif a.get("strategy") == "group" and a.get("group_size") == fp8.GROUP_K:
        act_group = fp8.GROUP_K
    else:
        raise ValueError(f"compressed-tensors: activations per token or per {fp8.GROUP_K} columns, got {a}")
    strategy = w.get("strategy")
    if strategy == "block":
        return Fp8Scheme("block", act_group, block=tuple(w.get("block_structure") or ()))
    if strategy not in ("channel", "tensor"):
        raise ValueError(f"compressed-tensors: unsupported weight strategy {strategy!r}")
    return Fp8Scheme(strategy, act_group)


def fp8_scheme(hf: dict, quantization: str | None = None) -> Fp8Scheme | None:
    """The FP8 layout of a checkpoint whose ``config.json`` is ``hf``; ``quantization="fp8"`` quantizes a
    full-precision one online (an FP8 checkpoint keeps its own layout). None: a plain checkpoint, run as it is."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    qc = hf.get("quantization_config")
    if not qc:
        return ONLINE if quantization == "fp8" else None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc) or (ONLINE if quantization == "fp8" else None)
    if method != "fp8":
        raise ValueError(f"unsupported quantization_config.quant_method {method!r}; lockstep reads 'fp8' and "
                         "'compressed-tensors' FP8 checkpoints")  # fmt: skip
    if qc.get("fmt", "e4m3") != "e4m3" or qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"FP8 checkpoints with e4m3 weights and dynamic activations only, got {qc}")
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme("tensor", None)
    return Fp8Scheme("block", fp8.GROUP_K, scale_name="weight_scale_inv", block=tuple(block))


_STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _linears(model: nn.Module):
    """``(module name, layer, checkpoint prefixes of its parts)`` for every linear layer outside the experts."""
    moe = tuple(name + "." for name, m in model.named_modules() if isinstance(m, SparseMoeBlock))
    for name, module in model.named_modules():
        if isinstance(module, (Linear, RowParallelLinear)) and not name.startswith(moe):
            parent, _, leaf = name.rpartition(".")
            yield name, module, [f"{parent}.{p}" for p in _STACKED[leaf]] if leaf in _STACKED else [name]


def _tp(model: nn.Module) -> TPGroup:
    return getattr(model, "tp", None) or TPGroup()


def _check_layer(name: str, module: nn.Module, scheme: Fp8Scheme, tp: TPGroup) -> None:
    # What tensor parallelism asks of an FP8 layer's blocks.
    blocked = scheme.weight == "block" or scheme.act_group is not None
    if isinstance(module, RowParallelLinear):
        k = module.weight.shape[1] * tp.size
        if module.tree:
            fp8_tree.check_tree(name, k, blocked)
        elif tp.size > 1 and blocked and (k // tp.size) % fp8.GROUP_K:
            raise ValueError(
                f"{name}: K={k} over {tp.size} ranks leaves {k // tp.size} columns a rank, not whole "
                f"{fp8.GROUP_K}-column FP8 scale blocks"
            )


def _make_fp8(module: nn.Module, scheme: Fp8Scheme, name: str = "", tp: TPGroup | None = None) -> None:
    # The layer's weight becomes e4m3 [N, K] with row scales [N, KB]; forward then runs ops.fp8.fp8_linear (or, for
    # a row-parallel layer through the tree, ops.fp8_tree).
    _check_layer(name, module, scheme, tp or TPGroup())
    n, k = module.weight.shape
    kb = -(-k // fp8.GROUP_K) if scheme.weight == "block" else 1
    device = module.weight.device
    module.weight = nn.Parameter(torch.empty(n, k, dtype=fp8.FP8, device=device), requires_grad=False)
    module.weight_scale = nn.Parameter(torch.empty(n, kb, dtype=torch.float32, device=device), requires_grad=False)
    module.act_group = scheme.act_group


def _check_experts(name: str, block: SparseMoeBlock, scheme: Fp8Scheme) -> None:
    # What the tree asks of FP8 experts: its 8 chunks of I may cut a 128-column block (ops.fp8_tree.chunk_pieces),
    # and so may a rank's I' (ranks that share a block both hold its scale), but 8 | I.
    if block.tree and block.intermediate_size % tp_linear.CHUNKS:
        raise ValueError(
            f"{name}.experts: the FP8 chunk tree needs the experts' intermediate size to be a multiple of "
            f"{tp_linear.CHUNKS}, got {block.intermediate_size}"
        )


def _make_experts_fp8(block: SparseMoeBlock, scheme: Fp8Scheme, name: str = "") -> None:
    # w13 [E, 2I, H] and w2 [E, H, I] become e4m3 with row scales [E, 2I, KB_H] and [E, H, KB_I] (ops.moe_fp8);
    # under tensor parallelism a rank's I' of each, with its rows' scales and its K blocks of w2's.
    _check_experts(name, block, scheme)
    for param in ("w13", "w2"):
        w = getattr(block, param)
        e, n, k = w.shape
        kb = -(-k // fp8.GROUP_K) if scheme.weight == "block" else 1
        if param == "w2" and scheme.weight == "block" and block.shard is not None:  # the K blocks I' touches
            kb = -(-block.shard[1] // fp8.GROUP_K) - block.shard[0] // fp8.GROUP_K
        setattr(block, param, nn.Parameter(torch.empty(e, n, k, dtype=fp8.FP8, device=w.device), requires_grad=False))
        scale = torch.empty(e, n, kb, dtype=torch.float32, device=w.device)
        setattr(block, f"{param}_scale", nn.Parameter(scale, requires_grad=False))
    block.act_group = scheme.act_group


def _expert_blocks(model: nn.Module):
    """``(block, its checkpoint prefix)`` for every sparse MoE block."""
    for name, module in model.named_modules():
        if isinstance(module, SparseMoeBlock):
            yield module, f"{name.rpartition('.')[0]}.{module.names.block}"


def prepare_checkpoint(model: nn.Module, scheme: Fp8Scheme, names: set[str]) -> None:
    """Turn the linear layers and experts the checkpoint stores scales for (``names``: its tensor names) into FP8
    layers."""
    for name, module, parts in _linears(model):
        has = [f"{p}.{scheme.scale_name}" in names for p in parts]
        if any(has) and not all(has):
            raise ValueError(f"{name}: the checkpoint quantizes some of {parts} to FP8 but not all")
        if all(has):
            _make_fp8(module, scheme, name, _tp(model))
    for block, prefix in _expert_blocks(model):
        if f"{prefix}.experts.0.{block.names.gate}.{scheme.scale_name}" in names:
            _make_experts_fp8(block, scheme, prefix)


class _Slot:
    """A checkpoint tensor's destination that is not a plain view: ``shape`` is the checkpoint tensor's, ``fill``
    turns it into what the model holds. Duck-types the part of a tensor the loader uses."""

    dtype = torch.float32  # what LLM.load_weights sends a rank for it (the slots of scales)

    def __init__(self, shape, fill):
        self.shape = torch.Size(shape)
        self._fill = fill

    def dim(self) -> int:
        return len(self.shape)

    def copy_(self, tensor: torch.Tensor) -> None:
        self._fill(tensor)


def _scale_slot(
    name: str, dest: torch.Tensor, scheme: Fp8Scheme, weight_shard: Shard | None
) -> tuple[_Slot | torch.Tensor, Shard | None]:
    """The destination of a checkpoint scale and the slice of it this rank reads. ``dest: [rows, KB]`` fp32, this
    part's rows of a layer's ``weight_scale``; ``weight_shard``: the slice of the weight this rank holds."""
    rows = dest.shape[0]
    if scheme.weight == "channel":  # [N, 1]: the weight's rows
        return dest, weight_shard if weight_shard is not None and weight_shard.dim == 0 else None
    if scheme.weight == "tensor":
        return _Slot((1,), lambda t: dest.copy_(t.float().reshape(1, 1).expand(rows, 1))), None
    bn = scheme.block[0]
    if weight_shard is None:
        return _Slot((-(-rows // bn), dest.shape[1]), lambda t: dest.copy_(fp8.expand_block_scale(t, rows, bn))), None
    start, stop, full = weight_shard.start, weight_shard.stop, weight_shard.full
    if weight_shard.dim == 1:  # row-parallel: the K blocks its columns touch (a block it shares with a neighbour too)
        g = fp8.GROUP_K
        shard = Shard(1, start // g, -(-stop // g), -(-full // g))
        fill_rows = lambda t: dest.copy_(fp8.expand_block_scale(t, rows, bn))  # noqa: E731
        return _Slot((-(-rows // bn), shard.stop - shard.start), fill_rows), shard
    # Column-parallel: the block rows that cover [start, stop), expanded, then this rank's rows of them.
    shard = Shard(0, start // bn, -(-stop // bn), -(-full // bn))
    skip = start - shard.start * bn

    def fill(t: torch.Tensor) -> None:
        dest.copy_(fp8.expand_block_scale(t, skip + rows, bn)[skip:])

    return _Slot((shard.stop - shard.start, dest.shape[1]), fill), shard


def _scale_shape(rows: int, cols: int, scheme: Fp8Scheme) -> tuple[int, ...]:
    if scheme.weight == "channel":
        return (rows, 1)
    if scheme.weight == "tensor":
        return (1,)
    return (-(-rows // scheme.block[0]), -(-cols // fp8.GROUP_K))


def _dequantizing_slots(name: str, dest: torch.Tensor, scheme: Fp8Scheme) -> dict[str, _Slot]:
    """An FP8 checkpoint matrix that lands in a full-precision destination (an expert's slice of ``w13``/``w2``):
    its weight and its scale are held until both have arrived, then ``dest`` gets the dequantized weight."""
    rows, cols = dest.shape
    held: dict[str, torch.Tensor] = {}

    def take(kind: str):
        def fill(t: torch.Tensor) -> None:
            held[kind] = t
            if len(held) == 2:
                scale = held["scale"].float()
                if scheme.weight == "block":
                    scale = fp8.expand_block_scale(scale, rows, scheme.block[0])
                scale = scale.reshape(-1, 1).expand(rows, 1) if scheme.weight == "tensor" else scale
                dest.copy_(fp8.dequantize(held["weight"].to(fp8.FP8), scale))
                held.clear()

        return fill

    prefix = name.removesuffix(".weight")
    return {
        name: _Slot(dest.shape, take("weight")),
        f"{prefix}.{scheme.scale_name}": _Slot(_scale_shape(rows, cols, scheme), take("scale")),
    }


def checkpoint_slots(
    slots: dict[str, torch.Tensor], scheme: Fp8Scheme, names: set[str], shards: dict[str, Shard] | None = None
) -> tuple[dict, dict[str, Shard]]:
    """The loader's destinations for an FP8 checkpoint, and the slices of them this rank reads (``shards``: the
    model's ``checkpoint_shards()``): each FP8 layer's ``weight_scale`` under the checkpoint's scale name and
    shape; full-precision destinations of FP8 matrices (the experts) dequantize as they load."""
    shards = dict(shards or {})
    out = {}
    for name, dest in slots.items():
        if name.endswith(".weight_scale") and dest.dtype == torch.float32 and dest.dim() == 2:
            prefix = name.removesuffix(".weight_scale")
            target = f"{prefix}.{scheme.scale_name}"
            shards.pop(name, None)
            out[target], shard = _scale_slot(target, dest, scheme, shards.get(f"{prefix}.weight"))
            if shard is not None:
                shards[target] = shard
        elif name.endswith(".weight") and dest.dtype != fp8.FP8 and f"{name[:-7]}.{scheme.scale_name}" in names:
            out.update(_dequantizing_slots(name, dest, scheme))
        else:
            out[name] = dest
    return out, shards


def load_full_precision(
    dest: torch.Tensor,
    full: torch.Tensor,
    shard: Shard | None,
    scale: torch.Tensor,
    scale_shard: Shard | None,
    scheme: Fp8Scheme,
) -> None:
    """``LLM.load_weights`` of a full-precision checkpoint matrix ``full`` (whole, on every rank) into an FP8 layer's
    part: ``dest`` (e4m3, this rank's ``shard`` of it) and ``scale`` (its row scales ``[rows, KB]``, this rank's
    ``scale_shard``). Online FP8 quantizes it afresh, per output channel, as loading it would; a checkpoint's layout
    keeps the layer's scales and quantizes with them (``fp8.quantize_with_scales``, saturating), so that a trainer
    holding the same scales (``Fp8Train``) computes the same bits."""
    if scheme.online:
        w8, s = _quantize(full, scheme, (full.shape[0],))
        dest.copy_(w8 if shard is None else w8[shard.index()])
        scale.copy_(s if scale_shard is None else s[scale_shard.index()])
    else:
        start = shard.start if shard is not None and shard.dim == 1 else 0  # a rank's K may start mid-block
        dest.copy_(fp8.quantize_with_scales(full if shard is None else full[shard.index()], scale, start))


def conform(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale stored as a scalar reads as ``[1]``."""
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


def _quantize(
    w: torch.Tensor, scheme: Fp8Scheme, parts: tuple[int, ...], gather=None, rows_whole: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    # w: [N, K] with stacked parts of these widths (each quantized on its own, as a checkpoint stores it)
    # -> (w8 [N, K], row scales [N, KB]). Under tensor parallelism ``gather`` turns this rank's maxima into every
    # rank's max; ``rows_whole``: this rank holds whole rows (column-parallel), so per-channel maxima are local.
    out, start = [], 0
    for width in parts:
        part = w[start : start + width]
        start += width
        if scheme.weight == "block":
            w8, s = fp8.quantize_weight(part, scheme.block)
            out.append((w8, fp8.expand_block_scale(s, width, scheme.block[0])))
        elif scheme.weight == "channel":
            if gather is None or rows_whole:
                out.append(fp8.quantize_weight(part))
            else:
                out.append(fp8_tree.activation_scales(part, None, gather(fp8_tree.row_amax(part))))
        else:
            flat = part.reshape(1, -1)
            amax = fp8_tree.row_amax(flat)
            w8, s = fp8_tree.activation_scales(flat, None, amax if gather is None else gather(amax))
            out.append((w8.view(part.shape), s.expand(width, 1)))
    return torch.cat([p[0] for p in out]), torch.cat([p[1] for p in out])


def _column_blocks_aligned(name: str, module: nn.Module, scheme: Fp8Scheme) -> None:
    # Block scales computed on a rank are the checkpoint's only where its rows start at a block.
    if scheme.weight != "block" or not isinstance(module, Linear) or module.part_shards is None:
        return
    for shard in module.part_shards:
        if shard.start % scheme.block[0]:
            raise ValueError(
                f"{name}: this rank's rows [{shard.start}, {shard.stop}) of {shard.full} start inside a "
                f"{scheme.block[0]}-row FP8 scale block; quantizing them here needs whole blocks"
            )


@torch.no_grad()
def quantize_model(model: nn.Module, scheme: Fp8Scheme) -> None:
    """Quantize a loaded full-precision model's linear layers in place (online FP8, or a dummy-weight model in a
    checkpoint's layout): the scales of each output row (or block) from its weights alone, those of the whole
    checkpoint matrix under tensor parallelism. The experts' matrices are rounded through e4m3 the same way and
    kept dequantized, as an FP8 checkpoint's experts load."""
    tp = _tp(model)
    gather = (lambda amax: tp.all_gather(amax).amax(0)) if tp.size > 1 else None
    for name, module, _parts in _linears(model):
        _column_blocks_aligned(name, module, scheme)
        w = module.weight.detach()
        parts = getattr(module, "out_parts", (w.shape[0],))
        w8, scale = _quantize(w, scheme, parts, gather, rows_whole=not isinstance(module, RowParallelLinear))
        _make_fp8(module, scheme, name, tp)
        module.weight.copy_(w8)
        module.weight_scale.copy_(scale)
    for block, prefix in _expert_blocks(model):
        half = block.w13.shape[1] // 2
        if scheme.weight == "block" and block.shard is not None and (half % scheme.block[0] or half % fp8.GROUP_K):
            # The ranks' I' cut blocks (Qwen3-30B-A3B's I = 768 at TP 4 and 8): the blocks' maxima are gathered.
            rows, full, h = (block.shard[0], block.intermediate_size), block.intermediate_size, block.w13.shape[2]
            w13 = block.w13.detach()
            gate, up = (_quantize_block_shards(w, scheme.block, rows, (0, h), gather) for w in w13.split(half, 1))
            q13 = (torch.cat([gate[0], up[0]], 1), torch.cat([gate[1], up[1]], 1))
            q2 = _quantize_block_shards(block.w2.detach(), scheme.block, (0, h), (block.shard[0], full), gather)
        else:
            q13 = quantize_experts(block.w13.detach(), scheme, (half, half))  # gate and up: parts of their own
            q2 = quantize_experts(block.w2.detach(), scheme, (block.w2.shape[1],), gather)  # row-parallel over I
        _make_experts_fp8(block, scheme, prefix)
        for dest, dest_scale, (w8, scale) in ((block.w13, block.w13_scale, q13), (block.w2, block.w2_scale, q2)):
            dest.copy_(w8)
            dest_scale.copy_(scale)


def _quantize_block_shards(
    w: torch.Tensor, block: tuple[int, int], rows: tuple[int, int], cols: tuple[int, int], gather
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w: [E, r, c]``, rows ``[rows[0], rows[0] + r)`` of ``rows[1]`` and columns ``[cols[0], cols[0] + c)`` of
    ``cols[1]`` of every expert's matrix -> ``(w8 [E, r, c], row scales [E, r, KB'])`` with the whole matrices'
    block scales (those of the K blocks the columns touch), bit for bit ``fp8.quantize_weight`` of each whole
    matrix: each rank's maxima of every block, 0 where it holds none of it, meet in ``gather`` (a max, exact)."""
    (r0, num_rows), (c0, num_cols) = rows, cols
    bn, bk = block
    e, r, c = w.shape
    nb, kb = -(-num_rows // bn), -(-num_cols // bk)
    amax = torch.empty((e, nb, kb), dtype=torch.float32, device=w.device)
    for i in range(e):
        padded = w.new_zeros((nb * bn, kb * bk), dtype=torch.float32)
        padded[r0 : r0 + r, c0 : c0 + c] = w[i].float().abs()
        amax[i] = padded.view(nb, bn, kb, bk).amax((1, 3))
    scale = gather(amax).clamp(min=fp8._AMAX_FLOOR) / fp8.FP8_MAX  # [E, NB, KB]
    scale = scale.repeat_interleave(bn, dim=1)[:, r0 : r0 + r, c0 // bk : -(-(c0 + c) // bk)].contiguous()
    return torch.stack([fp8.quantize_with_scales(w[i], scale[i], c0) for i in range(e)]), scale


def quantize_experts(
    w: torch.Tensor, scheme: Fp8Scheme, parts: tuple[int, ...], gather=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w: [E, N, K]`` (stacked experts, each with stacked parts of these widths) -> ``(w8 [E, N, K], row scales
    [E, N, KB])``, each expert's matrix quantized on its own as ``_quantize`` does a linear layer's. ``gather``:
    this rank holds a K slice of every row (w2 under tensor parallelism); per-channel or per-tensor maxima are
    then every rank's."""
    e, n, k = w.shape
    if scheme.weight == "channel" and gather is None:  # row-local: every expert at once, the same bits
        w8, scale = fp8.quantize_weight(w.reshape(e * n, k))
        return w8.view(e, n, k), scale.view(e, n, 1)
    q = [_quantize(w[i], scheme, parts, gather, rows_whole=gather is None) for i in range(e)]
    return torch.stack([p[0] for p in q]), torch.stack([p[1] for p in q])


@dataclass(frozen=True)
class Fp8Train:
    """How a trainer's FP8 layer quantizes its master weight: as the sampler holds it. ``scale``: the layer's fixed
    row scales ``[N, KB]`` (a checkpoint's layout), or None (online: from the weight at each forward)."""

    scheme: Fp8Scheme
    parts: tuple[int, ...]
    scale: torch.Tensor | None = None

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``w: [N, K]`` (the master weight, detached) -> ``(w8 [N, K] e4m3, row scales [N, KB])``."""
        if self.scale is None:
            return _quantize(w, self.scheme, self.parts)
        return fp8.quantize_with_scales(w, self.scale), self.scale


@dataclass(frozen=True)
class Fp8ExpertsTrain:
    """``Fp8Train`` for a trainer's FP8 experts: the masters ``w13: [E, 2I, H]`` and ``w2: [E, H, I]`` quantized
    as the sampler holds them, each expert's gate and up on their own. ``scales``: the experts' fixed row scales
    ``(s13, s2)`` (a checkpoint's layout), or None (online: from the masters at each forward)."""

    scheme: Fp8Scheme
    scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def quantize(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The detached masters -> ``(w13_8, s13, w2_8, s2)``."""
        if self.scales is None:
            half = w13.shape[1] // 2
            return (
                *quantize_experts(w13, self.scheme, (half, half)),
                *quantize_experts(w2, self.scheme, (w2.shape[1],)),
            )
        out = []
        for w, scale in zip((w13, w2), self.scales, strict=True):
            e, n, k = w.shape
            out += [fp8.quantize_with_scales(w.reshape(e * n, k), scale.reshape(e * n, -1)).view(e, n, k), scale]
        return tuple(out)


def _train_experts(block: SparseMoeBlock, scheme: Fp8Scheme, name: str, dtype: torch.dtype) -> None:
    # FP8 experts (a checkpoint's) become masters in the model's dtype, their e4m3 values times their scales,
    # keeping those scales; full-precision ones (online FP8) keep their weights as the masters.
    _check_experts(name, block, scheme)
    scales = None
    if block.w13.dtype == fp8.FP8:
        scales = (block.w13_scale.detach().clone(), block.w2_scale.detach().clone())
        for param, scale in zip(("w13", "w2"), scales, strict=True):
            w8 = getattr(block, param).detach()
            e, n, k = w8.shape
            master = fp8.dequantize(w8.reshape(e * n, k), scale.reshape(e * n, -1), dtype).view(e, n, k)
            delattr(block, f"{param}_scale")
            setattr(block, param, nn.Parameter(master, requires_grad=False))
    elif not scheme.online:
        raise ValueError(f"{name}: full-precision experts in an FP8 checkpoint's layout have no scales to keep")
    block.fp8_train = Fp8ExpertsTrain(scheme, scales)
    block.act_group = scheme.act_group


@torch.no_grad()
def train_fp8(model: nn.Module, scheme: Fp8Scheme) -> None:
    """Give a one-process model the trainer's FP8 layers (``Fp8Train``): an FP8 layer (a checkpoint's) becomes a
    master weight in the model's dtype, its e4m3 values times its scales, and keeps those scales; a full-precision
    layer (online FP8 loads the checkpoint as it is) keeps its weight as the master. The forward then quantizes the
    master as the sampler holds it (``layers.linear``, ``ops.autograd.fp8_linear``). The experts of a mixture of
    experts likewise (``Fp8ExpertsTrain``, ``ops.autograd.moe_experts_fp8``)."""
    if _tp(model).size > 1:
        raise ValueError("a trainer's FP8 layers run in one process (tp_invariant=True gives the sampler's tree)")
    for block, prefix in _expert_blocks(model):
        _train_experts(block, scheme, prefix, model.dtype)
    for name, module, _ in _linears(model):
        _check_layer(name, module, scheme, TPGroup())
        parts = getattr(module, "out_parts", (module.weight.shape[0],))
        scale = None
        if module.weight.dtype == fp8.FP8:
            scale = module.weight_scale.detach().clone()
            master = fp8.dequantize(module.weight.detach(), scale, model.dtype)
            del module.weight_scale
            module.weight = nn.Parameter(master, requires_grad=False)
        elif not scheme.online:
            raise ValueError(f"{name}: a full-precision layer in an FP8 checkpoint's layout has no scales to keep")
        module.fp8_train = Fp8Train(scheme, parts, scale)
        module.act_group = scheme.act_group
