"""Paged attention over one flattened batch: the metadata the engine hands the model, and the attention layer.

Every layer first writes the new tokens' K/V into its paged cache, then attends over the whole cache with one
code path. A query token at position p therefore reads the same cache blocks, in the same order, whether it
arrives in a prefill, a chunk, a decode step or after a prefix-cache hit (DESIGN.md).

The torch path (``torch_write_kv``, ``torch_paged_attention``) gathers K/V out of the cache into dense padded
tensors and calls ``F.scaled_dot_product_attention`` once for all the step's decodes and once per group of
same-shape chunks: fast, but its reduction order follows the batch. It is the negative control and the speed
baseline, not part of the contract.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.ops.attention import CpuAttentionPlan, cpu_attention_plan

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
    _sdpa: "tuple[tuple, list[SdpaGroup]] | None" = field(default=None, init=False, repr=False)  # torch path
    _cpu_plan: CpuAttentionPlan | None = field(default=None, init=False, repr=False)  # invariant CPU path

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def host_lengths(self) -> tuple[list[int], list[int]]:
        """``(seq_lens, query_start_loc)`` as Python lists, copied from the device once per step (torch path)."""
        if self._host is None:
            self._host = (self.seq_lens.tolist(), self.query_start_loc.tolist())
        return self._host

    def cpu_attention_plan(self, k_cache: torch.Tensor, num_q_heads: int) -> CpuAttentionPlan:
        """The invariant CPU attention's work plan for this step (``ops.attention.cpu_attention_plan``), made on
        the first layer's call and shared by every layer with the same cache layout."""
        c = k_cache.shape
        key = (c[1], c[2], c[3], num_q_heads // c[2])
        if self._cpu_plan is None or self._cpu_plan.key != key:
            self._cpu_plan = cpu_attention_plan(
                self.block_tables, self.seq_lens, self.query_start_loc, k_cache.shape, num_q_heads
            )
        return self._cpu_plan


def torch_write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``k, v: [num_tokens, num_kv_heads, head_dim]`` into the caches at ``slot_mapping``."""
    # k_cache: [num_blocks, block_size, num_kv_heads, head_dim] -> [num_slots, num_kv_heads, head_dim]
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


# Bytes of dense K + V one SDPA call of the torch path gathers at most (sequences x the longest of their caches
# x kv_heads x head_dim x 2), unless one sequence alone needs more. On CUDA it keeps the copy for a big decode
# batch small next to the cache and the activation reserve (512 MiB: 2^17 positions of 8 KV heads x 128 in bf16).
# On the CPU, where the copy and SDPA are memory-bound, groups that stay near the cache were 2-3x faster than
# one call for 64 decodes of ~300 keys (2 cores; 32 MiB: 4096 positions of 8 x 128 in fp32).
MAX_GATHER_BYTES = {"cpu": 32 << 20, "cuda": 512 << 20}


@dataclass(frozen=True)
class SdpaGroup:
    """Sequences of one step that the torch path attends in one batched SDPA call.

    Either decodes (one query token each: ``q_len == 1``, ``kv_len`` the longest cache, ``key_mask`` hiding the
    padding of shorter ones) or chunks with the same ``(q_len, kv_len)`` (no padding); consecutive in batch order,
    with at most ``MAX_GATHER_BYTES`` of padded K/V unless one sequence alone has more.

    Attributes:
        rows: the group's query tokens in the flattened batch, sequence-major (a slice when they are contiguous).
        slots: ``[num_seqs * kv_len]`` int64, the cache slot of each key position, sequence-major; past a
            sequence's end it repeats the slot of its last key, which ``key_mask`` hides (so no unwritten slot is
            ever read: 0 * NaN would still poison the output).
        key_mask: ``[num_seqs, 1, 1, kv_len]`` bool, True where a key exists; None when every key does.
    """

    rows: slice | torch.Tensor
    slots: torch.Tensor
    key_mask: torch.Tensor | None
    num_seqs: int
    q_len: int
    kv_len: int


def sdpa_groups(attn: AttentionMetadata, k_cache: torch.Tensor) -> list[SdpaGroup]:
    """The torch path's batching of ``attn`` over caches shaped like ``k_cache``: the decodes, then the chunks
    grouped by shape, both in batch order and split where a group would gather more than ``MAX_GATHER_BYTES``.

    Built once per step (on the first layer's call) and cached on ``attn``; every layer reuses it.
    """
    key = (tuple(k_cache.shape[1:]), k_cache.dtype, k_cache.device.type)
    if attn._sdpa is not None and attn._sdpa[0] == key:
        return attn._sdpa[1]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    cap = MAX_GATHER_BYTES.get(k_cache.device.type, MAX_GATHER_BYTES["cuda"])
    max_keys = cap // (2 * num_kv_heads * head_dim * k_cache.element_size())
    lens, starts = attn.host_lengths()
    decodes: list[int] = []
    chunks: dict[tuple[int, int], list[int]] = {}  # (q_len, kv_len) -> sequences, in batch order
    for i, seq_len in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        if q_len == 1:
            decodes.append(i)
        elif q_len > 1:
            chunks.setdefault((q_len, seq_len), []).append(i)
    runs = [(1, run) for run in _split(decodes, lens, max_keys)]
    runs += [(q_len, run) for (q_len, _), seqs in chunks.items() for run in _split(seqs, lens, max_keys)]
    groups = [_group(attn, run, q_len, block_size) for q_len, run in runs]
    attn._sdpa = (key, groups)
    return groups


def _split(seqs: list[int], lens: list[int], max_keys: int) -> list[list[int]]:
    """``seqs`` cut into consecutive runs of at most ``max_keys`` padded key positions (or one sequence)."""
    runs: list[list[int]] = []
    run: list[int] = []
    longest = 0
    for i in seqs:
        if run and (len(run) + 1) * max(longest, lens[i]) > max_keys:
            runs.append(run)
            run, longest = [], 0
        run.append(i)
        longest = max(longest, lens[i])
    return runs + [run] if run else runs


def _group(attn: AttentionMetadata, seqs: list[int], q_len: int, block_size: int) -> SdpaGroup:
    lens, starts = attn.host_lengths()
    kv_lens = [lens[i] for i in seqs]
    kv_len = max(kv_lens)
    device = attn.seq_lens.device
    if seqs == list(range(seqs[0], seqs[-1] + 1)):
        # Consecutive sequences of equal q_len own consecutive tokens.
        index: slice | torch.Tensor = slice(seqs[0], seqs[-1] + 1)
        rows: slice | torch.Tensor = slice(starts[seqs[0]], starts[seqs[-1]] + q_len)
    else:
        index = torch.tensor(seqs, device=device)
        rows = torch.tensor([t for i in seqs for t in range(starts[i], starts[i] + q_len)], device=device)
    seq_lens = attn.seq_lens[index].long()  # [B]
    tables = attn.block_tables[index].long()  # [B, max_blocks]
    pos = torch.arange(kv_len, device=device)
    last = seq_lens[:, None] - 1
    clamped = torch.minimum(pos[None, :], last)  # [B, kv_len]
    slots = tables.gather(1, clamped // block_size) * block_size + clamped % block_size
    slots = slots.flatten()
    key_mask = None if min(kv_lens) == kv_len else (pos[None, :] <= last)[:, None, None, :]
    return SdpaGroup(rows, slots, key_mask, len(seqs), q_len, kv_len)


def torch_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal GQA attention of ``q: [num_tokens, num_q_heads, head_dim]`` over the paged cache with torch's SDPA:
    one call for the decodes, one per group of same-shape chunks, each split only past ``MAX_GATHER_BYTES``
    (``sdpa_groups``). Returns the same shape.

    Each group gathers its K/V out of the cache into a dense ``[B, kv_heads, kv_len, head_dim]`` with one index.
    Decodes fold the query heads of a KV head into that head's query rows, so the call needs no GQA support and
    can take a fused kernel with the key-padding mask (FlashAttention takes no mask, and on CUDA the
    memory-efficient kernel and on the CPU the flash kernel take no GQA). Chunks use a lower-right causal bias:
    a chunk's queries are the last ``q_len`` positions of ``kv_len``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k_slots = k_cache.view(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, kv_heads, head_dim]
    v_slots = v_cache.view(-1, num_kv_heads, head_dim)
    groups = sdpa_groups(attn, k_cache)
    if len(groups) == 1 and isinstance(groups[0].rows, slice) and groups[0].rows == slice(0, num_tokens):
        return _attend(q, k_slots, v_slots, groups[0], scale)  # one group holds every token: no copy
    out = torch.empty_like(q)  # sequences with no new tokens own no rows; every other row is written
    for g in groups:
        out[g.rows] = _attend(q[g.rows], k_slots, v_slots, g, scale)
    return out


def _attend(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, g: SdpaGroup, scale: float) -> torch.Tensor:
    """One group's SDPA call. ``q: [B * q_len, heads, head_dim]`` (the group's rows); ``k_slots, v_slots:
    [num_slots, kv_heads, head_dim]``, the caches by slot. Returns ``[B * q_len, heads, head_dim]``."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_slots.shape[1]
    # k, v: [B, kv_heads, kv_len, head_dim]
    k = k_slots.index_select(0, g.slots).view(g.num_seqs, g.kv_len, num_kv_heads, head_dim).transpose(1, 2)
    v = v_slots.index_select(0, g.slots).view(g.num_seqs, g.kv_len, num_kv_heads, head_dim).transpose(1, 2)
    if g.q_len == 1:
        # [B, kv_heads, group, head_dim]: q head h reads kv head h // group, as with enable_gqa.
        q = q.reshape(g.num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=g.key_mask, scale=scale)
    else:
        # Imported here: torch.nn.attention.bias imports torch._dynamo (about 2 s), which the invariant path and
        # the CLI never need.
        from torch.nn.attention.bias import causal_lower_right

        q = q.reshape(g.num_seqs, g.q_len, num_heads, head_dim).transpose(1, 2)  # [B, heads, q_len, head_dim]
        causal = causal_lower_right(g.q_len, g.kv_len)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale, enable_gqa=True).transpose(1, 2)
    return out.reshape(-1, num_heads, head_dim)


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
