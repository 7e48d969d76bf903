"""Kernel sets: the ops a model runs on, chosen by name once when the model is built.

``invariant`` is lockstep's contract: every reduction in ``lockstep.ops`` combines one output element's terms in
an order fixed by the reduction length alone. ``default`` (what ``batch_invariant=False`` runs) is the fast mode a
non-deterministic engine would be: cuBLAS, torch's norms on the CPU and fused ones on CUDA, and on CUDA a paged
attention whose KV split follows the batch; CUDA graphs capture it like the invariant set. It is the negative
control that shows the batch changing the bits, and the speed baseline. ``torch`` runs torch's own ops only (SDPA
over K/V gathered from the cache; for MoE, a loop over the experts), differentiable: the usual RL trainer.
``torch-linear`` mixes (torch's matmul, norm and activation, lockstep's attention) to price invariance outside
attention. Layers call ``self.kernels.<op>``; nothing in the forward pass branches on the set.

Register another set with ``register_kernels``; ``EngineConfig.kernels`` and ``LLM(kernels=...)`` take its name.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lockstep import ops
from lockstep.layers import torch_kernels
from lockstep.layers.activation import silu_and_mul
from lockstep.ops import fp8, tp_linear
from lockstep.ops import moe as moe_ops

if TYPE_CHECKING:
    from lockstep.layers.batch import AttentionMetadata

Tensor = torch.Tensor


@dataclass(frozen=True)
class Kernels:
    """The ops a Llama-family forward and its sampler need.

    - ``linear(x, weight, bias)``: ``x: [n, K]``, ``weight: [N, K]``, ``bias: [N] | None`` -> ``[n, N]``.
    - ``rms_norm(x, weight, eps, residual)``: ``out``, or ``(out, x + residual)`` when ``residual`` is given.
    - ``rms_norm_qk(q, k, q_weight, k_weight, eps)``: ``rms_norm`` of Qwen3's q and k heads, one launch for both
      where they sit side by side (``ops.rms_norm_qk``). Optional: layers call ``rms_norm_q_and_k``, which makes
      two ``rms_norm`` calls without it.
    - ``silu_and_mul(gate_up)``: ``[n, 2I]`` -> ``silu(gate) * up: [n, I]``.
    - ``write_kv(k, v, k_cache, v_cache, slot_mapping)``: scatter new K/V into one layer's paged cache.
    - ``attention(q, k_cache, v_cache, attn, scale)``: causal GQA over the cache,
      ``q: [num_tokens, num_heads, head_dim]`` -> same shape.
    - ``rotary(q, k, cos, sin)``: rotary embedding of ``q, k: [n, heads, head_dim]`` by ``cos, sin: [n, 1, head_dim]``.
    - ``rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)``: ``rotary``, then ``write_kv`` of the
      rotated k and v; returns the rotated q (``ops.rotary_write_kv``: one kernel on CUDA). Optional: layers call
      ``rotary_and_write_kv``, which runs the two ops without it (a set whose two ops differ from ``ops``', such as
      the RL trainer's, leaves it out).
    - ``log_softmax(logits)``: ``[n, vocab]`` -> fp32 logprobs, the sampler's and the RL trainer's.
    - ``log_softmax_at(logits, index)``: ``log_softmax(logits)[r, index[r]]``, the same bits, for a sampler step
      that wants only the sampled tokens' logprobs (``ops.log_softmax_at``). None: ``log_softmax``, gathered.
    - ``tree_linear(x, weight, bias)``: ``linear`` through the chunk tree (``ops.tp_linear``), the row-parallel
      layers' numerics in one process (``tp_invariant``); the same for every set unless one needs a variant (the
      RL trainer's, with autograd).
    - ``moe_route(logits, top_k, renormalize)``: router logits ``[n, E]`` -> ``(weights fp32 [n, k], ids int64
      [n, k])``, the top k experts of each token by softmax probability (``ops.moe.route``).
    - ``moe_experts(x, w13, w2, weights, ids)``: the routed expert MLPs combined by their weights, ``x: [n, H]``,
      ``w13: [E, 2I, H]``, ``w2: [E, H, I]`` -> ``[n, H]`` (``ops.moe.experts``). None in a set without MoE.
    - ``moe_experts_tree(x, w13, w2, weights, ids)``: ``moe_experts`` with each down projection through the chunk
      tree (``ops.moe.experts_tree``), the TP-invariant numerics in one process; like ``tree_linear``, the same for
      every set but the RL trainer's.
    - ``fp8_linear(x, w8, w_scale, bias, act_group)``: an FP8 layer (``ops.fp8.fp8_linear``'s signature); the
      invariant kernel unless a set says otherwise (the fast set's ``torch._scaled_mm``).
    - ``layer_norm(x, weight, bias, eps)``: LayerNorm of ``x: [n, D]`` by ``weight: [D]``, ``bias: [D] | None``,
      in fp32 inside, -> ``[n, D]`` in ``x``'s dtype (the vision towers' norms).
    - ``gelu(x, approximate)``: elementwise GELU, ``approximate`` ``"none"`` (erf) or ``"tanh"``.
    - ``vision_attention(q, k, v, cu_seqlens, scale)``: bidirectional attention within each segment (an image,
      or one of Qwen2.5-VL's windows), ``q, k, v: [total, heads, head_dim]``, ``cu_seqlens: int32
      [num_segments + 1]`` (segment ``s`` is rows ``[cu[s], cu[s + 1])``) -> ``[total, heads, head_dim]``.
      The three are None in a set built for text models only.

    ``batch_invariant`` says whether the set keeps the contract (a row's bits never depend on its batch);
    ``capturable`` whether a decode forward on it can be captured in a CUDA graph (no host syncs, a launch grid
    fixed by the shapes).
    """

    name: str
    batch_invariant: bool
    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor]
    rms_norm: Callable[[Tensor, Tensor, float, Tensor | None], Tensor | tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]
    write_kv: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]
    rotary: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    attention: Callable[[Tensor, Tensor, Tensor, "AttentionMetadata", float], Tensor]
    log_softmax: Callable[[Tensor], Tensor]
    capturable: bool = False
    rotary_write_kv: Callable[..., Tensor] | None = None
    rms_norm_qk: Callable[..., tuple[Tensor, Tensor]] | None = None
    log_softmax_at: Callable[[Tensor, Tensor], Tensor] | None = None
    tree_linear: Callable[[Tensor, Tensor, Tensor | None], Tensor] = tp_linear.tree_linear
    moe_route: Callable[[Tensor, int, bool], tuple[Tensor, Tensor]] | None = None
    moe_experts: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor] | None = None
    moe_experts_tree: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor] = moe_ops.experts_tree
    fp8_linear: Callable[..., Tensor] = fp8.fp8_linear
    layer_norm: Callable[[Tensor, Tensor, Tensor | None, float], Tensor] | None = None
    gelu: Callable[[Tensor, str], Tensor] | None = None
    vision_attention: Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor] | None = None

    def rotary_and_write_kv(
        self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
        slot_mapping: Tensor,
    ) -> Tensor:  # fmt: skip
        """``rotary_write_kv`` where the set has it, else ``rotary`` then ``write_kv``: the rotated q."""
        if self.rotary_write_kv is not None:
            return self.rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        q, k = self.rotary(q, k, cos, sin)
        self.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q

    def rms_norm_q_and_k(
        self, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        """``rms_norm_qk`` where the set has it, else two ``rms_norm`` calls."""
        if self.rms_norm_qk is not None:
            return self.rms_norm_qk(q, k, q_weight, k_weight, eps)
        return self.rms_norm(q, q_weight, eps, None), self.rms_norm(k, k_weight, eps, None)


def _invariant_attention(  # adapts ops.paged_attention to the metadata object
    q: Tensor, k_cache: Tensor, v_cache: Tensor, attn: "AttentionMetadata", scale: float
) -> Tensor:
    plan = None if q.is_cuda else attn.cpu_attention_plan(k_cache, q.shape[1])  # one per step, not per layer
    return ops.paged_attention(
        q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, scale, plan=plan
    )


_REGISTRY: dict[str, Kernels] = {}


def register_kernels(kernels: Kernels) -> Kernels:
    """Make ``kernels`` available by its name (``get_kernels(kernels.name)``); returns it. A name is taken once."""
    if not isinstance(kernels, Kernels):
        raise TypeError(f"register_kernels takes a Kernels, got {kernels!r}")
    if kernels.name in _REGISTRY and _REGISTRY[kernels.name] is not kernels:
        raise ValueError(f"a kernel set named {kernels.name!r} is already registered")
    _REGISTRY[kernels.name] = kernels
    return kernels


def get_kernels(name: str) -> Kernels:
    """The kernel set registered as ``name``; ValueError naming the registered ones otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown kernel set {name!r}; registered: {', '.join(kernel_set_names())}") from None


def kernel_set_names() -> list[str]:
    return list(_REGISTRY)


INVARIANT = register_kernels(
    Kernels(
        name="invariant",
        batch_invariant=True,
        linear=ops.linear,
        rms_norm=ops.rms_norm,
        silu_and_mul=silu_and_mul,
        write_kv=ops.write_kv,
        rotary=ops.rotary,  # elementwise, so the default set uses it too
        attention=_invariant_attention,
        log_softmax=ops.log_softmax,
        capturable=True,
        rotary_write_kv=ops.rotary_write_kv,
        rms_norm_qk=ops.rms_norm_qk,
        log_softmax_at=ops.log_softmax_at,
        moe_route=ops.moe_route,
        moe_experts=ops.moe_experts,
        layer_norm=ops.layer_norm,
        gelu=ops.gelu,
        vision_attention=ops.vision_attention,
    )
)
TORCH = register_kernels(
    Kernels(
        name="torch",
        batch_invariant=False,
        linear=F.linear,
        rms_norm=torch_kernels.torch_rms_norm,
        silu_and_mul=torch_kernels.torch_silu_and_mul,
        write_kv=torch_kernels.torch_write_kv,
        rotary=ops.rotary_torch,
        attention=torch_kernels.torch_paged_attention,
        log_softmax=torch_kernels.torch_log_softmax,
        moe_route=torch_kernels.torch_moe_route,
        moe_experts=torch_kernels.torch_moe_experts,
        layer_norm=torch_kernels.torch_layer_norm,
        gelu=torch_kernels.torch_gelu,
        vision_attention=torch_kernels.torch_vision_attention,
    )
)
DEFAULT = register_kernels(
    dataclasses.replace(
        TORCH,
        name="default",
        rms_norm=torch_kernels.fast_rms_norm,
        rms_norm_qk=torch_kernels.fast_rms_norm_qk,
        write_kv=ops.write_kv,  # a copy: exact on every path, and it skips graph padding rows (slot -1)
        rotary=ops.rotary,
        rotary_write_kv=ops.rotary_write_kv,
        attention=torch_kernels.fast_paged_attention,
        fp8_linear=torch_kernels.fast_fp8_linear,
        moe_experts=torch_kernels.fast_moe_experts,  # no host sync on CUDA: capturable
        vision_attention=torch_kernels.fast_vision_attention,
        capturable=True,
    )
)
TORCH_LINEAR = register_kernels(
    dataclasses.replace(
        DEFAULT,
        name="torch-linear",
        rms_norm=TORCH.rms_norm,
        rms_norm_qk=None,
        attention=INVARIANT.attention,
        vision_attention=INVARIANT.vision_attention,
    )
)
