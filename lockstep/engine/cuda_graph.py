"""CUDA graphs for decode steps: the model's forward captured once per batch-size bucket, replayed every step.

A decode step launches hundreds of small kernels; launched one by one from Python, the host is the bottleneck
at small batch. Each bucket's graph runs the forward over preallocated input and metadata buffers; a step
copies its batch into the first rows, pads the rest up to the bucket and replays the graph.

Why the bits stay the same (docs/design.md, "CUDA graphs"): every kernel is row-invariant, so the padding
rows cannot change a real row; the matmul gives a row the same bits at every M, so the bucket's M does not
matter either; and the attention kernel's grid depends only on shapes (the block-table buffer is as wide as
the longest sequence allowed), while the reduction order of a row is fixed by the split size, not by the
grid. Padding rows write no K/V (slot -1) and attend over one position of whatever block their table row
names; their outputs are never read.
"""

import torch

from lockstep.engine.token_feed import FedRows
from lockstep.layers.batch import AttentionMetadata, FlatBatch

# Steps whose sequences each bring at most this many tokens (a verify chunk of k + 1 <= 8 tokens, a draft model's
# new tokens, a short prompt) replay a graph too, each token as a one-token row of its own (``expand_rows``).
MAX_GRAPH_CHUNK = 8


def expand_rows(flat: FlatBatch) -> tuple[list[int], list[int]]:
    """``flat`` as one-token rows, the way a decode graph runs it: each token's sequence length (its sequence's
    length less the step's tokens after it) and the index of the sequence whose block table it reads. A chunk's row
    at position p then attends over positions 0..p, the K/V of the chunk's earlier rows included (every layer writes
    the step's K/V before it attends): the same blocks in the same order as in the chunk, so the same bits."""
    seq_lens: list[int] = []
    owners: list[int] = []
    starts = flat.query_start_loc
    for i, length in enumerate(flat.seq_lens):
        q = starts[i + 1] - starts[i]
        seq_lens += range(length - q + 1, length + 1)
        owners += [i] * q
    return seq_lens, owners


# The most rows speculation adds buckets for (vLLM's default capture sizes also stop at 512).
MAX_VERIFY_ROWS = 512


def graph_rows(max_num_seqs: int, num_speculative_tokens: int, max_num_batched_tokens: int) -> int:
    """The rows of the largest bucket: ``max_num_seqs`` decode rows, or with ``num_speculative_tokens`` drafts a
    sequence every sequence's verify rows (k + 1 each), up to ``MAX_VERIFY_ROWS`` and the step's token budget. A
    verify step past the largest bucket runs eagerly: at 36 layers on the H200, 35-64 ms against 6-7 ms replayed."""
    verify = min(max_num_seqs * (num_speculative_tokens + 1), MAX_VERIFY_ROWS, max_num_batched_tokens)
    return max(max_num_seqs, verify)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, then steps of 8 to 64 and of 16 beyond, and ``max_num_seqs`` itself."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max_num_seqs + 1, 16)]
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """One captured decode forward per bucket, over shared static buffers (``capture`` builds them)."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_num_seqs: int, max_blocks: int):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        device = model.device
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        # One token per sequence: query_start_loc is 0, 1, 2, ... for every decode step.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.aux_outputs: dict[int, torch.Tensor] = {}  # EAGLE-3: each bucket's aux hidden states (model.aux_layers)

    def _forward(self, size: int) -> torch.Tensor:
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            kv_caches=self.kv_caches,
        )
        return self.model(self.input_ids[:size], self.positions[:size], attn)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, in one memory pool. Each is run once eagerly first, so every
        kernel is compiled before capture (and none while serving)."""
        pool = None
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[size] = self._forward(size)
                if self.model.language_model.aux_layers:
                    self.aux_outputs[size] = self.model.language_model.aux_hidden
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.model.device)

    def release(self) -> None:
        """Free the graphs and their memory pool. Under TP first: a captured NCCL collective holds on to its
        communicator until its graph is freed, and destroying the group before that waits forever."""
        torch.cuda.synchronize(self.model.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.aux_outputs.clear()

    def can_run(self, flat: FlatBatch) -> bool:
        """Whether ``flat`` fits a bucket as one-token rows: a decode step (one token per sequence), or a step whose
        sequences bring at most ``MAX_GRAPH_CHUNK`` tokens each (``expand_rows``)."""
        n, num_seqs = flat.num_tokens, len(flat.seq_lens)
        if not 0 < n <= self.max_batch:
            return False
        starts = flat.query_start_loc
        return n == num_seqs or all(starts[i + 1] - starts[i] <= MAX_GRAPH_CHUNK for i in range(num_seqs))

    def fill(self, flat: FlatBatch, block_tables: torch.Tensor) -> int:
        """Copy a step into the buffers as one-token rows, padded up to its bucket; returns the bucket.
        ``block_tables``: the step's ``[num_seqs, width <= max_blocks]`` table on the device."""
        n = flat.num_tokens
        size = next(s for s in self.sizes if s >= n)
        device = self.input_ids.device
        decode = n == len(flat.seq_lens)
        seq_lens, owners = (flat.seq_lens, []) if decode else expand_rows(flat)
        # One host tensor for the per-row values, copied in one transfer.
        values = [flat.input_ids, flat.positions, flat.slot_mapping, seq_lens] + ([] if decode else [owners])
        rows = torch.tensor(values, dtype=torch.int64)
        if device.type == "cuda":
            rows = rows.pin_memory()
        rows = rows.to(device, non_blocking=True)
        self.input_ids[:n].copy_(rows[0])
        self.positions[:n].copy_(rows[1])
        self.slot_mapping[:n].copy_(rows[2])
        self.seq_lens[:n].copy_(rows[3])
        if size > n:  # padding rows: write nothing, attend over one position
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
        tables = block_tables if decode else block_tables.index_select(0, rows[4])  # each row its sequence's
        self.block_tables[:n, : tables.shape[1]].copy_(tables)
        return size

    def run(self, flat: FlatBatch, block_tables: torch.Tensor, fed: FedRows | None = None) -> torch.Tensor:
        """Replay the smallest bucket that holds ``flat``; its hidden states ``[num_tokens, hidden]`` in the step's
        token order (a view into the graph's output, valid until the next replay). ``fed``: input rows that take
        the previous step's sampled tokens, on the device (async scheduling)."""
        size = self.fill(flat, block_tables)
        if fed is not None:
            fed.write(self.input_ids)
        self.graphs[size].replay()
        if size in self.aux_outputs:  # the replay's aux rows, as an eager forward would have left them
            self.model.language_model.aux_hidden = self.aux_outputs[size][: flat.num_tokens]
        return self.outputs[size][: flat.num_tokens]
