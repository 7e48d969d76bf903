"""CUDA graphs for the EAGLE-3 head's draft loop (``spec/eagle3.py``): a ``propose`` call replays forwards captured
once per bucket instead of launching each forward's dozen small kernels from Python (at batch 1 the host, not the
device, sets the pace of the eager loop).

A call is one forward over the rows each sequence feeds (the target features not fed yet: usually the last verify
step's accepted rows), then k - 1 one-row forwards, each fed the previous draft and pre-norm hidden state, with an
argmax over the draft vocabulary after each. Three graphs per bucket, over static buffers:

- ``first`` (per bucket of fed rows): the head over the fed rows laid out as one-token rows (``expand_rows``, as the
  target's decode graphs run a short chunk), and each sequence's last row selected into the step buffers. It needs
  every sequence to feed at most ``MAX_GRAPH_CHUNK`` rows and all of them to fit the largest bucket; otherwise that
  forward runs eagerly (a prompt's first call) and the rest of the call still replays graphs.
- ``step`` (per bucket of sequences): the draft from each sequence's current row (LM head, argmax, ``d2t``), then
  the head at the next position, fed that draft.
- ``last`` (per bucket of sequences): the draft alone.

Between replays only copies run: each step's positions, slots and lengths (all known on the host before the call,
staged on the device in one transfer) into the step buffers, and each draft into the call's ``[k, num_seqs]``
output, which is read back once, as in the eager loop.

Why the drafts are the eager loop's bits: every kernel is row-invariant, so padding rows (slot -1: they write no
K/V, and attend over one position) and rows of sequences that want fewer drafts (kept in the batch, where the eager
loop drops them) change no other row; a row's matmul bits do not depend on M; a chunk's rows as one-token rows
attend over the same blocks in the same order (``expand_rows``); the attention grid depends on shapes only, so the
full-width block table (stale ids past a row's last block, never read) does not matter. The functions the graphs
capture (``first``, ``step``, ``last``) run uncaptured too, as they are: that is how the CPU tests check them
against the eager loop.
"""

from collections.abc import Callable

import torch

from lockstep.engine.cuda_graph import MAX_GRAPH_CHUNK, expand_rows, graph_batch_sizes
from lockstep.layers.batch import AttentionMetadata, FlatBatch
from lockstep.layers.sampler import device_tensor

# Per fed row (``first``): input id, position, slot, sequence length. Per sequence (``step``): position, slot, length.
_FED, _STEP = 4, 3
Rows = tuple[torch.Tensor, torch.Tensor]  # (normed, prenorm), each [rows, hidden]


def bucket(sizes: list[int], n: int) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``n`` rows, None when none does."""
    return next((s for s in sizes if s >= n), None)


class Eagle3Graphs:
    """The head's draft forwards over static buffers, captured per bucket (``capture``; without it, as on the CPU,
    ``run`` calls the same functions directly). ``max_num_seqs``: the most sequences a call drafts for;
    ``max_drafts``: the most drafts per sequence (k); ``max_blocks``: the width of a block-table row of the head's
    cache."""

    def __init__(self, head, kv_caches, max_num_seqs: int, max_drafts: int, max_blocks: int) -> None:
        self.head = head
        self.kv_caches = kv_caches
        self.max_drafts = max_drafts
        self.seq_sizes = graph_batch_sizes(max_num_seqs)
        self.row_sizes = graph_batch_sizes(max_num_seqs * min(max_drafts + 1, MAX_GRAPH_CHUNK))
        R, B = self.row_sizes[-1], self.seq_sizes[-1]
        H, device, dtype = head.config.layer.hidden_size, head.device, head.dtype
        ints = dict(dtype=torch.int64, device=device)
        self.fed = torch.zeros((_FED, R), **ints)  # ids, positions, slots, lengths of the fed rows
        self.fed[2].fill_(-1)  # rows a replay does not fill write nothing and attend over one position
        self.fed[3].fill_(1)
        self.fed_tables = torch.zeros((R, max_blocks), dtype=torch.int32, device=device)
        self.fed_hidden = torch.zeros((R, H), dtype=dtype, device=device)
        self.last_rows = torch.zeros(B, **ints)  # each sequence's last fed row (0 for the padding sequences)
        self.step_meta = torch.zeros((_STEP, B), **ints)  # positions, slots, lengths of the next one-row forward
        self.step_meta[1].fill_(-1)
        self.step_meta[2].fill_(1)
        self.tables = torch.zeros((B, max_blocks), dtype=torch.int32, device=device)
        self.ids = torch.zeros(B, **ints)  # the last draft of each sequence: the next forward's input
        self.normed = torch.zeros((B, H), dtype=dtype, device=device)  # what the LM head reads next
        self.hidden = torch.zeros((B, H), dtype=dtype, device=device)  # what the next forward takes
        self.drafts = torch.zeros((max_drafts, B), **ints)
        self.query_start_loc = torch.arange(max(R, B) + 1, dtype=torch.int32, device=device)  # one token a row
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}

    # -- what the graphs capture -----------------------------------------------------------------------------------

    def _attn(self, slots: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=lengths.to(torch.int32),
            query_start_loc=self.query_start_loc[: size + 1],
            kv_caches=self.kv_caches,
        )

    def first(self, size: int) -> None:
        """The head over the first ``size`` fed rows (``self.fed``, ``fed_tables``, ``fed_hidden``), each
        sequence's last row selected (``select``). Its outputs are not kept: a graph per bucket holds no rows."""
        ids, positions, slots, lengths = self.fed[:, :size]
        attn = self._attn(slots, self.fed_tables[:size], lengths, size)
        self.select(*self.head(ids, positions, self.fed_hidden[:size], attn))

    def select(self, normed: torch.Tensor, prenorm: torch.Tensor) -> None:
        """Rows ``last_rows`` of the fed rows' ``(normed, prenorm)`` into ``normed`` and ``hidden`` (every buffer row:
        the padding sequences take row 0)."""
        torch.index_select(normed, 0, self.last_rows, out=self.normed)
        torch.index_select(prenorm, 0, self.last_rows, out=self.hidden)

    def last(self, size: int) -> None:
        """Each row's draft from ``normed`` (the draft-vocabulary argmax, mapped to target ids) into ``ids``."""
        head = self.head
        self.ids[:size].copy_(head.to_target(head.compute_logits(self.normed[:size]).argmax(dim=-1)))

    def step(self, size: int) -> None:
        """``last``, then the head at the next position (``step_meta``) fed those drafts and ``hidden``; its rows
        into ``normed`` and ``hidden``."""
        self.last(size)
        positions, slots, lengths = self.step_meta[:, :size]
        attn = self._attn(slots, self.tables[:size], lengths, size)
        normed, prenorm = self.head(self.ids[:size], positions, self.hidden[:size], attn)
        self.normed[:size].copy_(normed)
        self.hidden[:size].copy_(prenorm)

    def _call(self, name: str, size: int) -> None:
        graph = self.graphs.get((name, size))
        if graph is None:  # not captured (the CPU): the function itself
            getattr(self, name)(size)
        else:
            graph.replay()

    # -- capture and run ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket of the three, largest first, in one memory pool; each runs once eagerly first, so
        every kernel is compiled before capture. The buffers' rows are padding rows meanwhile: nothing is written
        to the head's cache."""
        pool = None
        device = self.head.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for name, sizes in (("first", self.row_sizes), ("step", self.seq_sizes), ("last", self.seq_sizes)):
                for size in reversed(sizes):
                    getattr(self, name)(size)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        getattr(self, name)(size)
                    pool = graph.pool()
                    self.graphs[(name, size)] = graph
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)

    def release(self) -> None:
        """Free the graphs and their memory pool (later calls run the functions uncaptured)."""
        if self.graphs:
            torch.cuda.synchronize(self.head.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def can_run(self, num_seqs: int, num_drafts: int, table_width: int) -> bool:
        """Whether a call for ``num_seqs`` sequences of at most ``num_drafts`` drafts, whose block tables are
        ``table_width`` wide, fits the buffers."""
        fits = 0 < num_seqs <= self.seq_sizes[-1] and 0 < num_drafts <= self.max_drafts
        return fits and table_width <= self.tables.shape[1]

    def fits_first(self, flat: FlatBatch) -> bool:
        """Whether the fed rows ``flat`` replay ``first``: every sequence feeds at most ``MAX_GRAPH_CHUNK`` rows and
        they fit the largest bucket (else that forward runs eagerly)."""
        starts = flat.query_start_loc
        return flat.num_tokens <= self.row_sizes[-1] and all(
            starts[i + 1] - starts[i] <= MAX_GRAPH_CHUNK for i in range(len(starts) - 1)
        )

    @torch.inference_mode()
    def run(
        self,
        flat: FlatBatch,
        tables: list[list[int]],
        features: list[torch.Tensor],
        steps: list[list[tuple[int, int, int]]],
        eager_first: Callable[[], Rows],
    ) -> torch.Tensor:
        """One call's drafts ``[k, num_seqs]`` on the device (row j: every sequence's draft j; past a sequence's
        own count, values to ignore). ``flat``: the fed rows, one chunk per sequence (real positions); ``tables``:
        each sequence's whole block table (its drafts' blocks too), padded to one width; ``features``: the fed rows'
        hidden states, in order; ``steps``: for each later forward j = 1 .. k - 1, each sequence's ``(position, slot,
        length)`` (slot -1 and length 1 for a sequence with no draft j); ``eager_first``: the fed rows' forward,
        eagerly, for rows ``first`` cannot take."""
        b, k = len(flat.seq_lens), len(steps) + 1
        device = self.ids.device
        tables = device_tensor(tables, torch.int32, device)  # [b, width]
        width = tables.shape[1]
        last = [s - 1 for s in flat.query_start_loc[1:]]
        self.last_rows.copy_(device_tensor(last + [0] * (len(self.last_rows) - b), torch.int64, device))
        if self.fits_first(flat):
            n = flat.num_tokens
            size = bucket(self.row_sizes, n)
            lengths, owners = expand_rows(flat)
            values = [flat.input_ids, flat.positions, flat.slot_mapping, lengths, owners]
            rows = device_tensor(values, torch.int64, device)  # [5, n]: one transfer
            self.fed[:, :n].copy_(rows[:_FED])
            self.fed[2, n:size].fill_(-1)
            self.fed[3, n:size].fill_(1)
            self.fed_tables[:n, :width].copy_(tables.index_select(0, rows[_FED]))
            torch.cat(features, out=self.fed_hidden[:n])
            self._call("first", size)
        else:
            self.select(*eager_first())
        size = bucket(self.seq_sizes, b)
        self.tables[:b, :width].copy_(tables)
        pad = [(0, -1, 1)] * (size - b)
        if steps:
            staged = device_tensor([list(zip(*(row + pad), strict=True)) for row in steps], torch.int64, device)
        for j in range(k):
            if j < k - 1:
                self.step_meta[:, :size].copy_(staged[j])
                self._call("step", size)
            else:
                self._call("last", size)
            self.drafts[j, :size].copy_(self.ids[:size])
        return self.drafts[:k, :b]
