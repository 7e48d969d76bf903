"""Async scheduling (EngineConfig.async_scheduling): step N + 1 is scheduled and launched, its newest input ids fed
from step N's samples on the device, before step N's results are read back. Every request's tokens, logprobs,
text, finish reason and prompt logprobs must be bitwise what the synchronous engine gives, under every feature
that meets the overlap; and the overlap must really happen."""

import random
import struct
from pathlib import Path

import pytest
import torch
from tiny_models import TINY_EOS, TINY_VOCAB

from lockstep import LLM, SamplingParams, StructuredOutputsParams
from lockstep.config import EngineConfig
from lockstep.engine import llm_engine
from lockstep.engine.llm_engine import LLMEngine
from lockstep.engine.scheduler import Scheduler
from lockstep.engine.sequence import PENDING_TOKEN, Sequence
from lockstep.engine.token_feed import FedRows
from lockstep.layers.sampler import PendingSample


def bits(out) -> tuple:
    """Everything a request reports, floats as their bit patterns."""
    pack = lambda x: struct.pack("<d", x)
    tops = tuple(tuple((t, pack(v.logprob), v.rank) for t, v in d.items()) for d in out.outputs[0].logprobs or ())
    prompt = tuple(
        None if d is None else tuple((t, pack(v.logprob)) for t, v in d.items()) for d in out.prompt_logprobs or ()
    )
    o = out.outputs[0]
    return tuple(o.token_ids), tuple(pack(x) for x in o.token_logprobs), tops, o.finish_reason, o.text, prompt


def workload(seed: int, n: int, synchronous_kinds: bool = True) -> tuple[list[list[int]], list[SamplingParams]]:
    """Requests mixing every feature that meets the overlap; a shared prefix for prefix-cache hits. Without
    ``synchronous_kinds``, none with penalties or a grammar (after whose samples the engine reads back first)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(TINY_VOCAB - 2) for _ in range(9)]
    kinds = [
        dict(temperature=0),
        dict(temperature=0.8, logprobs=2),
        dict(temperature=1.0, top_k=10, top_p=0.9),
        dict(temperature=0.7, stop_token_ids=[3, 4, 5, 6]),
        dict(temperature=0, stop=["a", "b"], include_stop_str_in_output=True),
        dict(temperature=0.9, stop=["c"], min_tokens=3),
        dict(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1),
        dict(temperature=0.6, n=2),
        dict(temperature=0.7, prompt_logprobs=2),
        dict(temperature=0, logit_bias={7: 5.0, 8: -3.0}, min_tokens=2),
        dict(temperature=1.0, structured_outputs=StructuredOutputsParams(regex=r"[a-f]{2,5}-[0-9]{3}")),
        dict(temperature=0.9, min_p=0.05),
        dict(temperature=0, ignore_eos=True),
    ]
    if not synchronous_kinds:
        kinds = [k for k in kinds if "structured_outputs" not in k and "repetition_penalty" not in k]
    prompts, params = [], []
    for i in range(n):
        body = [rng.randrange(TINY_VOCAB - 2) for _ in range(rng.randrange(1, 26))]
        prompts.append(prefix + body if i % 3 == 0 else body)
        kw = dict(kinds[i % len(kinds)])
        kw.setdefault("max_tokens", rng.randrange(kw.get("min_tokens", 0) + 1, 24))
        params.append(SamplingParams(seed=rng.randrange(1 << 20), **kw))
    return prompts, params


def make_llm(folder: Path, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("num_kv_blocks", 512)
    return LLM(str(folder), seed=0, **kwargs)


CASES = {
    "default": ({}, 26, 1),
    "overlap_only": ({"max_num_batched_tokens": 24, "max_num_seqs": 24}, 22, 6),
    "chunked_prefill": ({"max_num_batched_tokens": 16, "max_num_seqs": 16}, 26, 2),
    "preemption": ({"num_kv_blocks": 14, "max_num_batched_tokens": 48, "max_num_seqs": 48}, 20, 3),
    "no_prefix_caching": ({"enable_prefix_caching": False, "max_num_seqs": 5}, 14, 4),
}


def preemptions(llm: LLM) -> list[str]:
    """Watch the scheduler's preemptions (a list filled as steps run)."""
    seen: list[str] = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        batch = schedule()
        seen.extend(s.request_id for s in batch.preempted)
        return batch

    llm.engine.scheduler.schedule = spy
    return seen


@pytest.mark.parametrize("case", list(CASES))
def test_async_scheduling_gives_the_synchronous_bits(
    tiny_model_dir: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kwargs, n, seed = CASES[case]
    prompts, params = workload(seed, n, synchronous_kinds=case != "overlap_only")
    sync = make_llm(tiny_model_dir, **kwargs)
    overlapped = make_llm(tiny_model_dir, async_scheduling=True, **kwargs)
    seen_sync, seen_async = preemptions(sync), preemptions(overlapped)
    launches, ahead = [], []
    launch = overlapped.engine.runner.launch
    overlapped.engine.runner.launch = lambda batch, feed=None: launches.append(feed is not None) or launch(batch, feed)
    may_run_ahead = llm_engine._may_run_ahead
    monkeypatch.setattr(llm_engine, "_may_run_ahead", lambda batch: ahead.append(may_run_ahead(batch)) or ahead[-1])
    hits = []
    blocks = overlapped.engine.scheduler.block_manager
    allocate = blocks.allocate
    blocks.allocate = lambda seq: allocate(seq) or hits.append(seq.num_cached_tokens)
    reference = [bits(o) for o in sync.generate(prompts, params, use_tqdm=False)]
    assert [bits(o) for o in overlapped.generate(prompts, params, use_tqdm=False)] == reference
    if kwargs.get("enable_prefix_caching", True):
        assert any(hits), "no prefix-cache hit"
    # Steps ran ahead, fed from the device; without penalties and grammars every step did (with them, a step
    # where one samples is read back before the next is scheduled).
    assert sum(launches) > (len(launches) // 2 if case == "overlap_only" else 0), launches
    assert all(ahead) if case == "overlap_only" else not all(ahead)
    if case == "preemption":
        assert seen_sync and seen_async, "the cache was big enough: nothing was preempted"
    finishes = {r[3] for r in reference}
    assert {"stop", "length"} <= finishes
    overlapped.engine.scheduler.check_integrity()
    assert overlapped.engine.scheduler.block_manager.num_free_blocks == overlapped.engine.config.num_kv_blocks


def test_async_scheduling_under_tensor_parallelism(tiny_model_dir: Path) -> None:
    # TP 2 (a gloo worker process): each fed step's control message names its fed rows and rank 0 broadcasts the
    # previous step's samples, so the worker's rows get the same ids as rank 0's: the bits of TP 1 with the tree.
    kwargs, n, seed = CASES["overlap_only"]
    prompts, params = workload(seed, n, synchronous_kinds=False)
    reference = [bits(o) for o in make_llm(tiny_model_dir, tp_invariant=True, **kwargs).generate(prompts, params)]
    with make_llm(tiny_model_dir, tensor_parallel_size=2, async_scheduling=True, **kwargs) as llm:
        launches = []
        launch = llm.engine.runner.launch
        llm.engine.runner.launch = lambda batch, feed=None: launches.append(feed is not None) or launch(batch, feed)
        assert [bits(o) for o in llm.generate(prompts, params, use_tqdm=False)] == reference
    assert sum(launches) > len(launches) // 2, launches


def test_the_harness_sees_a_wrong_fed_token(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Negative control: the overlapped steps really take their newest input ids from the fed tokens, and the
    # comparison above would see it if a fed row got another token.
    prompts, params = workload(5, 8)
    reference = [bits(o) for o in make_llm(tiny_model_dir).generate(prompts, params, use_tqdm=False)]
    write = FedRows.write

    def shifted(self: FedRows, input_ids) -> None:
        write(self, input_ids)
        input_ids[self.dst] = (input_ids[self.dst] + 1) % TINY_VOCAB

    monkeypatch.setattr(FedRows, "write", shifted)
    outs = make_llm(tiny_model_dir, async_scheduling=True).generate(prompts, params, use_tqdm=False)
    assert [bits(o) for o in outs] != reference


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> tuple[LLMEngine, LLMEngine]:
    make = lambda on: LLMEngine(
        EngineConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=256, seed=0, async_scheduling=on)
    )
    return make(False), make(True)


def test_the_next_step_is_scheduled_before_the_previous_one_is_read(
    engines: tuple[LLMEngine, LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engines[1]
    events: list[str] = []
    schedule, result, launch = engine.scheduler.schedule, PendingSample.result, engine.runner.launch

    def logged_schedule():
        events.append("schedule")
        return schedule()

    def logged_result(self):
        events.append("read")
        return result(self)

    def logged_launch(batch, feed=None):
        events.append("launch fed" if feed is not None else "launch")
        return launch(batch, feed)

    monkeypatch.setattr(engine.scheduler, "schedule", logged_schedule)
    monkeypatch.setattr(engine.runner, "launch", logged_launch)
    monkeypatch.setattr(PendingSample, "result", logged_result)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.add_request("b", [4, 5], SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True))
    calls = []
    while engine.has_unfinished_requests():
        events.clear()
        outputs = engine.step()
        calls.append((list(events), [len(o.outputs[0].token_ids) for o in outputs]))
    # The first call launches the prefill and reports nothing; each later one schedules and launches the next
    # decode (fed from the device) before it reads the previous step; the last reads the final step (max_tokens
    # ended both: nothing is scheduled ahead of it).
    assert calls[0] == (["schedule", "launch"], [])
    for events_, _ in calls[1:-1]:
        assert events_ == ["schedule", "launch fed", "read"]
    assert calls[-1][0] == ["schedule", "read"]
    assert [lengths for _, lengths in calls[1:]] == [[1, 1], [2, 2], [3, 3], [4, 4]]


def test_penalties_and_grammars_read_their_step_first(
    engines: tuple[LLMEngine, LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Their next step's sampling needs the newest token on the host: no overlap after a step where they sample.
    engine = engines[1]
    events: list[str] = []
    schedule, result = engine.scheduler.schedule, PendingSample.result
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: events.append("schedule") or schedule())
    monkeypatch.setattr(PendingSample, "result", lambda self: events.append("read") or result(self))
    engine.add_request("p", [1, 2, 3], SamplingParams(temperature=0.8, seed=2, max_tokens=3, presence_penalty=0.5))
    while engine.has_unfinished_requests():
        engine.step()
    # Each call reads the step in flight before it schedules the next one.
    assert len(events) > 4 and set(events[0::2]) == {"schedule"} and set(events[1::2]) == {"read"}


def _generate(engine: LLMEngine, requests: dict, abort_at: dict[str, int]) -> dict:
    """Run ``requests``; abort each request of ``abort_at`` once it has reported that many tokens."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
            elif len(out.outputs[0].token_ids) >= abort_at.get(out.request_id, 1 << 30):
                done[out.request_id] = engine.abort(out.request_id)
    return {rid: bits(o) for rid, o in done.items()}


def test_aborts_report_what_was_reported_and_leave_the_others_alone(engines: tuple[LLMEngine, LLMEngine]) -> None:
    requests = {
        f"r{i}": ([i + 1, i + 2, i + 3], SamplingParams(temperature=0.7 * (i % 2), seed=i, max_tokens=9))
        for i in range(6)
    }
    abort_at = {"r1": 2, "r4": 5}
    sync, overlapped = (_generate(e, requests, abort_at) for e in engines)
    assert overlapped == sync
    assert sync["r1"][3] == "abort" and len(sync["r1"][0]) == 2
    for engine in engines:
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_blocks


def test_a_request_failing_at_a_step_ahead_fails_alone(engines: tuple[LLMEngine, LLMEngine]) -> None:
    # Its sample turns out to be no token only when read back, after the next step (with its row) was launched.
    nan_row = SamplingParams(temperature=0.8, seed=1, max_tokens=6)
    nan_row.temperature = float("nan")  # past validation, as a bug would be: every score NaN
    requests = {
        "ok": ([1, 2, 3], SamplingParams(temperature=0.9, seed=5, max_tokens=6, ignore_eos=True, logprobs=1)),
        "bad": ([4, 5, 6], nan_row),
        "ok2": ([7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
    }
    sync, overlapped = (_generate(e, requests, {}) for e in engines)
    assert overlapped == sync
    assert sync["bad"][3] == "abort" and sync["bad"][0] == () and sync["ok"][3] == "length"


def test_a_request_id_reused_after_its_end_is_a_new_request(engines: tuple[LLMEngine, LLMEngine]) -> None:
    # The in-flight step of a finished request is discarded even when its id is already back in use.
    engine = engines[1]
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=list(range(TINY_VOCAB)))
    engine.add_request("x", [1, 2, 3], params)
    first = []
    while not first:
        first = [o for o in engine.step() if o.finished]
    assert first[0].outputs[0].finish_reason == "stop" and len(first[0].outputs[0].token_ids) == 1
    engine.add_request("x", [4, 5, 6], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    second = _generate(engine, {}, {})
    ref = _generate(engines[0], {"x": ([4, 5, 6], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))}, {})
    assert second == ref


def test_scheduler_advance_holds_pending_tokens(tiny_model_dir: Path) -> None:
    config = EngineConfig(
        model=str(tiny_model_dir),
        block_size=4,
        num_kv_blocks=16,
        max_model_len=64,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    sched = Scheduler(config, eos_token_ids=(TINY_EOS,))
    sched.add(a := Sequence("a", [1, 2, 3], SamplingParams(max_tokens=5), block_size=4))
    sched.add(b := Sequence("b", [1, 2], SamplingParams(max_tokens=1), block_size=4))
    batch = sched.schedule()
    assumed = sched.advance(batch)
    # "b" ends after this token whatever it is: it gets no pending token, so no step ahead.
    assert assumed == {a: 0} and a.token_ids[-1] == PENDING_TOKEN and a.has_pending_token
    assert b.num_pending_tokens == 0 and not b.has_pending_token
    ahead = sched.schedule()
    assert [(e.seq.request_id, e.start, e.num_new_tokens) for e in ahead.entries] == [("a", 3, 1)]
    assert ahead.entries[0].token_ids == [PENDING_TOKEN]
    finished = sched.apply_tokens(batch, [9, 10])
    assert a.token_ids == [1, 2, 3, 9] and b.token_ids == [1, 2, 10] and finished == [b]
    assert b.finish_reason.value == "length"


def test_config_checks_async_scheduling() -> None:
    with pytest.raises(ValueError, match="async_scheduling must be a bool"):
        EngineConfig(async_scheduling=1)


def test_async_scheduling_default_follows_the_device(monkeypatch) -> None:
    # None: on CUDA (any TP size), off on the CPU; an explicit choice stays.
    assert EngineConfig(device="cpu").async_scheduling is False
    assert EngineConfig(device="cpu", tensor_parallel_size=2).async_scheduling is False
    assert EngineConfig(device="cpu", async_scheduling=True).async_scheduling is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig().async_scheduling is True
    assert EngineConfig(tensor_parallel_size=2).async_scheduling is True
    assert EngineConfig(async_scheduling=False).async_scheduling is False
