import hashlib
import random
import struct
import weakref

import pytest

from lockstep.config import EngineConfig
from lockstep.engine import FinishReason, ScheduledBatch, Scheduler, Sequence, SequenceStatus, TokenLogprobs
from lockstep.sampling_params import SamplingParams

BS = 4
EOS = 0
VOCAB = 50


def make_scheduler(**overrides) -> Scheduler:
    kwargs = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=BS, num_kv_blocks=64)
    kwargs.update(overrides)
    return Scheduler(EngineConfig(**kwargs), eos_token_ids=[EOS])


def make_seq(rid: str, prompt: list[int], max_tokens: int = 8, **params) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), block_size=BS)


def next_token(context: list[int]) -> int:
    """The fake model's choice: a pure function of the whole context, like a real one."""
    digest = hashlib.blake2b(struct.pack(f"<{len(context)}q", *context), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


class FakeModel:
    """Simulates the paged KV cache: each computed position writes a fingerprint (its whole prefix) into its
    slot, and every position a sequence attends to must hold the right one. Catches wrong block tables, prefix
    hits on the wrong blocks, writes into shared blocks and lost state after preemption."""

    def __init__(self, sched: Scheduler) -> None:
        self.bs = sched.config.block_size
        self.kv: list[tuple[int, ...] | None] = [None] * (sched.config.num_kv_blocks * self.bs)

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def step(self, batch: ScheduledBatch) -> list[int]:
        for e in batch.entries:
            for pos in range(e.start, e.end):
                self.kv[self._slot(e.seq, pos)] = tuple(e.seq.token_ids[: pos + 1])
        sampled = []
        for e in batch.entries:
            for pos in range(e.end):
                assert self.kv[self._slot(e.seq, pos)] == tuple(e.seq.token_ids[: pos + 1]), (e, pos)
            if e.sample:
                sampled.append(next_token(e.seq.token_ids[: e.end]))
        return sampled


_models: "weakref.WeakKeyDictionary[Scheduler, FakeModel]" = weakref.WeakKeyDictionary()


def model_of(sched: Scheduler) -> FakeModel:
    """The one FakeModel (KV cache) of a scheduler, shared by every step of a test."""
    if sched not in _models:
        _models[sched] = FakeModel(sched)
    return _models[sched]


def run(sched: Scheduler, log: list | None = None, max_steps: int = 10_000) -> list[Sequence]:
    """Drive the scheduler to completion, checking the step invariants; returns sequences in finish order."""
    model = model_of(sched)
    finished = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished
        batch = sched.schedule()
        assert batch, "no progress with unfinished requests"
        assert batch.num_tokens <= sched.config.max_num_batched_tokens
        assert len(batch) <= sched.config.max_num_seqs
        assert len(sched.running) <= sched.config.max_num_seqs
        rids = [e.seq.request_id for e in batch.entries]
        assert len(rids) == len(set(rids))
        if log is not None:
            log.append(
                (
                    [(e.seq.request_id, e.start, e.num_new_tokens, e.sample) for e in batch.entries],
                    [s.request_id for s in batch.preempted],
                )
            )
        finished += sched.postprocess(batch, model.step(batch))
        sched.check_integrity()
    raise AssertionError("did not finish")


def test_fake_model_sees_bad_bookkeeping():
    """Negative control for the harness: a wrong block table, or a token sampled mid-prompt, is noticed."""
    sched = make_scheduler()
    sched.add(a := make_seq("a", list(range(1, 10))))
    model = model_of(sched)
    sched.postprocess(batch := sched.schedule(), model.step(batch))
    batch = sched.schedule()
    a.block_table[0], a.block_table[1] = a.block_table[1], a.block_table[0]
    with pytest.raises(AssertionError):
        model.step(batch)

    early = make_scheduler(max_num_batched_tokens=8)
    early.add(make_seq("b", list(range(1, 14)), max_tokens=3))
    reference = reference_output(list(range(1, 14)), 3)
    batch = early.schedule()
    assert not batch.entries[0].sample
    # A scheduler that sampled here would compute the next token from a 9-token context.
    assert next_token(list(range(1, 9))) != reference[0]


def workload(n: int = 24, seed: int = 0) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB) for _ in range(10)]  # a common system prompt: prefix-cache hits
    reqs = []
    for i in range(n):
        own = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
        prompt = shared + own if i % 3 == 0 else own
        reqs.append((f"r{i}", prompt, rng.randrange(1, 20)))
    return reqs


def results(seqs: list[Sequence]) -> dict[str, tuple[list[int], FinishReason]]:
    return {s.request_id: (s.output_token_ids, s.finish_reason) for s in seqs}


def test_scheduler_needs_a_sized_cache():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        Scheduler(EngineConfig())


def test_empty_schedule():
    sched = make_scheduler()
    batch = sched.schedule()
    assert not batch and batch.num_tokens == 0 and batch.preempted == []


def test_chunked_prefill_splits_prompt_and_only_last_chunk_samples():
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    seq = make_seq("a", list(range(1, 22)), max_tokens=3)  # 21 tokens
    sched.add(seq)
    log = []
    run(sched, log)
    entries = [step[0] for step in log]
    assert entries == [
        [("a", 0, 8, False)],
        [("a", 8, 8, False)],
        [("a", 16, 5, True)],
        [("a", 21, 1, True)],
        [("a", 22, 1, True)],
    ]
    assert seq.num_output_tokens == 3 and seq.finish_reason is FinishReason.LENGTH


def test_chunk_boundary_produces_no_token():
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    seq = make_seq("a", list(range(1, 13)))
    sched.add(seq)
    model = model_of(sched)
    batch = sched.schedule()
    assert [(e.start, e.num_new_tokens, e.sample) for e in batch.entries] == [(0, 8, False)]
    assert model.step(batch) == []
    assert sched.postprocess(batch, []) == []
    assert seq.num_output_tokens == 0 and seq.num_computed_tokens == 8
    batch = sched.schedule()
    assert [(e.start, e.num_new_tokens, e.sample) for e in batch.entries] == [(8, 4, True)]
    assert batch.entries[0].token_ids == list(range(9, 13))
    sched.postprocess(batch, model.step(batch))
    assert seq.num_output_tokens == 1


def test_one_partial_prefill_at_most_and_decodes_first():
    """FIFO admission under a token budget leaves at most one sequence part-way through its prompt, the last
    entry; every running sequence ready to decode gets its token, at the front of the batch, every step."""
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=9, num_kv_blocks=20)
    for rid, prompt, max_tokens in workload(16, seed=3):
        sched.add(make_seq(rid, prompt, max_tokens))
    model = model_of(sched)
    first = True
    saw_partial = saw_preemption = False
    while sched.has_unfinished():
        ready = [s for s in sched.running if s.num_pending_tokens == 1]
        batch = sched.schedule()
        if first:
            assert [(e.seq.request_id, e.start, e.num_new_tokens, e.sample) for e in batch.entries] == [
                ("r0", 0, 9, False)
            ]
            first = False
        ready = [s for s in ready if s not in batch.preempted]
        assert [e.seq for e in batch.entries[: len(ready)]] == ready
        partial = [i for i, e in enumerate(batch.entries) if not e.sample]
        assert partial in ([], [len(batch) - 1])
        saw_partial |= bool(partial) and len(batch) > 1
        saw_preemption |= bool(batch.preempted)
        sched.postprocess(batch, model.step(batch))
        sched.check_integrity()
    assert saw_partial and saw_preemption


@pytest.mark.parametrize(
    "overrides",
    [
        dict(max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64),
        dict(max_num_seqs=8, max_num_batched_tokens=8, num_kv_blocks=32),
        dict(max_num_seqs=3, max_num_batched_tokens=5, num_kv_blocks=14),
        dict(max_num_seqs=16, max_num_batched_tokens=64, num_kv_blocks=14),
        dict(max_num_seqs=16, max_num_batched_tokens=64, num_kv_blocks=14, enable_prefix_caching=False),
        dict(max_num_seqs=1, max_num_batched_tokens=1, num_kv_blocks=14),
    ],
)
def test_outputs_do_not_depend_on_batching(overrides):
    """Budget, chunking, preemption and prefix hits move work around but never change a request's tokens."""
    reqs = workload()
    reference = {}
    for rid, prompt, max_tokens in reqs:
        alone = make_scheduler()
        alone.add(make_seq(rid, prompt, max_tokens))
        reference.update(results(run(alone)))

    sched = make_scheduler(**overrides)
    for rid, prompt, max_tokens in reqs:
        sched.add(make_seq(rid, prompt, max_tokens))
    log = []
    assert results(run(sched, log)) == reference
    assert sched.block_manager.num_free_blocks == sched.config.num_kv_blocks
    if overrides["num_kv_blocks"] == 14 and overrides["max_num_seqs"] > 1:
        assert any(preempted for _, preempted in log), "the harness should see preemptions here"


def test_deterministic_batches():
    def batches(seed: int) -> list:
        sched = make_scheduler(max_num_seqs=5, max_num_batched_tokens=12, num_kv_blocks=16)
        log = []
        for rid, prompt, max_tokens in workload(16, seed):
            sched.add(make_seq(rid, prompt, max_tokens))
        run(sched, log)
        return log

    first = batches(1)
    assert first == batches(1)
    assert first != batches(2)  # control: the log does reflect the workload
    assert any(preempted for _, preempted in first)


def test_max_num_seqs_and_fifo_admission():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add(make_seq(f"r{i}", [1 + i] * 3, max_tokens=2 + 3 * (i == 0)))
    log = []
    run(sched, log)
    admitted = []
    for entries, _ in log:
        assert len(entries) <= 2
        admitted += [rid for rid, start, _, _ in entries if start == 0]
    assert admitted == ["r0", "r1", "r2", "r3", "r4"]
    assert log[0][0] == [("r0", 0, 3, True), ("r1", 0, 3, True)]
    assert [rid for rid, *_ in log[2][0]] == ["r0", "r2"]  # r1 finished after 2 tokens; r2 takes its place


def test_head_of_queue_is_not_overtaken():
    sched = make_scheduler(num_kv_blocks=6, max_num_batched_tokens=64)
    sched.add(make_seq("hog", [1] * 12, max_tokens=4))  # 3 blocks, 4 by the end
    sched.add(make_seq("big", [2] * 16, max_tokens=1))  # 4 blocks: must wait for hog
    sched.add(make_seq("small", [3] * 2, max_tokens=1))  # would fit, but arrived after big
    batch = sched.schedule()
    assert [e.seq.request_id for e in batch.entries] == ["hog"]
    assert [s.request_id for s in sched.waiting] == ["big", "small"]
    sched.postprocess(batch, model_of(sched).step(batch))
    log = []
    run(sched, log)
    order = [rid for entries, _ in log for rid, start, _, _ in entries if start == 0]
    assert order == ["big", "small"]


def test_preemption_takes_latest_arrival_and_requeues_it_first():
    sched = make_scheduler(num_kv_blocks=4)
    seqs = [make_seq(rid, [i + 1] * 4, max_tokens=6) for i, rid in enumerate("abc")]
    for s in seqs:
        sched.add(s)
    model = model_of(sched)
    batch = sched.schedule()  # a, b, c: one block each, one left
    sched.postprocess(batch, model.step(batch))
    sched.add(make_seq("d", [9, 9], max_tokens=2))
    a, b, c = seqs
    assert all(s.num_tokens == 5 for s in seqs)  # each needs a second block to decode

    batch = sched.schedule()
    assert batch.preempted == [c]
    assert [e.seq for e in batch.entries] == [a, b]
    assert [s.request_id for s in sched.waiting] == ["c", "d"]
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert c.num_output_tokens == 1 and c.num_preemptions == 1  # outputs survive preemption
    sched.check_integrity()
    sched.postprocess(batch, model.step(batch))

    # Readmitted ahead of d, c recomputes prompt + output as one prefill that samples its next token.
    steps = []
    while c.status is not SequenceStatus.RUNNING:
        batch = sched.schedule()
        steps.append(batch)
        sched.postprocess(batch, model.step(batch))
        sched.check_integrity()
    entry = next(e for e in steps[-1].entries if e.seq is c)
    assert (entry.start, entry.end, entry.sample) == (c.num_cached_tokens, 5, True)
    d = sched.get("d")
    assert d.status is SequenceStatus.WAITING or sched.running.index(d) > sched.running.index(c)
    run(sched)
    assert c.output_token_ids == reference_output([3] * 4, 6)


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    sched = make_scheduler()
    seq = make_seq("ref", prompt, max_tokens)
    sched.add(seq)
    run(sched)
    return seq.output_token_ids


def test_newest_sequence_preempts_itself():
    sched = make_scheduler(num_kv_blocks=3)
    old = make_seq("old", [1] * 7, max_tokens=3)  # 2 blocks; its next token still fits block 2
    new = make_seq("new", [2] * 4, max_tokens=3)  # 1 block; its next token needs a second
    sched.add(old)
    sched.add(new)
    model = model_of(sched)
    batch = sched.schedule()
    sched.postprocess(batch, model.step(batch))
    batch = sched.schedule()
    assert batch.preempted == [new]
    assert [(e.seq, e.num_new_tokens) for e in batch.entries] == [(old, 1)]
    assert list(sched.waiting) == [new]
    sched.postprocess(batch, model.step(batch))
    run(sched)
    assert new.output_token_ids == reference_output([2] * 4, 3)


def test_abort_frees_blocks():
    sched = make_scheduler(num_kv_blocks=16)
    a, b, c = (make_seq(r, [i + 1] * 9) for i, r in enumerate("abc"))
    for s in (a, b, c):
        sched.add(s)
    model = model_of(sched)
    sched.postprocess(batch := sched.schedule(), model.step(batch))
    free_before = sched.block_manager.num_free_blocks
    assert sched.abort("b") is b
    assert b.status is SequenceStatus.FINISHED and b.finish_reason is FinishReason.ABORT
    assert b.block_table == [] and sched.block_manager.num_free_blocks == free_before + 3
    assert sched.abort("b") is None and sched.abort("nope") is None
    sched.check_integrity()

    # Aborted between schedule and postprocess: the result is dropped.
    batch = sched.schedule()
    sampled = model.step(batch)
    assert sched.abort("a") is a
    sched.postprocess(batch, sampled)
    assert a.num_output_tokens == 1
    sched.check_integrity()

    sched.add(d := make_seq("d", [4] * 3))
    assert sched.abort("d") is d and not sched.waiting
    run(sched)
    assert sched.block_manager.num_free_blocks == 16


def test_too_long_requests_are_rejected():
    sched = make_scheduler(num_kv_blocks=4, max_model_len=None)
    with pytest.raises(ValueError, match="needs 5 KV blocks of 4, the cache has 4"):
        sched.add(make_seq("p", [1] * 17, max_tokens=1))
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        sched.add(make_seq("g", [1] * 10, max_tokens=8))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(make_seq("e", []))
    assert not sched.has_unfinished()
    # The largest request that fits: 10 + 7 tokens, 16 of them with KV.
    sched.add(s := make_seq("ok", [1] * 10, max_tokens=7, ignore_eos=True))
    with pytest.raises(ValueError, match="already in the scheduler"):
        sched.add(make_seq("ok", [1]))
    run(sched)
    assert s.num_output_tokens == 7

    capped = make_scheduler(num_kv_blocks=4, max_model_len=12)
    with pytest.raises(ValueError, match="max_model_len=12"):
        capped.add(make_seq("m", [1] * 12))
    capped.add(s := make_seq("cap", [1] * 8, max_tokens=100, ignore_eos=True))
    run(capped)
    assert s.num_tokens == 12 and s.finish_reason is FinishReason.LENGTH


def test_stop_conditions():
    prompt = [3, 1, 1]
    free_run = reference_output(prompt, 30)
    assert EOS in free_run, "pick a prompt whose free run hits EOS"
    sched = make_scheduler()
    sched.add(eos := make_seq("eos", prompt, 30))
    sched.add(ign := make_seq("ign", prompt, 30, ignore_eos=True))
    stop_id = free_run[1]
    sched.add(tok := make_seq("tok", prompt, 30, stop_token_ids=[stop_id], ignore_eos=True))
    run(sched)
    assert eos.finish_reason is FinishReason.STOP and eos.output_token_ids[-1] == EOS
    assert eos.output_token_ids == free_run[: free_run.index(EOS) + 1]
    assert ign.finish_reason is FinishReason.LENGTH and ign.num_output_tokens == 30
    assert tok.finish_reason is FinishReason.STOP
    assert tok.output_token_ids == free_run[: free_run.index(stop_id) + 1]

    sched.add(s := make_seq("stopstr", prompt, 30))
    sched.postprocess(batch := sched.schedule(), model_of(sched).step(batch))
    assert sched.finish("stopstr", FinishReason.STOP) is s  # what the engine does on a stop string
    assert s.finish_reason is FinishReason.STOP and not sched.has_unfinished()


def test_prefix_hit_skips_cached_tokens():
    sched = make_scheduler()
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks
    sched.add(make_seq("a", prompt, max_tokens=4))
    run(sched)
    sched.add(b := make_seq("b", prompt + [20], max_tokens=4))
    batch = sched.schedule()
    assert b.num_cached_tokens == 12
    assert [(e.start, e.num_new_tokens) for e in batch.entries] == [(12, 3)]
    sched.postprocess(batch, model_of(sched).step(batch))  # FakeModel checks the hit blocks' contents
    run(sched)
    assert b.output_token_ids == reference_output(prompt + [20], 4)


def test_postprocess_checks_lengths_and_stores_logprobs():
    sched = make_scheduler()
    sched.add(s := make_seq("a", [1, 2, 3], logprobs=1))
    batch = sched.schedule()
    with pytest.raises(ValueError, match="0 token ids for 1 sampling entries"):
        sched.postprocess(batch, [])
    with pytest.raises(ValueError, match="1 logprobs for 1 sampling entries|2 logprobs"):
        sched.postprocess(batch, [5], [TokenLogprobs(-0.1)] * 2)
    lp = TokenLogprobs(-0.25, ((5, -0.25),))
    sched.postprocess(batch, [5], [lp])
    assert s.output_token_ids == [5] and s.output_logprobs == [-0.25] and s.output_top_logprobs == [lp]
    with pytest.raises(RuntimeError, match="schedule called twice"):
        sched.postprocess(batch, [5], [lp])
