"""The EAGLE-3 head's draft-loop graphs (``spec/eagle3_graphs.py``) on the CPU, where nothing is captured: the
functions the graphs capture, called directly over their static buffers, draft exactly what the eager loop drafts,
call for call, through whole ``LLM.generate`` runs (fed rows as one-token rows and eagerly, padding rows, sequences
that want fewer drafts than others in the same call, prefix-cache offsets), and the output is plain decoding's.
Also: the buckets a call picks, the limits that send it to the eager loop, and that every call reuses the same
buffers. The control: a graph function that drops the hidden-state handoff drafts differently, so the comparison
sees a difference. The captured graphs themselves run on the H200 (``bench/eagle3_gpu.py``)."""

from pathlib import Path

import pytest
import test_eagle3
import torch
from test_eagle3 import GREEDY, PROMPTS, SEEDED, _bits, _llm, _recording

from lockstep.engine.cuda_graph import graph_batch_sizes
from lockstep.layers.batch import flatten_batch
from lockstep.spec.eagle3_graphs import Eagle3Graphs, bucket

target_dir, head_dir, bigram = test_eagle3.target_dir, test_eagle3.head_dir, test_eagle3.bigram
PARAMS = [GREEDY, SEEDED] * 2
MAX_SEQS = 4  # buckets 1, 2, 4 of sequences and 1 .. 16 of fed rows (k = 3): three prompts pad to four rows


def test_buckets_and_limits() -> None:
    assert [bucket([1, 2, 4, 8], n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    head = type("Head", (), {"config": None, "device": torch.device("cpu"), "dtype": torch.float32})()
    head.config = type("C", (), {"layer": type("L", (), {"hidden_size": 8})()})()
    g = Eagle3Graphs(head, [], max_num_seqs=3, max_drafts=3, max_blocks=32)
    assert g.seq_sizes == [1, 2, 3] and g.row_sizes == graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert Eagle3Graphs(head, [], 3, 9, 32).row_sizes[-1] == 24  # at most MAX_GRAPH_CHUNK rows per sequence
    assert g.can_run(3, 3, 32) and not g.can_run(4, 3, 32) and not g.can_run(3, 4, 32) and not g.can_run(3, 3, 48)
    assert not g.can_run(0, 1, 16)

    def flat(*lengths):
        return flatten_batch([(list(range(n)), 0, list(range(8))) for n in lengths], 4)

    assert g.fits_first(flat(8, 4)) and g.fits_first(flat(1, 1, 1)) and g.fits_first(flat(4, 4, 4))
    assert not g.fits_first(flat(9)) and not g.fits_first(flat(8, 5))  # a chunk of 9; 13 rows past the bucket


def _graphed(llm, monkeypatch) -> dict:
    """Give the engine's drafter graph buffers (uncaptured: the functions run directly) and count what they run."""
    drafter = llm.engine.drafter
    drafter.graphs, drafter.use_graphs = drafter.make_graphs(MAX_SEQS), True
    seen = {"runs": 0, "first": 0, "eager_first": 0, "fewer": 0, "padded": 0, "ptrs": set(), "outputs": set()}
    graphs = drafter.graphs
    run, fits = graphs.run, graphs.fits_first

    def counted_fits(flat):
        ok = fits(flat)
        seen["first" if ok else "eager_first"] += 1
        return ok

    def counted_run(flat, tables, features, steps, eager_first):
        seen["runs"] += 1
        b = len(flat.seq_lens)
        seen["padded"] += bucket(graphs.seq_sizes, b) > b
        seen["fewer"] += any(slot == -1 for row in steps for _, slot, _ in row)
        out = run(flat, tables, features, steps, eager_first)
        seen["outputs"].add(out.untyped_storage().data_ptr())
        seen["ptrs"].add(tuple(t.data_ptr() for t in (graphs.fed, graphs.normed, graphs.hidden, graphs.ids)))
        return out

    monkeypatch.setattr(graphs, "fits_first", counted_fits)
    monkeypatch.setattr(graphs, "run", counted_run)
    return seen


@pytest.mark.parametrize("head", ["random", "random-async", "agreeing"])
def test_the_graph_functions_draft_the_eager_loops_bits(request, monkeypatch, head: str) -> None:
    """The random head (every call one fed row a sequence, after a prompt's first call: its whole prompt, eagerly),
    under async scheduling too (calls one token behind), and the agreeing one (acceptance, so up to
    four fed rows; prefix-cache hits, so head caches at an offset)."""
    kw = {"async_scheduling": True} if head == "random-async" else {}
    if head.startswith("random"):
        target, folder, cache = request.getfixturevalue("target_dir"), request.getfixturevalue("head_dir"), False
    else:
        (target, folder), cache = request.getfixturevalue("bigram"), True  # acceptance: several fed rows a call
    runs = []
    for graphed in (False, True):
        llm = _llm(target, folder, k=3, max_num_seqs=MAX_SEQS, enable_prefix_caching=cache, **kw)
        seen = _graphed(llm, monkeypatch) if graphed else None
        calls = _recording(llm)
        bits = [_bits(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) for _ in range(2 if cache else 1)]
        runs.append((bits, calls))
    assert runs[1] == runs[0]  # the same proposals, call for call, and the same output
    plain = _bits(_llm(target, None, max_num_seqs=MAX_SEQS).generate(PROMPTS, PARAMS, use_tqdm=False))
    assert all(b == plain for b in runs[1][0])
    calls = runs[1][1]
    assert seen["runs"] >= 2 * len(PROMPTS) and len({tuple(p) for _, _, p in calls}) > 10  # real, varied drafts
    assert seen["first"] > 0 and seen["fewer"] > 0 and (seen["eager_first"] > 0 or kw), seen
    assert seen["padded"] > 0 or head == "agreeing", seen  # its rows finish together: no call of three
    assert len(seen["ptrs"]) == 1 and len(seen["outputs"]) == 1  # every call in the same buffers
    if head == "agreeing":
        drafter = llm.engine.drafter
        assert llm.engine.spec_stats.num_accepted_tokens > 0 and drafter.num_free_blocks == drafter.num_kv_blocks


def test_a_broken_handoff_in_the_graph_functions_is_seen(target_dir: Path, head_dir: Path, monkeypatch) -> None:
    """The control: ``step`` without its pre-norm handoff (each one-row forward fed a stale hidden state) drafts
    differently from the eager loop."""
    eager = _llm(target_dir, head_dir, k=3, max_num_seqs=MAX_SEQS, enable_prefix_caching=False)
    eager_calls = _recording(eager)
    eager.generate(PROMPTS, PARAMS, use_tqdm=False)
    broken = _llm(target_dir, head_dir, k=3, max_num_seqs=MAX_SEQS, enable_prefix_caching=False)
    _graphed(broken, monkeypatch)
    graphs = broken.engine.drafter.graphs
    copy = torch.Tensor.copy_

    def step(size):
        graphs.last(size)
        positions, slots, lengths = graphs.step_meta[:, :size]
        attn = graphs._attn(slots, graphs.tables[:size], lengths, size)
        normed, _ = graphs.head(graphs.ids[:size], positions, graphs.hidden[:size], attn)
        copy(graphs.normed[:size], normed)  # and no graphs.hidden update

    monkeypatch.setattr(graphs, "step", step)
    calls = _recording(broken)
    broken.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert len(eager_calls) >= 2 * len(PROMPTS)
    assert sum(a != b for a, b in zip(calls, eager_calls, strict=False)) >= len(PROMPTS)


def test_a_failed_capture_leaves_the_eager_loop_and_says_why(target_dir: Path, head_dir: Path, monkeypatch) -> None:
    llm = _llm(target_dir, head_dir, k=2, max_num_seqs=MAX_SEQS)
    drafter = llm.engine.drafter
    assert drafter.graphs is None and drafter.graph_error is None and not drafter.use_graphs  # the CPU: none

    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(Eagle3Graphs, "capture", fail)
    with pytest.warns(UserWarning, match="drafting eagerly: RuntimeError: operation not permitted"):
        drafter._capture(MAX_SEQS)
    assert drafter.graphs is None and "not permitted" in drafter.graph_error
    monkeypatch.setattr(Eagle3Graphs, "capture", lambda self: None)
    drafter._capture(MAX_SEQS)
    assert isinstance(drafter.graphs, Eagle3Graphs) and drafter.graphs.max_drafts == 2
