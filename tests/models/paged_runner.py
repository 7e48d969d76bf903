"""A minimal paged-batch runner standing in for the engine, for the model tests."""

from dataclasses import dataclass, field

import torch

from lockstep.layers.batch import flatten_batch
from lockstep.models.llama import LlamaForCausalLM


@dataclass
class PagedRunner:
    """Owns a paged KV cache for one model and runs flattened batches over it, like the engine would.

    Blocks are handed out from ``block_order`` (default: ascending), so a test can place a sequence's blocks
    anywhere in the pool.
    """

    model: LlamaForCausalLM
    num_blocks: int = 64
    block_size: int = 4
    block_order: list[int] | None = None
    tables: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kv_caches = self.model.allocate_kv_cache(self.num_blocks, self.block_size)
        self.free = list(self.block_order if self.block_order is not None else range(self.num_blocks))

    def _table(self, seq: str, num_tokens: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop(0))
        return table

    def forward(
        self, chunks: list[tuple[str, list[int], int]], positions: torch.Tensor | None = None, mm=None
    ) -> list[torch.Tensor]:
        """Run ``(seq_id, new_token_ids, start_position)`` chunks as one flattened batch, laid out by the engine's
        ``flatten_batch``. Returns each chunk's final hidden states, ``[len(new_token_ids), hidden_size]``.

        A vision-language model may take the rows' M-RoPE ``positions`` (``[3, num_tokens]``, in place of the
        cache positions) and ``mm`` (the batch's ``MultimodalBatch``).
        """
        layout = [(tokens, start, self._table(seq, start + len(tokens))) for seq, tokens, start in chunks]
        flat = flatten_batch(layout, self.block_size)
        input_ids, flat_positions, attn = flat.to(self.model.device, self.kv_caches)
        if positions is None and mm is None:
            hidden = self.model(input_ids, flat_positions, attn)
        else:
            positions = flat_positions if positions is None else positions.to(self.model.device)
            hidden = self.model(input_ids, positions, attn, mm)
        starts = flat.query_start_loc
        return [hidden[starts[i] : starts[i + 1]] for i in range(len(chunks))]

    def prefill_logits(self, seq: str, tokens: list[int]) -> torch.Tensor:
        """fp32 logits at every position of one sequence prefilled alone: ``[len(tokens), vocab]``."""
        return self.model.compute_logits(self.forward([(seq, tokens, 0)])[0])

    def greedy(self, seq: str, prompt: list[int], max_new_tokens: int, stop: tuple[int, ...] = ()) -> list[int]:
        hidden = self.forward([(seq, prompt, 0)])[0][-1:]
        out: list[int] = []
        while len(out) < max_new_tokens:
            token = int(self.model.compute_logits(hidden).argmax(-1))
            out.append(token)
            if token in stop:
                break
            hidden = self.forward([(seq, [token], len(prompt) + len(out) - 1)])[0]
        return out
