"""The kernel set a model runs on, chosen once when the model is built.

``INVARIANT`` is lockstep's contract: every reduction in ``lockstep.ops`` combines one output element's terms in
an order fixed by the reduction length alone. ``DEFAULT`` runs the same model on torch's fast kernels
(``F.linear``, ``F.rms_norm``, SDPA over K/V gathered from the paged cache): the negative control that shows the
batch changing the bits, and the speed baseline. Layers call ``self.kernels.<op>``; nothing in the forward pass
branches on the mode.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lockstep import ops
from lockstep.layers.activation import silu_and_mul, torch_silu_and_mul
from lockstep.layers.attention import torch_paged_attention, torch_write_kv
from lockstep.layers.norm import torch_rms_norm

if TYPE_CHECKING:
    from lockstep.layers.attention import AttentionMetadata

Tensor = torch.Tensor


@dataclass(frozen=True)
class Kernels:
    """The ops a Llama-family forward needs.

    - ``linear(x, weight, bias)``: ``x: [n, K]``, ``weight: [N, K]``, ``bias: [N] | None`` -> ``[n, N]``.
    - ``rms_norm(x, weight, eps, residual)``: ``out``, or ``(out, x + residual)`` when ``residual`` is given.
    - ``silu_and_mul(gate_up)``: ``[n, 2I]`` -> ``silu(gate) * up: [n, I]``.
    - ``write_kv(k, v, k_cache, v_cache, slot_mapping)``: scatter new K/V into one layer's paged cache.
    - ``attention(q, k_cache, v_cache, attn, scale)``: causal GQA over the cache,
      ``q: [num_tokens, num_heads, head_dim]`` -> same shape.
    """

    name: str
    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor]
    rms_norm: Callable[[Tensor, Tensor, float, Tensor | None], Tensor | tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]
    write_kv: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]
    attention: Callable[[Tensor, Tensor, Tensor, "AttentionMetadata", float], Tensor]

    @property
    def batch_invariant(self) -> bool:
        return self is INVARIANT


def _invariant_attention(  # adapts ops.paged_attention to the metadata object
    q: Tensor, k_cache: Tensor, v_cache: Tensor, attn: "AttentionMetadata", scale: float
) -> Tensor:
    plan = None if q.is_cuda else attn.cpu_attention_plan(k_cache, q.shape[1])  # one per step, not per layer
    return ops.paged_attention(
        q, k_cache, v_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, scale, plan=plan
    )


INVARIANT = Kernels(
    name="invariant",
    linear=ops.linear,
    rms_norm=ops.rms_norm,
    silu_and_mul=silu_and_mul,
    write_kv=ops.write_kv,
    attention=_invariant_attention,
)
DEFAULT = Kernels(
    name="default",
    linear=F.linear,
    rms_norm=torch_rms_norm,
    silu_and_mul=torch_silu_and_mul,
    write_kv=torch_write_kv,
    attention=torch_paged_attention,
)


def get_kernels(batch_invariant: bool) -> Kernels:
    return INVARIANT if batch_invariant else DEFAULT
