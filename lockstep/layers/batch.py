"""One forward's batch laid out flat: the metadata the engine hands the model (``AttentionMetadata``) and the one
function that lays a batch out (``flatten_batch``).

``flatten_batch`` is how both the engine (``ModelRunner``) and the RL trainer (``lockstep.rl``) lay a batch out:
the trainer reproduces the sampler's logprobs because the two build their batches with the same code. This module
sits below the layers and the kernel sets that read the metadata (``layers.attention``, ``layers.kernels``,
``layers.torch_kernels``), so none of them imports another for it.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from lockstep.ops.attention import CpuAttentionPlan, cpu_attention_plan

# ``AttentionMetadata.scratch`` key: the step's ``seq_lens`` as a host list, where the step was laid out on the host
# (``FlatBatch.to``). A CUDA graph's metadata has none (one graph serves every step of its bucket); the fast kernel
# set's decode split reads it (``layers.torch_kernels.split_for_batch``), no kernel of the invariant set does.
HOST_SEQ_LENS = "host_seq_lens"
# ... and the step's longest query (new tokens of one sequence), on the host: FlashAttention-4 sizes its grid by it
# (the fast set's prefill attention, ``ops.attention.fa4``).
HOST_MAX_QUERY_LEN = "host_max_query_len"


@dataclass
class AttentionMetadata:
    """Where one forward's tokens live in the paged KV cache. Built by the engine once per step.

    The flattened batch holds ``num_tokens`` tokens of ``num_seqs`` sequences, each sequence's tokens contiguous
    and in position order. Sequence ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i + 1]``; they are its
    last ``query_len`` positions, so its cache holds ``seq_lens[i]`` tokens once they are written.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, cache slot ``block * block_size + offset`` each new token's K/V goes
            to; -1 writes nothing (the padding rows of a CUDA graph).
        block_tables: ``[num_seqs, max_blocks]`` int32, the cache blocks of each sequence in position order.
            Entries past a sequence's last block are never read.
        seq_lens: ``[num_seqs]`` int32, tokens in each sequence's cache after this step (cached + new).
        query_start_loc: ``[num_seqs + 1]`` int32, prefix sums of the new-token counts; ``query_start_loc[-1]``
            equals ``num_tokens``.
        kv_caches: one ``(k_cache, v_cache)`` pair per layer, each
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype (see
            ``LlamaForCausalLM.allocate_kv_cache``).
        scratch: what a kernel set derives from the metadata once per step and every layer reuses (the torch
            path's SDPA groups, the invariant CPU attention's plan).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    scratch: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def host_lengths(self) -> tuple[list[int], list[int]]:
        """``(seq_lens, query_start_loc)`` as Python lists, copied from the device once per step (torch path)."""
        if "host_lengths" not in self.scratch:
            self.scratch["host_lengths"] = (self.seq_lens.tolist(), self.query_start_loc.tolist())
        return self.scratch["host_lengths"]

    def cpu_attention_plan(self, k_cache: torch.Tensor, num_q_heads: int) -> CpuAttentionPlan:
        """The invariant CPU attention's work plan for this step (``ops.attention.cpu_attention_plan``), made on
        the first layer's call and shared by every layer with the same cache layout."""
        c = k_cache.shape
        key = (c[1], c[2], c[3], num_q_heads // c[2])
        plan = self.scratch.get("cpu_attention_plan")
        if plan is None or plan.key != key:
            lens, starts = self.seq_lens, self.query_start_loc
            plan = cpu_attention_plan(self.block_tables, lens, starts, k_cache.shape, num_q_heads)
            self.scratch["cpu_attention_plan"] = plan
        return plan


@dataclass
class FlatBatch:
    """One forward's batch laid out flat, on the host: what ``AttentionMetadata`` and the model's
    ``input_ids``/``positions`` are made of (see there for the meaning of each field)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]  # each padded with 0 to the longest; empty when flatten_batch(tables=False)
    seq_lens: list[int]
    query_start_loc: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def to(
        self,
        device: torch.device | str,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_tables: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``(input_ids, positions, metadata)`` as fresh tensors on ``device``; ``block_tables``, when given, is
        the step's table already on the device (the engine keeps its tables there)."""

        def tensor(xs: list, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.tensor(xs, dtype=dtype).to(device, non_blocking=True)

        starts = self.query_start_loc
        attn = AttentionMetadata(
            slot_mapping=tensor(self.slot_mapping, torch.int64),
            block_tables=tensor(self.block_tables) if block_tables is None else block_tables,
            seq_lens=tensor(self.seq_lens),
            query_start_loc=tensor(self.query_start_loc),
            kv_caches=kv_caches,
            scratch={
                HOST_SEQ_LENS: list(self.seq_lens),
                HOST_MAX_QUERY_LEN: max((starts[i + 1] - starts[i] for i in range(len(starts) - 1)), default=0),
            },
        )
        return tensor(self.input_ids, torch.int64), tensor(self.positions, torch.int64), attn


def flatten_batch(
    chunks: Iterable[tuple[Sequence[int], int, Sequence[int]]], block_size: int, *, tables: bool = True
) -> FlatBatch:
    """Lay out one forward: ``chunks`` holds, per sequence in batch order, ``(token_ids, start, block_table)``:
    the tokens this forward computes, the position of the first of them, and the sequence's cache blocks (at
    least enough for ``start + len(token_ids)`` positions). ``tables=False`` leaves ``block_tables`` empty, for a
    caller that keeps the tables elsewhere."""
    flat = FlatBatch([], [], [], [], [], [0])
    for token_ids, start, table in chunks:
        end = start + len(token_ids)
        flat.input_ids += token_ids
        flat.positions += range(start, end)
        flat.slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        if tables:
            flat.block_tables.append(table[: -(-end // block_size)])
        flat.seq_lens.append(end)
        flat.query_start_loc.append(flat.query_start_loc[-1] + len(token_ids))
    width = max((len(t) for t in flat.block_tables), default=0)
    flat.block_tables = [list(t) + [0] * (width - len(t)) for t in flat.block_tables]
    return flat
