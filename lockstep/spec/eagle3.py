"""The EAGLE-3 drafter: a one-layer head drafts from the target's own hidden states (``models/eagle3.py``).

The head at position ``p`` reads the embedding of the token at ``p + 1`` and a hidden state, and predicts the
token at ``p + 2``. For positions the target has computed, that hidden state is ``fc`` of the target's residual
streams at three layers (``LlamaModel.aux_layers``, kept by the target's runner only when this drafter is
configured); for the drafted positions after them, it is the head's own pre-norm output at the position before.

State per sequence, between calls, on lockstep's paged-cache machinery (a small KV cache of its own, one layer):

- ``observe(batch, aux)``, after every target step: the step's aux rows go through ``fc`` at once (one matmul for
  the step) and are kept as the sequence's *pending features*, by position. A verify chunk's rejected rows are
  kept too; the target computes those positions again in its next step, whose rows replace them.
- ``propose``: a sequence of ``n`` tokens has target features for every position up to ``n - 2`` (the newest
  token is not computed yet). The head's cache holds K/V computed from target features for the positions before
  ``next_position``; the call feeds the pending features of positions ``next_position .. n - 2`` (usually the
  previous verify step's accepted rows: one row after a rejection, ``a + 1`` after ``a`` acceptances) with the
  tokens after them, one forward for all sequences, then ``k - 1`` one-row steps, each fed the previous step's
  drafted token and pre-norm hidden state on the device. The tokens are read back once, at the end of the call.
  The K/V the drafted positions leave in the cache are past ``next_position`` and are written again before
  anything reads them, with the target's features (the rollback is a counter, as in ``draft_model.py``).

A prefix-cache hit means the target never computed the cached positions, so the head has no features for them:
the sequence's head cache then starts at the first position the target computed (``offset``; rotary positions
stay the real ones). The proposals are a little worse for it, never wrong: the verify step decides every token.

Memory: ``num_kv_blocks`` blocks of the target's block size, the target's count by default (one layer's K/V, a
small fraction of the target's cache); the pending features of a prompt live from its first prefill chunk to its
first draft (``[prompt_len, hidden]`` in the target dtype).
"""

import warnings
from dataclasses import dataclass, field

import torch

from lockstep.config import EngineConfig
from lockstep.engine.model_runner import _table_width
from lockstep.engine.scheduler import ScheduledBatch
from lockstep.layers.batch import FlatBatch, flatten_batch
from lockstep.layers.sampler import device_tensor
from lockstep.models.eagle3 import Eagle3Head, load_eagle3, resolve_head
from lockstep.spec.config import SpeculativeConfig
from lockstep.spec.drafter import DraftRequest
from lockstep.spec.eagle3_graphs import Eagle3Graphs


@dataclass
class _State:
    """One sequence's head cache and the target features it has not fed yet."""

    offset: int  # the first position the head's cache holds: cache index = position - offset
    num_cached: int = 0  # positions offset .. offset + num_cached - 1 hold K/V from target features
    block_table: list[int] = field(default_factory=list)
    pending: list[torch.Tensor] = field(default_factory=list)  # fc(aux) rows [*, H] from next_position on
    num_pending: int = 0

    @property
    def next_position(self) -> int:
        return self.offset + self.num_cached

    def truncate(self, rows: int) -> None:
        """Keep the first ``rows`` pending rows (the positions before a step's first row)."""
        kept, total = [], 0
        for chunk in self.pending:
            if total >= rows:
                break
            kept.append(chunk[: rows - total])
            total += kept[-1].shape[0]
        self.pending, self.num_pending = kept, total

    def take(self, rows: int) -> torch.Tensor:
        """The first ``rows`` pending rows, fed now. The rest stay pending: rejected verify rows, which the next
        step's ``observe`` replaces, or (async scheduling, drafting one token behind) the row of the step in flight,
        which the next call feeds."""
        whole = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        rest = whole[rows:]
        self.pending, self.num_pending = ([rest], rest.shape[0]) if rest.shape[0] else ([], 0)
        return whole[:rows]


@dataclass
class _Work:
    state: _State
    first: int  # the first position fed
    tokens: list[int]  # the token after each fed position
    features: torch.Tensor  # [len(tokens), H]
    num_tokens: int  # drafts wanted
    drafts: list[int] = field(default_factory=list)

    @property
    def last(self) -> int:
        return self.first + len(self.tokens) - 1


class Eagle3Drafter:
    """``Drafter`` with an EAGLE-3 head (``config.model``) for the target run by ``runner`` (its model, device,
    dtype and kernel set; the runner keeps the aux hidden states). ``num_kv_blocks``: the head cache's size in
    blocks of ``engine_config.block_size`` (None: the target's count)."""

    def __init__(
        self, config: SpeculativeConfig, engine_config: EngineConfig, runner, num_kv_blocks: int | None = None
    ) -> None:
        from lockstep.spec.draft_model import _target_path

        if not runner.model.language_model.aux_layers:  # set by the runner for an "eagle3" speculative_config
            raise ValueError("speculative_config: the target's runner keeps no aux hidden states for EAGLE-3")
        self.config = config
        self.block_size = engine_config.block_size
        self.max_model_len = runner.config.max_model_len
        target = runner.model
        path = resolve_head(config.model)
        self.head: Eagle3Head = load_eagle3(
            path, target, target.kernels, self.max_model_len, _target_path(engine_config)
        )
        self.device = target.device
        blocks = num_kv_blocks or runner.config.num_kv_blocks
        shape = self.head.kv_cache_shape(blocks, self.block_size)
        self.kv_caches = [tuple(torch.zeros(shape, dtype=target.dtype, device=self.device) for _ in "kv")]
        self.num_kv_blocks = blocks
        self._free: list[int] = list(range(blocks))[::-1]  # a stack: lowest ids first
        self._states: dict[int, _State] = {}  # seq_id -> state; lookup only, never iterated for order
        # CUDA graphs for the draft loop where the target's runner has them; not with sleep mode, which moves the
        # storages (the shared embedding's among them) that a graph would have captured.
        self.graphs: Eagle3Graphs | None = None
        self.graph_error: str | None = None  # why the capture failed, if it did (the loop then runs eagerly)
        if runner.graphs is not None and not runner.config.enable_sleep_mode:
            self._capture(runner.config.max_num_seqs)
        self.use_graphs = self.graphs is not None  # bench/eagle3_gpu.py turns them off to compare

    def _capture(self, max_num_seqs: int) -> None:
        graphs = self.make_graphs(max_num_seqs)
        try:
            graphs.capture()
        except Exception as e:  # a kernel that cannot be captured: the eager loop drafts the same tokens, slower
            graphs.release()
            self.graph_error = f"{type(e).__name__}: {e}"
            warnings.warn(f"EAGLE-3 head: no CUDA graphs, drafting eagerly: {self.graph_error}", stacklevel=2)
            return
        self.graphs = graphs

    def make_graphs(self, max_num_seqs: int) -> Eagle3Graphs:
        """The head's graph buffers for calls of up to ``max_num_seqs`` sequences and ``num_speculative_tokens``
        drafts (not captured yet: ``Eagle3Graphs.capture``)."""
        max_blocks = _table_width(-(-self.max_model_len // self.block_size))
        return Eagle3Graphs(self.head, self.kv_caches, max_num_seqs, self.config.num_speculative_tokens, max_blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    # -- the target's steps ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def observe(self, batch: ScheduledBatch, aux: torch.Tensor | None) -> None:
        """Keep the features of every text sequence's positions that ``batch`` computed (``aux``: the target
        runner's ``aux_hidden`` for the step, ``[num_tokens, 3H]`` in batch order)."""
        if aux is None or not batch.entries:
            return
        features = self.head.combine(aux)  # [num_tokens, H]
        whole = len(batch.entries) == 1
        row = 0
        for e in batch.entries:
            n = e.num_new_tokens
            rows = features[row : row + n] if not whole else features
            row += n
            if e.seq.mm is not None:
                continue
            seq_id = e.seq.arrival
            state = self._states.get(seq_id)
            if state is None or not state.next_position <= e.start <= state.next_position + state.num_pending:
                self.release(seq_id)  # new, recomputed from scratch, or after a gap: start over at this step
                state = self._states[seq_id] = _State(e.start)
            state.truncate(e.start - state.next_position)
            state.pending.append(rows if whole else rows.clone())  # a clone frees the step's other rows
            state.num_pending += n

    # -- the Drafter protocol ----------------------------------------------------------------------------------

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """The head's greedy drafts for each request, at most ``num_tokens`` (none where the target's features or
        the head's cache do not reach), in request order."""
        ids = [r.seq_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"propose: a seq_id appears twice among {ids}")
        work: list[tuple[int, _Work]] = []
        for i, r in enumerate(requests):
            w = self._prepare(r)
            if w is not None:
                work.append((i, w))
        try:
            if work:
                self._run([w for _, w in work])
        except BaseException:  # the sequences' cache contents are unknown: start over
            for r in requests:
                self.release(r.seq_id)
            raise
        out: list[list[int]] = [[] for _ in requests]
        for i, w in work:
            out[i] = w.drafts
        return out

    def release(self, seq_id: int) -> None:
        """Free ``seq_id``'s blocks and features (unknown ids are ignored)."""
        state = self._states.pop(seq_id, None)
        if state is not None:
            self._free.extend(reversed(state.block_table))

    # -- one call ----------------------------------------------------------------------------------------------

    def _prepare(self, r: DraftRequest) -> _Work | None:
        state = self._states.get(r.seq_id)
        n = len(r.token_ids)
        if state is None or r.num_tokens < 1:
            return None
        first, last = state.next_position, n - 2  # feed positions first..last (target features), then draft
        if last < first or state.num_pending < last - first + 1:
            return None
        # Cache slots for positions offset .. last + k - 1: the fed rows and the k - 1 drafted ones.
        have = len(state.block_table) + len(self._free)
        k = min(r.num_tokens, have * self.block_size - (last - state.offset))
        if k < 1:
            return None
        needed = -(-(last + k - state.offset) // self.block_size)
        while len(state.block_table) < needed:
            state.block_table.append(self._free.pop())
        features = state.take(last - first + 1)
        state.num_cached = last + 1 - state.offset
        return _Work(state, first, list(r.token_ids[first + 1 : n]), features, k)

    @torch.inference_mode()
    def _run(self, work: list[_Work]) -> None:
        """The fed rows of every sequence in one forward, then one-row draft steps, fed on the device: replayed from
        the head's CUDA graphs when there are some (``spec/eagle3_graphs.py``), else eagerly."""
        k = max(w.num_tokens for w in work)
        width = _table_width(max(len(w.state.block_table) for w in work))
        if self.use_graphs and self.graphs is not None and self.graphs.can_run(len(work), k, width):
            self._run_graphs(work, k, width)
        else:
            self._run_eager(work, k)

    def _first_batch(self, work: list[_Work]) -> FlatBatch:
        """The fed rows of every sequence: one chunk each, at its real positions (the cache index is the position
        less the sequence's ``offset``)."""
        flat = flatten_batch([(w.tokens, w.first - w.state.offset, w.state.block_table) for w in work], self.block_size)
        flat.positions = [p for w in work for p in range(w.first, w.last + 1)]
        return flat

    def _forward(self, flat: FlatBatch, hidden: torch.Tensor, input_ids: torch.Tensor | None = None):
        """The head over ``flat`` eagerly (``input_ids``: the step's tokens on the device, instead of ``flat``'s)."""
        width = _table_width(len(flat.block_tables[0]))  # as the target's runner: no compile per new width
        flat.block_tables = [t + [0] * (width - len(t)) for t in flat.block_tables]
        fed_ids, pos, attn = flat.to(self.device, self.kv_caches)
        return self.head(fed_ids if input_ids is None else input_ids, pos, hidden, attn)

    def _run_eager(self, work: list[_Work], k: int) -> None:
        head = self.head
        input_ids, hidden = None, torch.cat([w.features for w in work])
        active = work
        steps: list[tuple[list[_Work], torch.Tensor]] = []
        for j in range(k):
            if j == 0:
                flat = self._first_batch(work)
            else:
                keep = [i for i, w in enumerate(active) if w.num_tokens > j]
                if len(keep) < len(active):
                    sel = device_tensor(keep, torch.int64, self.device)
                    input_ids, hidden = input_ids[sel], hidden[sel]
                    active = [active[i] for i in keep]
                chunks = [([0], w.last + j - w.state.offset, w.state.block_table) for w in active]
                flat = flatten_batch(chunks, self.block_size)
                flat.positions = [w.last + j for w in active]
            starts = flat.query_start_loc
            normed, prenorm = self._forward(flat, hidden, input_ids)
            if j == 0:  # the last fed row of each sequence
                rows = device_tensor([s - 1 for s in starts[1:]], torch.int64, self.device)
                normed, prenorm = normed[rows], prenorm[rows]
            input_ids = head.to_target(head.compute_logits(normed).argmax(dim=-1))
            hidden = prenorm
            steps.append((active, input_ids))
        for ws, tokens in steps:  # one read-back: the first waits for the device
            for w, t in zip(ws, tokens.tolist(), strict=True):
                w.drafts.append(t)

    def _run_graphs(self, work: list[_Work], k: int, width: int) -> None:
        flat = self._first_batch(work)
        tables = [w.state.block_table + [0] * (width - len(w.state.block_table)) for w in work]
        bs = self.block_size
        steps = []
        for j in range(1, k):  # forward j: position last + j, fed draft j - 1; none for a sequence done drafting
            row = []
            for w in work:
                if w.num_tokens > j:
                    c, table = w.last + j - w.state.offset, w.state.block_table
                    row.append((w.last + j, table[c // bs] * bs + c % bs, c + 1))
                else:
                    row.append((0, -1, 1))
            steps.append(row)

        def eager_first():
            return self._forward(self._first_batch(work), torch.cat([w.features for w in work]))

        drafts = self.graphs.run(flat, tables, [w.features for w in work], steps, eager_first)
        for j, row in enumerate(drafts.tolist()):  # one read-back
            for w, t in zip(work, row, strict=True):
                if j < w.num_tokens:
                    w.drafts.append(t)
