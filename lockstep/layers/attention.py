"""Paged attention over one flattened batch: the metadata the engine hands the model, and the attention layer.

Every layer first writes the new tokens' K/V into its paged cache, then attends over the whole cache with one
code path. A query token at position p therefore reads the same cache blocks, in the same order, whether it
arrives in a prefill, a chunk, a decode step or after a prefix-cache hit (DESIGN.md).

The torch path (``torch_write_kv``, ``torch_paged_attention``) gathers each sequence's K/V out of the cache and
calls ``F.scaled_dot_product_attention``: fast, but its reduction order follows the batch. It is the negative
control and the speed baseline, not part of the contract.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from lockstep.layers.kernels import Kernels


@dataclass
class AttentionMetadata:
    """Where one forward's tokens live in the paged KV cache. Built by the engine once per step.

    The flattened batch holds ``num_tokens`` tokens of ``num_seqs`` sequences, each sequence's tokens contiguous
    and in position order. Sequence ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i + 1]``; they are its
    last ``query_len`` positions, so its cache holds ``seq_lens[i]`` tokens once they are written.

    Attributes:
        slot_mapping: ``[num_tokens]`` int, cache slot ``block * block_size + offset`` each new token's K/V goes to.
        block_tables: ``[num_seqs, max_blocks]`` int, the cache blocks of each sequence in position order.
            Entries past a sequence's last block are never read.
        seq_lens: ``[num_seqs]`` int, tokens in each sequence's cache after this step (cached + new).
        query_start_loc: ``[num_seqs + 1]`` int, prefix sums of the new-token counts; ``query_start_loc[-1]``
            equals ``num_tokens``.
        kv_caches: one ``(k_cache, v_cache)`` pair per layer, each
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype (see
            ``LlamaForCausalLM.allocate_kv_cache``).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    _host: tuple[list[int], list[int]] | None = field(default=None, init=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def host_lengths(self) -> tuple[list[int], list[int]]:
        """``(seq_lens, query_start_loc)`` as Python lists, copied from the device once per step (torch path)."""
        if self._host is None:
            self._host = (self.seq_lens.tolist(), self.query_start_loc.tolist())
        return self._host


def torch_write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``k, v: [num_tokens, num_kv_heads, head_dim]`` into the caches at ``slot_mapping``."""
    # k_cache: [num_blocks, block_size, num_kv_heads, head_dim] -> [num_slots, num_kv_heads, head_dim]
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def torch_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal GQA attention of ``q: [num_tokens, num_q_heads, head_dim]`` over the paged cache, one SDPA call per
    sequence. Returns ``[num_tokens, num_q_heads, head_dim]``."""
    lens, starts = attn.host_lengths()
    block_tables = attn.block_tables
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for i, seq_len in enumerate(lens):
        q0, q1 = starts[i], starts[i + 1]
        num_new = q1 - q0
        if num_new == 0:
            continue
        blocks = block_tables[i, : (seq_len + block_size - 1) // block_size].long()
        # k_cache[blocks]: [nb, block_size, kv_heads, head_dim] -> [kv_heads, seq_len, head_dim]
        k = k_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
        v = v_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
        qi = q[q0:q1].transpose(0, 1)  # [q_heads, num_new, head_dim]
        if num_new == 1:
            mask, causal = None, False  # a lone last token sees the whole cache
        elif num_new == seq_len:
            mask, causal = None, True
        else:
            # New token j sits at position seq_len - num_new + j and sees keys 0..that position.
            q_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)
            mask, causal = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None], False
        oi = F.scaled_dot_product_attention(
            qi[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
        out[q0:q1] = oi[0].transpose(0, 1)
    return out


class Attention(nn.Module):
    """Writes one layer's new K/V into its cache, then attends over the cache. No weights of its own."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, kernels: "Kernels"):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.kernels = kernels

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim]
        k_cache, v_cache = attn.kv_caches[self.layer_idx]
        self.kernels.write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        return self.kernels.attention(q, k_cache, v_cache, attn, self.scale)
