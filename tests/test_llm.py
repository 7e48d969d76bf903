"""LLM.generate end to end, and the invariance matrix: a request's token ids, logprobs and prompt logprobs are
the same bits alone, in any batch, under chunked prefill, after a prefix-cache hit, after preemption, and equal
to what a fresh prefill of the same sequence computes."""

import dataclasses
import random
import struct
from pathlib import Path

import pytest
from tiny_models import TINY_VOCAB

from lockstep.llm import LLM
from lockstep.outputs import CompletionOutput, Logprob, RequestOutput
from lockstep.sampling_params import SamplingParams, choice_seed

BLOCK = 4
# The requests the matrix follows: greedy, seeded temperature 0.8, seeded with top-k/top-p, greedy with a
# repetition penalty and a logit bias, seeded with min-p and presence/frequency penalties, and seeded with vLLM's
# allowed_token_ids and bad words of two and three tokens (which fire: they change its output); three of them ask
# for prompt logprobs (top 3, the prompt tokens' own only, top 5).
TARGET_PROMPTS = [
    [5, 17, 42, 8, 63, 21, 3, 77, 9, 50, 11, 2, 34],  # 13 tokens: three full blocks and a partial one
    [12, 40, 40, 7, 91, 33, 60, 1, 28],
    [70, 3, 3, 3, 19, 44, 80, 6, 25, 14, 57, 38, 29, 90, 4, 66, 22],
    [8, 8, 30, 52, 61, 7, 19, 33, 2, 91],
    [44, 2, 85, 13, 13, 71, 36, 5, 59, 20, 48],
    [33, 9, 71, 4, 58, 20, 47, 3, 3, 16],
]
TARGET_PARAMS = [
    SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True, prompt_logprobs=3),
    SamplingParams(temperature=0.8, seed=1234, max_tokens=10, logprobs=3, ignore_eos=True),
    SamplingParams(
        temperature=0.8, seed=99, top_k=20, top_p=0.9, max_tokens=10, logprobs=3, ignore_eos=True, prompt_logprobs=0
    ),
    SamplingParams(
        temperature=0, repetition_penalty=1.5, logit_bias={30: 1.5, 8: -2.0}, max_tokens=10, logprobs=3,
        ignore_eos=True,
    ),
    SamplingParams(
        temperature=0.8, seed=5, min_p=0.05, presence_penalty=0.8, frequency_penalty=0.5, max_tokens=10, logprobs=3,
        ignore_eos=True, prompt_logprobs=5,
    ),
    SamplingParams(
        temperature=0.8, seed=77, allowed_token_ids=list(range(20, 70)), bad_words=["TQ", "EQS"], max_tokens=10,
        logprobs=3, ignore_eos=True,
    ),
]  # fmt: skip


def dict_bits(dicts: list | None) -> tuple:
    """vLLM's logprob dicts (None entries kept), each Logprob as (token id, logprob bits, rank, decoded token)."""
    entry = lambda d: tuple((t, struct.pack("<d", v.logprob), v.rank, v.decoded_token) for t, v in d.items())
    return tuple(None if d is None else entry(d) for d in dicts or ())


def bits(out: RequestOutput) -> tuple:
    """Everything the contract covers, with floats as their exact bit patterns."""
    as_bits = lambda xs: tuple(struct.pack("<d", x) for x in xs)
    outputs = tuple(out.token_ids), as_bits(out.token_logprobs), dict_bits(out.logprobs), out.finish_reason
    return *outputs, dict_bits(out.prompt_logprobs)


def others(rng: random.Random, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """``n`` unrelated requests: random lengths, greedy or sampled, short or long."""
    prompts, params = [], []
    for _ in range(n):
        prompts.append([rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(1, 30))])
        temperature = rng.choice([0, 0.5, 1.0])
        params.append(
            SamplingParams(temperature=temperature, seed=rng.randrange(1000), max_tokens=rng.randrange(1, 12))
        )
    return prompts, params


def run_mixed(llm: LLM, num_others: int, seed: int) -> list[RequestOutput]:
    """Run the targets among ``num_others`` other requests at random positions; return the targets' outputs."""
    rng = random.Random(seed)
    prompts, params = others(rng, num_others)
    slots = sorted(rng.sample(range(num_others + len(TARGET_PROMPTS)), len(TARGET_PROMPTS)))
    for slot, prompt, p in zip(slots, TARGET_PROMPTS, TARGET_PARAMS, strict=True):
        prompts.insert(slot, prompt)
        params.insert(slot, p)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [outs[s] for s in slots]


def make_llm(folder: Path, **kwargs) -> LLM:
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("num_kv_blocks", 512)
    return LLM(str(folder), **kwargs)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[tuple]:
    """Each target run alone, on a fresh engine."""
    refs = []
    for prompt, p in zip(TARGET_PROMPTS, TARGET_PARAMS, strict=True):
        [out] = make_llm(tiny_model_dir).generate([prompt], p, use_tqdm=False)
        assert len(out.token_ids) == p.max_tokens and len(out.logprobs[0]) in (3, 4)
        if p.prompt_logprobs is not None:
            assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        refs.append(bits(out))
    # The harness can see sampling: the seeded and penalized targets did not just follow the greedy path.
    assert len({r[0] for r in refs}) == len(refs)
    return refs


# (engine settings, number of other requests, layout seed)
MATRIX = {
    "batch_of_3": ({}, 2, 0),
    "batch_of_34": ({}, 31, 1),
    "chunked_16": ({"max_num_batched_tokens": 16, "max_num_seqs": 16}, 8, 2),
    "chunked_64": ({"max_num_batched_tokens": 64, "max_num_seqs": 64}, 12, 3),
    "chunked_512": ({"max_num_batched_tokens": 512}, 16, 4),
    "max_num_seqs_1": ({"max_num_seqs": 1}, 3, 5),
    "max_num_seqs_3": ({"max_num_seqs": 3}, 8, 6),
    "no_prefix_caching": ({"enable_prefix_caching": False}, 6, 7),
    "async_scheduling": ({"async_scheduling": True}, 12, 9),
    "async_chunked_16": ({"async_scheduling": True, "max_num_batched_tokens": 16, "max_num_seqs": 16}, 8, 10),
}


@pytest.mark.parametrize("case", list(MATRIX))
def test_invariance_matrix(tiny_model_dir: Path, reference: list[tuple], case: str) -> None:
    kwargs, num_others, seed = MATRIX[case]
    outs = run_mixed(make_llm(tiny_model_dir, **kwargs), num_others, seed)
    assert [bits(o) for o in outs] == reference


def run_preempted(folder: Path) -> list:
    """The targets among 10 others on a cache too small for all of them at once: something is preempted."""
    llm = make_llm(folder, num_kv_blocks=12, max_num_batched_tokens=64, max_num_seqs=64)
    preempted = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        batch = schedule()
        preempted.extend(s.request_id for s in batch.preempted)
        return batch

    llm.engine.scheduler.schedule = spy
    outs = run_mixed(llm, 10, 8)
    assert preempted, "the cache was big enough: nothing was preempted"
    return outs


def run_after_prefix_warmup(folder: Path) -> tuple[list, dict]:
    """The targets among 5 others after a warm-up with their prompts (and more); the outputs, and each request's
    sequence by id (to read its prefix-cache hits)."""
    llm = make_llm(folder)
    warm = [p + [1, 2, 3] for p in TARGET_PROMPTS]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    cached = {}
    add = llm.engine.scheduler.add

    def spy_add(seq):
        add(seq)
        cached[seq.request_id] = seq

    llm.engine.scheduler.add = spy_add
    return run_mixed(llm, 5, 9), cached


def test_invariance_after_preemption(tiny_model_dir: Path, reference: list[tuple]) -> None:
    outs = run_preempted(tiny_model_dir)
    assert [bits(o) for o in outs] == reference


def test_invariance_after_prefix_cache_hit(tiny_model_dir: Path, reference: list[tuple]) -> None:
    outs, cached = run_after_prefix_warmup(tiny_model_dir)
    for out, p in zip(outs, TARGET_PARAMS, strict=True):
        if p.prompt_logprobs is None:
            assert cached[out.request_id].num_cached_tokens >= BLOCK * 2, "no prefix-cache hit"
        else:  # a request that asks for prompt logprobs computes every position: it reads no cached block
            assert cached[out.request_id].num_cached_tokens == 0
    assert [bits(o) for o in outs] == reference


def test_decode_logprobs_equal_a_fresh_prefill(tiny_model_dir: Path, reference: list[tuple]) -> None:
    """Step i's token and logprobs, as decoded, equal what a prefill of prompt + completion[:i] computes (the
    seeded targets resample the same token: the noise is a function of (seed, position)). Not for presence and
    frequency penalties or bad words: they read output tokens, which the fresh prefill holds as prompt."""
    got, expect = fresh_prefills(make_llm(tiny_model_dir, enable_prefix_caching=False), reference)
    assert got == expect


def fresh_prefills(llm: LLM, reference: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """Each decode step of the targets (but those with presence or frequency penalties or bad words) redone as a
    one-token prefill of prompt + completion[:i]: the bits it gives, and the decoded bits from ``reference``."""
    prompts, params, expect = [], [], []
    for prompt, p, ref in zip(TARGET_PROMPTS, TARGET_PARAMS, reference, strict=True):
        if p.presence_penalty or p.frequency_penalty or p.bad_words:
            continue
        tokens, lps, tops = ref[:3]
        for i in range(len(tokens)):
            prompts.append(prompt + list(tokens[:i]))
            params.append(SamplingParams(**{**vars(p), "max_tokens": 1, "prompt_logprobs": None}))
            expect.append(((tokens[i],), (lps[i],), (tops[i],)))
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [bits(o)[:3] for o in outs], expect


def prompt_vs_decode(llm: LLM, reference: list[tuple]) -> list[bool]:
    """Per target: whether the prompt logprobs of prompt + completion, over the completion's tokens, equal the
    decode-time ones (dict for dict: the token first, then the top N, ranks, decoded text; and the plain floats).
    The whole sequences run as prompts, chunked 7 tokens at a time among each other."""
    prompts = [prompt + list(ref[0]) for prompt, ref in zip(TARGET_PROMPTS, reference, strict=True)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3), use_tqdm=False)
    same = []
    for out, prompt, ref in zip(outs, TARGET_PROMPTS, reference, strict=True):
        lps = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:], strict=True)]
        # Completion token i is prompt token len(prompt) + i here.
        floats = [struct.pack("<d", x) for x in lps[len(prompt) - 1 :]] == list(ref[1])
        same.append(bits(out)[4][len(prompt) :] == ref[2] and floats)
    return same


def test_prompt_logprobs_equal_decode_logprobs(tiny_model_dir: Path, reference: list[tuple]) -> None:
    """Prompt token i's logprobs, from position i - 1's logits, equal what the decode step that generated the same
    token after the same context reported."""
    assert prompt_vs_decode(make_llm(tiny_model_dir, max_num_batched_tokens=7, max_num_seqs=7), reference) == [
        True
    ] * len(TARGET_PROMPTS)


def test_prompt_logprobs_across_a_preemption_mid_prefill(tiny_model_dir: Path) -> None:
    # A long prompt asking for prompt logprobs is preempted part-way through its chunked prefill (an older
    # request's decodes need its blocks); it recomputes from position 0 and reports each prompt token once.
    long_prompt = [(7 * i) % 90 for i in range(40)]
    p = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    [alone] = make_llm(tiny_model_dir).generate([long_prompt], p, use_tqdm=False)
    llm = make_llm(tiny_model_dir, num_kv_blocks=12, max_num_batched_tokens=4, max_num_seqs=4)
    preempted = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        batch = schedule()
        preempted.extend((s.num_prompt_tokens, len(s.computed_prompt_logprobs)) for s in batch.preempted)
        return batch

    llm.engine.scheduler.schedule = spy
    first = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _, out = llm.generate([[1, 2, 3], long_prompt], [first, p], use_tqdm=False)
    assert any(n == 40 and 0 < done < 39 for n, done in preempted), preempted
    assert bits(out) == bits(alone)


def test_negative_control_prompt_logprobs_on_default_kernels(tiny_model_dir: Path) -> None:
    # torch's kernels: a chunk's rows and a decode step's row go through different matmul shapes, and the
    # comparison above sees it (its reference made on the same kernels).
    llm = make_llm(tiny_model_dir, batch_invariant=False, max_num_batched_tokens=7, max_num_seqs=7)
    targets = zip(TARGET_PROMPTS, TARGET_PARAMS, strict=True)
    reference = [bits(llm.generate([prompt], p, use_tqdm=False)[0]) for prompt, p in targets]
    assert not all(prompt_vs_decode(llm, reference))


def test_negative_control_default_kernels_differ(tiny_model_dir: Path, reference: list[tuple]) -> None:
    """The same harness on torch's default kernels sees the batch in the bits (proof the matrix could fail)."""
    alone = []
    for prompt, p in zip(TARGET_PROMPTS, TARGET_PARAMS, strict=True):
        [out] = make_llm(tiny_model_dir, batch_invariant=False).generate([prompt], p, use_tqdm=False)
        alone.append(bits(out))
    # On the CPU a decode step alone is a one-row matmul, another BLAS path than the same row among others; on
    # the GPU neighbours alone change the bits. Either way the batched runs must differ somewhere.
    differ = []
    for case in ("batch_of_34", "chunked_16"):
        kwargs, num_others, seed = MATRIX[case]
        outs = run_mixed(make_llm(tiny_model_dir, batch_invariant=False, **kwargs), num_others, seed)
        differ += [case] if [bits(o) for o in outs] != alone else []
    assert differ, "torch's default kernels gave the same bits alone and batched: the matrix above proves nothing"


# -- the API -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir, seed=0, max_logprobs=-1)  # -1: a request may ask for the whole vocabulary


def test_generate_shapes_and_order(tiny_llm: LLM) -> None:
    prompts = ["hello", "a longer prompt, with punctuation!", "x"]
    outs = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for o, p in zip(outs, prompts, strict=True):
        assert o.prompt_token_ids == tiny_llm.tokenizer.encode(p)
        assert len(o.token_ids) == len(o.token_logprobs) == 5 and o.finish_reason == "length"
        assert o.text == tiny_llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert o.logprobs is None and o.prompt_logprobs is None and o.seed is None
        assert all(lp <= 0 for lp in o.token_logprobs)
    # One prompt as a string, as token ids, as vLLM's prompt dicts; the same answer.
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    [a] = tiny_llm.generate("hello", greedy, use_tqdm=False)
    [b] = tiny_llm.generate(outs[0].prompt_token_ids, greedy, use_tqdm=False)
    c, d = tiny_llm.generate([{"prompt": "hello"}, {"prompt_token_ids": outs[0].prompt_token_ids}], greedy)
    assert bits(a) == bits(b) == bits(c) == bits(d) == bits(outs[0])
    assert a.outputs[0].cumulative_logprob == sum(a.token_logprobs)


def test_logprobs_read_the_way_vllm_code_reads_them(tiny_llm: LLM) -> None:
    # out.outputs[0].logprobs[i][token_id].logprob: the sampled token first, then the top N with ranks 1..N; the
    # sampled token's rank is its place in the whole distribution (checked against logprobs=-1: the vocabulary).
    p = SamplingParams(temperature=1.5, seed=3, max_tokens=8, logprobs=2, ignore_eos=True)
    [out] = tiny_llm.generate([[5, 17, 42]], p, use_tqdm=False)
    [full] = tiny_llm.generate([[5, 17, 42]], dataclasses.replace(p, logprobs=-1), use_tqdm=False)
    assert all(len(step) == TINY_VOCAB for step in full.logprobs)
    [bare] = tiny_llm.generate([[5, 17, 42]], dataclasses.replace(p, logprobs=0), use_tqdm=False)
    completion, tok = out.outputs[0], tiny_llm.get_tokenizer()
    assert full.token_ids == bare.token_ids == completion.token_ids
    assert any(step[t].rank > 2 for t, step in zip(completion.token_ids, completion.logprobs, strict=True))
    for i, tid in enumerate(completion.token_ids):
        step = completion.logprobs[i]
        assert isinstance(step[tid], Logprob) and list(step)[0] == tid
        assert step[tid].logprob == completion.token_logprobs[i] and step[tid].decoded_token == tok.decode([tid])
        ranked = sorted(full.logprobs[i].items(), key=lambda kv: (-kv[1].logprob, kv[0]))  # ties to the lower id
        assert [v.rank for _, v in ranked] == list(range(1, TINY_VOCAB + 1))
        assert step == {t: full.logprobs[i][t] for t in step} and len(step) == (2 if step[tid].rank <= 2 else 3)
        assert {v.rank for t, v in step.items() if t != tid} | {step[tid].rank} >= {1, 2}
        assert bare.logprobs[i] == {tid: step[tid]}
    assert completion.cumulative_logprob == sum(completion.token_logprobs)


def test_prompt_logprobs_read_the_way_vllm_code_reads_them(tiny_llm: LLM) -> None:
    prompt = [5, 17, 42, 8, 63]
    p = SamplingParams(temperature=0.9, seed=2, n=3, max_tokens=2, prompt_logprobs=2)
    [out] = tiny_llm.generate([prompt], p, use_tqdm=False)
    [greedy] = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert greedy.prompt_logprobs is None and len(out.outputs) == 3 and out.outputs[0].logprobs is None
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    tok = tiny_llm.get_tokenizer()
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert list(entry)[0] == prompt[i] and entry[prompt[i]].decoded_token == tok.decode([prompt[i]])
        assert entry[prompt[i]].logprob <= 0 and entry[prompt[i]].rank >= 1
        assert sorted(v.rank for t, v in entry.items() if t != prompt[i] or v.rank <= 2)[:2] == [1, 2]
    # A one-token prompt has nothing to predict it; prompt_logprobs=0 holds the prompt tokens' own alone.
    [single] = tiny_llm.generate([[7]], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert single.prompt_logprobs == [None]
    [bare] = tiny_llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    own = [{t: d[t]} for t, d in zip(prompt[1:], out.prompt_logprobs[1:], strict=True)]
    assert bare.prompt_logprobs == [None, *own]


def test_engine_draws_and_reports_a_seed(tiny_llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    a, b = tiny_llm.generate([[1, 2, 3], [1, 2, 3]], p, use_tqdm=False)
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    [again] = tiny_llm.generate([[1, 2, 3]], SamplingParams(**{**vars(p), "seed": a.seed}), use_tqdm=False)
    assert bits(again) == bits(a)


def test_n_choices_are_requests_of_their_own(tiny_llm: LLM) -> None:
    # vLLM's shape: one RequestOutput per prompt, n CompletionOutputs; choice i reproduces alone with n=1 and
    # seed choice_seed(seed, i), and choice 0 is the n=1 answer.
    p = SamplingParams(n=3, temperature=0.9, seed=41, max_tokens=6, logprobs=1, ignore_eos=True)
    [out] = tiny_llm.generate([[4, 5, 6]], p, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert out.text == out.outputs[0].text and out.token_ids == out.outputs[0].token_ids
    for i, choice in enumerate(out.outputs):
        alone = SamplingParams(**{**vars(p), "n": 1, "seed": choice_seed(41, i)})
        [again] = tiny_llm.generate([[4, 5, 6]], alone, use_tqdm=False)
        assert again.outputs[0] == dataclasses.replace(choice, index=0)


def test_stop_strings_and_eos(tiny_llm: LLM) -> None:
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [free] = tiny_llm.generate("abc", p, use_tqdm=False)
    assert len(free.text) >= 4
    stop = free.text[2:4]
    [stopped] = tiny_llm.generate("abc", SamplingParams(**{**vars(p), "stop": [stop]}), use_tqdm=False)
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.find(stop)]
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    # A stop token id ends the request with reason "stop", the token kept in token_ids.
    tok = free.token_ids[3]
    [by_id] = tiny_llm.generate("abc", SamplingParams(**{**vars(p), "stop_token_ids": [tok]}), use_tqdm=False)
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: free.token_ids.index(tok) + 1]


def test_chat(tiny_llm: LLM) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    [one] = tiny_llm.chat(msgs, p, use_tqdm=False)
    assert one.prompt == "user: hi\nassistant:"
    two = tiny_llm.chat([msgs, [{"role": "user", "content": "yo"}]], p, use_tqdm=False)
    assert bits(two[0]) == bits(one) and len(two) == 2


def test_bad_inputs_raise_and_the_engine_keeps_working(tiny_llm: LLM) -> None:
    ok = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    [before] = tiny_llm.generate([[1, 2, 3]], ok, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([[1, 2], []], ok, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([""], ok, use_tqdm=False)
    with pytest.raises(ValueError, match=r"300 tokens.*max_model_len\) is 256"):
        tiny_llm.generate([[1, 2], [5] * 300], ok, use_tqdm=False)
    with pytest.raises(ValueError, match=r"token 97 at index 1 .*\[0, 97\)"):
        tiny_llm.generate([[1, 97]], ok, use_tqdm=False)
    with pytest.raises(ValueError, match="token -1"):
        tiny_llm.generate([[-1]], ok, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        tiny_llm.generate([[1]], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        tiny_llm.generate([[1]], [ok, ok], use_tqdm=False)
    with pytest.raises(TypeError, match="prompt 0"):
        tiny_llm.generate([3.5], ok, use_tqdm=False)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(tiny_llm.engine.config.model, gpu_memory_utilization=1.5)
    assert tiny_llm.get_tokenizer() is tiny_llm.tokenizer
    with pytest.raises(TypeError, match="prompt 1: a dict prompt"):
        tiny_llm.generate(["a", {"prompt": "b", "images": []}], ok, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1: the model is text-only"):  # images: tests/test_llm_vlm.py
        tiny_llm.generate(["a", {"prompt": "b", "multi_modal_data": {"image": [object()]}}], ok, use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()
    [after] = tiny_llm.generate([[1, 2, 3]], ok, use_tqdm=False)
    assert bits(after) == bits(before)


# -- the embedded model ----------------------------------------------------------------------------------------


def test_embedded_model_batch_invariance(embedded_model_dir: Path) -> None:
    llm = LLM(str(embedded_model_dir), block_size=16, num_kv_blocks=16)
    p = SamplingParams(temperature=0, max_tokens=3)
    [alone] = llm.generate("The capital of France is", p, use_tqdm=False)
    assert "Paris" in alone.text
    batch = llm.generate(
        ["Hello", "The capital of France is", "1, 2,"],
        [SamplingParams(temperature=0.7, seed=5, max_tokens=4), p, p],
        use_tqdm=False,
    )
    assert bits(batch[1]) == bits(alone)


def test_load_format_dummy_serves_a_folder_without_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    # vLLM's load_format="dummy": config.json and the tokenizer, random weights of that shape; the same each time.
    folder = tmp_path / "no-weights"
    folder.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outs = [make_llm(folder, load_format="dummy").generate(["hello"], params, use_tqdm=False)[0] for _ in range(2)]
    assert bits(outs[0]) == bits(outs[1]) and len(outs[0].token_ids) == 6
    assert bits(outs[0]) != bits(make_llm(tiny_model_dir).generate(["hello"], params, use_tqdm=False)[0])


def test_vllm_arguments_that_change_nothing_are_accepted(tiny_model_dir: Path) -> None:
    # What vLLM scripts pass: no-ops here (vllm_args.IGNORED), vLLM's defaults (NEUTRAL), a renamed field.
    vllm_style = dict(
        disable_log_stats=True, disable_custom_all_reduce=True, enable_mm_embeds=False, swap_space=4,
        enable_chunked_prefill=False, attention_config={"backend": "FLASH_ATTN"}, kernel_config={},
        compilation_config={"cudagraph_mode": "FULL"}, trust_remote_code=True, tokenizer=str(tiny_model_dir),
        tokenizer_mode="auto", distributed_executor_backend="mp", logprobs_mode="raw_logprobs",
        scheduling_policy="fcfs", max_logprobs=5, num_gpu_blocks_override=300, allowed_local_media_path="",
    )  # fmt: skip
    llm = LLM(str(tiny_model_dir), block_size=BLOCK, **vllm_style)
    assert llm.engine.config.num_kv_blocks == 300 and llm.engine.config.max_logprobs == 5
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2 and llm.llm_engine is llm.engine  # vLLM's name for the engine
    # The same bits as an LLM built without them.
    [plain] = make_llm(tiny_model_dir).generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    assert bits(plain) == bits(out)
    with pytest.raises(ValueError, match="same setting"):
        make_llm(tiny_model_dir, num_gpu_blocks_override=300)  # and make_llm's num_kv_blocks
    for bad in (
        {"enable_mm_embeds": True}, {"tokenizer_mode": "slow"}, {"tokenizer": "/elsewhere"}, {"enable_lora": True},
        {"logprobs_mode": "processed_logprobs"}, {"scheduling_policy": "priority"}, {"pipeline_parallel_size": 2},
        {"logits_processors": ["my.Processor"]}, {"hf_token": "x"},
    ):  # fmt: skip
        [(name, value)] = bad.items()
        with pytest.raises(ValueError, match=f"LLM\\({name}="):
            make_llm(tiny_model_dir, **bad)
    with pytest.raises(TypeError, match="unknown argument"):
        make_llm(tiny_model_dir, disable_log_statz=True)


def test_vllm_offline_extras(tiny_model_dir: Path, tiny_llm: LLM) -> None:
    # skip_tokenizer_init: token ids in, token ids out, no text.
    bare = make_llm(tiny_model_dir, skip_tokenizer_init=True)
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1)
    [out] = bare.generate([[5, 6, 7]], greedy)
    [ref] = tiny_llm.generate([[5, 6, 7]], greedy, use_tqdm=False)
    assert out.token_ids == ref.token_ids and out.text == "" and out.logprobs[0][out.token_ids[0]].decoded_token is None
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.generate("hello")
    # priority: all 0 (vLLM's first-come-first-served), lora_request None; flat_logprobs reads the same.
    outs = tiny_llm.generate(
        ["ab", "cd"], SamplingParams(max_tokens=2, flat_logprobs=True, logprobs=1), priority=[0, 0]
    )
    assert len(outs) == 2 and outs[0].logprobs[0][outs[0].token_ids[0]].rank >= 1
    with pytest.raises(ValueError, match="priority"):
        tiny_llm.generate(["ab", "cd"], priority=[0, 1])
    # stop_reason: the stop string, or the stop token id, that ended it (None for EOS and length), as vLLM's.
    text = tiny_llm.generate("hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].text
    stopped = tiny_llm.generate("hello", SamplingParams(max_tokens=6, temperature=0, stop=[text[2:4]]))[0]
    assert stopped.finish_reason == "stop" and stopped.outputs[0].stop_reason == text[2:4]
    tid = ref.token_ids[1]
    by_id = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[tid]))[0]
    assert by_id.outputs[0].stop_reason == tid and ref.outputs[0].stop_reason is None
    # vLLM's constructors, by keyword: RequestOutput(finished=...), CompletionOutput(cumulative_logprob=...).
    c = CompletionOutput(index=0, text="x", token_ids=[1], cumulative_logprob=-0.5, logprobs=None)
    r = RequestOutput(
        request_id="r", prompt="p", prompt_token_ids=[2], prompt_logprobs=None, outputs=[c], finished=True
    )
    assert r.finished and c.cumulative_logprob == -0.5 and not RequestOutput("s", None, [2], [c]).finished
    assert ref.outputs[0].cumulative_logprob == sum(ref.token_logprobs)
