"""The draft-model drafter: its proposals are the draft model's greedy continuation as plain ``LLM.generate``
computes it on the draft checkpoint (same bits), alone and batched, chunked or not; incremental use (growth,
rollback after a rejection, release) proposes what a fresh drafter proposes, without prefilling the history again;
a full KV cache drafts less or nothing instead of failing; a vocabulary mismatch is a ValueError naming both."""

from pathlib import Path

import pytest
from tiny_models import TINY_CHARS, TINY_EOS, TINY_VOCAB, save_char_tokenizer, save_tiny_hf, save_tiny_llama

from lockstep.config import EngineConfig
from lockstep.llm import LLM
from lockstep.sampling_params import SamplingParams
from lockstep.spec import draft_model
from lockstep.spec.config import SpeculativeConfig
from lockstep.spec.draft_model import DraftModelDrafter
from lockstep.spec.drafter import DraftRequest

BLOCK = 4
PROMPTS = [
    [5],
    [12, 40, 40],
    [5, 17, 42, 8, 63, 21, 3, 77, 9, 50, 11, 2, 34],
    [70, 3, 3, 3, 19, 44, 80, 6, 25, 14, 57, 38, 29, 90, 4, 66, 22],
    [8, 8, 30, 52, 61, 7, 19, 33, 2, 91, 44, 2, 85, 13, 13, 71, 36, 5, 59, 20, 48, 1, 1, 60, 31, 7, 7, 9, 10, 95],
]
KS = [3, 1, 7, 3, 5]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller model than the target, of another architecture: Qwen3, one layer, the same char tokenizer."""
    folder = tmp_path_factory.mktemp("draft-qwen3")
    save_tiny_hf(folder, "qwen3", seed=3, scale=2.0, num_hidden_layers=1, bos_token_id=None, eos_token_id=TINY_EOS)
    save_char_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def reference(draft_dir: Path):
    """``reference(tokens, k)``: the draft's greedy continuation through plain ``LLM.generate``, each alone."""
    llm = LLM(str(draft_dir), block_size=BLOCK)
    cache: dict[tuple, list[int]] = {}

    def continuation(tokens: list[int], k: int) -> list[int]:
        key = (tuple(tokens), k)
        if key not in cache:
            params = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
            cache[key] = list(llm.generate([tokens], params, use_tqdm=False)[0].outputs[0].token_ids)
        return cache[key]

    return continuation


def make_drafter(target: Path, draft: Path, **engine_args) -> DraftModelDrafter:
    num_kv_blocks = engine_args.pop("draft_num_kv_blocks", None)
    config = SpeculativeConfig(num_speculative_tokens=3, model=str(draft))
    return DraftModelDrafter(config, EngineConfig(model=str(target), block_size=BLOCK, **engine_args), num_kv_blocks)


def count_fed_tokens(drafter: DraftModelDrafter) -> list[int]:
    """Wrap the drafter's runner so that each step's token count is appended to the returned list."""
    fed: list[int] = []
    launch = drafter.runner.launch

    def counting(batch, feed=None):
        fed.append(batch.num_tokens)
        return launch(batch, feed)

    drafter.runner.launch = counting
    return fed


def test_proposals_are_the_drafts_greedy_continuation(tiny_model_dir: Path, draft_dir: Path, reference) -> None:
    expected = [reference(p, k) for p, k in zip(PROMPTS, KS, strict=True)]
    assert len({tuple(e) for e in expected}) == len(expected)  # distinct continuations: a mix-up would show
    # Alone, each in a fresh drafter.
    for p, k, e in zip(PROMPTS, KS, expected, strict=True):
        assert make_drafter(tiny_model_dir, draft_dir).propose([DraftRequest(0, p, k)]) == [e]
    # Batched, in two orders; and with a step budget of 8 tokens, so prompts are chunked among decode steps.
    requests = [DraftRequest(i, p, k) for i, (p, k) in enumerate(zip(PROMPTS, KS, strict=True))]
    assert make_drafter(tiny_model_dir, draft_dir).propose(requests) == expected
    assert make_drafter(tiny_model_dir, draft_dir).propose(requests[::-1]) == expected[::-1]
    chunked = make_drafter(tiny_model_dir, draft_dir, max_num_seqs=4, max_num_batched_tokens=8)
    fed = count_fed_tokens(chunked)
    assert chunked.propose(requests) == expected
    assert max(fed) == 8 and len(fed) > max(KS)  # chunked, and more than one group of 4 sequences


def test_draft_equal_to_target_proposes_the_targets_greedy_output(tiny_model_dir: Path) -> None:
    """Drafting with the target itself (the acceptance end-to-end test relies on it): plain decoding's tokens."""
    llm = LLM(str(tiny_model_dir), block_size=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    drafter = make_drafter(tiny_model_dir, tiny_model_dir)
    for i, p in enumerate(PROMPTS):
        want = list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
        assert drafter.propose([DraftRequest(i, p, 7)]) == [want]


def test_incremental_use_matches_a_fresh_drafter(tiny_model_dir: Path, draft_dir: Path, reference) -> None:
    drafter = make_drafter(tiny_model_dir, draft_dir)
    fed = count_fed_tokens(drafter)
    total = drafter.num_free_blocks
    a, b = list(PROMPTS[2]), list(PROMPTS[3])
    k = 3

    def step(tokens_by_id: dict[int, list[int]]) -> list[list[int]]:
        fed.clear()
        got = drafter.propose([DraftRequest(i, t, k) for i, t in tokens_by_id.items()])
        assert got == [reference(t, k) for t in tokens_by_id.values()]
        return got

    da, db = step({0: a, 1: b})
    assert sum(fed) == len(a) + len(b) + 2 * (k - 1)
    # a: two drafts accepted and the target's own token (not the third draft); b: every draft and a bonus token.
    a = a + da[:2] + [(da[2] + 1) % TINY_VOCAB]
    b = b + db + [11]
    da, db = step({0: a, 1: b})
    assert sum(fed) == 1 + 2 + 2 * (k - 1)  # only the tokens past what the cache holds: no re-prefill
    assert drafter.num_computed_tokens(0) == len(a) + k - 1
    # a: every draft rejected (the target's token replaces the first); b: not in this call, its state kept.
    a = a + [(da[0] + 1) % TINY_VOCAB]
    (da,) = step({0: a})
    assert sum(fed) == 1 + (k - 1)
    # a: the first draft rejected, then two plain decode steps without drafting (the K/V of two rejected drafts
    # lies before the newest token).
    a = a + [(da[0] + 1) % TINY_VOCAB, 30, 31]
    (da,) = step({0: a})
    assert sum(fed) == 3 + (k - 1)
    # b comes back shorter than what its cache holds: rolled back to its own prefix, only the newest token fed.
    b = b[:10]
    (db,) = step({1: b})
    assert sum(fed) == 1 + (k - 1)
    drafter.release(0)
    drafter.release(0)  # twice: ignored
    assert drafter.num_computed_tokens(0) == 0
    (da,) = step({0: a})  # back after release: prefilled again from scratch
    assert sum(fed) == len(a) + k - 1
    drafter.release(0)
    drafter.release(1)
    assert drafter.num_free_blocks == total


def test_stale_kv_would_show(tiny_model_dir: Path, draft_dir: Path, reference, monkeypatch) -> None:
    """Negative control for the rollback: a drafter that keeps the K/V of rejected drafts proposes something
    else than the draft's continuation, so the incremental test can see a wrong rollback."""
    monkeypatch.setattr(draft_model, "_common_prefix", lambda a, b: len(a))  # never roll back
    drafter = make_drafter(tiny_model_dir, draft_dir)
    tokens = list(PROMPTS[2])
    (d,) = drafter.propose([DraftRequest(0, tokens, 7)])
    # The first draft rejected, then two plain decode steps without drafting: positions 13 and 14 hold the K/V of
    # rejected drafts, and the newest token (always fed again) does not cover them.
    tokens += [(d[0] + 1) % TINY_VOCAB, 30, 31]
    assert drafter.propose([DraftRequest(0, tokens, 7)]) != [reference(tokens, 7)]
    monkeypatch.undo()
    assert make_drafter(tiny_model_dir, draft_dir).propose([DraftRequest(0, tokens, 7)]) == [reference(tokens, 7)]


def test_full_cache_drafts_less_or_nothing(tiny_model_dir: Path, draft_dir: Path, reference) -> None:
    # max_model_len 32 at 4 tokens a block: one sequence takes 8 blocks; the draft's cache has 10.
    drafter = make_drafter(tiny_model_dir, draft_dir, max_model_len=32, draft_num_kv_blocks=10)
    a, b, c = PROMPTS[4][:20], PROMPTS[4][5:25], PROMPTS[3][:14]
    # a takes 6 blocks (22 K/V slots); b would need 6 of the 4 left: nothing; c fits 3 of its 5 (16 slots left).
    got = drafter.propose([DraftRequest(0, a, 3), DraftRequest(1, b, 3), DraftRequest(2, c, 5)])
    assert got == [reference(a, 3), [], reference(c, 5)[:3]]
    assert drafter.num_free_blocks == 0
    assert drafter.propose([DraftRequest(1, b, 3)]) == [[]]  # still full; b holds nothing
    drafter.release(0)
    assert drafter.propose([DraftRequest(1, b, 3)]) == [reference(b, 3)]
    # max_model_len caps a proposal: 30 tokens leave room for 2 more.
    drafter.release(1)
    drafter.release(2)
    assert drafter.propose([DraftRequest(3, PROMPTS[4], 5)]) == [reference(PROMPTS[4], 2)]
    assert drafter.propose([DraftRequest(4, PROMPTS[4] + [1, 2], 5)]) == [[]]


def test_requests_that_draft_nothing(tiny_model_dir: Path, draft_dir: Path) -> None:
    drafter = make_drafter(tiny_model_dir, draft_dir)
    assert drafter.propose([]) == []
    assert drafter.propose([DraftRequest(0, PROMPTS[2], 0), DraftRequest(2, [], 3)]) == [[], []]
    with pytest.raises(ValueError, match="seq_id appears twice"):
        drafter.propose([DraftRequest(1, PROMPTS[2], 2), DraftRequest(1, PROMPTS[3], 2)])


def test_a_failed_forward_forgets_the_calls_sequences(tiny_model_dir: Path, draft_dir: Path, reference) -> None:
    drafter = make_drafter(tiny_model_dir, draft_dir)
    total = drafter.num_free_blocks
    drafter.propose([DraftRequest(0, PROMPTS[2], 3), DraftRequest(1, PROMPTS[3], 3)])
    launch = drafter.runner.launch
    calls = []

    def failing(batch, feed=None):
        calls.append(len(batch))
        if len(calls) == 2:
            raise RuntimeError("the device fell over")
        return launch(batch, feed)

    drafter.runner.launch = failing
    with pytest.raises(RuntimeError, match="fell over"):
        drafter.propose([DraftRequest(0, PROMPTS[2] + [1], 3)])
    assert drafter.num_computed_tokens(0) == 0 and drafter.num_computed_tokens(1) == len(PROMPTS[3]) + 2
    drafter.runner.launch = launch
    assert drafter.propose([DraftRequest(0, PROMPTS[2] + [1], 3)]) == [reference(PROMPTS[2] + [1], 3)]
    drafter.release(0)
    drafter.release(1)
    assert drafter.num_free_blocks == total


def test_vocabulary_mismatch_is_an_error_naming_both(tiny_model_dir: Path, tmp_path: Path) -> None:
    bigger = save_tiny_llama(tmp_path / "bigger-vocab", vocab_size=TINY_VOCAB + 23)
    with pytest.raises(ValueError, match="vocabulary of 120 tokens") as e:
        make_drafter(tiny_model_dir, bigger)
    assert str(bigger) in str(e.value) and str(tiny_model_dir) in str(e.value)
    # Same size, another token -> id map: the char tokenizer with its characters in reverse order.
    other = save_tiny_llama(tmp_path / "other-tokenizer")
    save_char_tokenizer(other, chars=TINY_CHARS[::-1])
    with pytest.raises(ValueError, match="different tokenizers") as e:
        make_drafter(tiny_model_dir, other)
    assert str(other) in str(e.value) and str(tiny_model_dir) in str(e.value)


def test_warm_up_leaves_nothing_behind(tiny_model_dir: Path, draft_dir: Path, reference) -> None:
    drafter = make_drafter(tiny_model_dir, draft_dir, max_model_len=64)
    total = drafter.num_free_blocks
    drafter.warm_up()  # what the constructor runs on CUDA
    assert drafter.num_free_blocks == total
    requests = [DraftRequest(i, p, k) for i, (p, k) in enumerate(zip(PROMPTS, KS, strict=True))]
    assert drafter.propose(requests) == [reference(p, k) for p, k in zip(PROMPTS, KS, strict=True)]


# -- through the engine ------------------------------------------------------------------------------------------

E2E_PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=1234, max_tokens=12, logprobs=3, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, top_k=20, top_p=0.9, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=12, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
]


def output_bits(outs) -> list[tuple]:
    """Token ids, logprob bit patterns and top logprobs of every output."""
    import struct

    as_bits = lambda xs: tuple(struct.pack("<d", x) for x in xs)
    result = []
    for out in outs:
        o = out.outputs[0]
        tops = tuple(tuple((t, struct.pack("<d", v.logprob), v.rank) for t, v in d.items()) for d in o.logprobs or ())
        result.append((tuple(o.token_ids), as_bits(o.token_logprobs), tops, o.finish_reason))
    return result


@pytest.fixture(scope="module")
def plain_bits(tiny_model_dir: Path):
    """``plain_bits(params)``: the target's outputs over PROMPTS without drafting, as bits (cached per params)."""
    llm = LLM(str(tiny_model_dir), block_size=BLOCK)
    cache: dict[tuple, list[tuple]] = {}

    def run(params: list[SamplingParams]) -> list[tuple]:
        key = tuple(repr(p) for p in params)
        if key not in cache:
            cache[key] = output_bits(llm.generate(PROMPTS, params, use_tqdm=False))
        return cache[key]

    return run


def speculative(target: Path, draft: Path, **engine_args) -> LLM:
    spec = {"model": str(draft), "num_speculative_tokens": 3}
    return LLM(str(target), block_size=BLOCK, speculative_config=spec, **engine_args)


def test_engine_with_the_target_as_draft(tiny_model_dir: Path, plain_bits) -> None:
    """Drafting with the target itself: plain decoding's bits, and every greedy draft accepted."""
    greedy = [SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)] * len(PROMPTS)
    llm = speculative(tiny_model_dir, tiny_model_dir)
    assert output_bits(llm.generate(PROMPTS, greedy, use_tqdm=False)) == plain_bits(greedy)
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0
    assert stats.acceptance_rate == 1.0  # the draft's greedy continuation is the target's, bit for bit
    assert stats.mean_accepted_length > 3.5  # 4 tokens a step, less the requests' last steps
    mixed = [E2E_PARAMS[i % len(E2E_PARAMS)] for i in range(len(PROMPTS))]
    assert output_bits(llm.generate(PROMPTS, mixed, use_tqdm=False)) == plain_bits(mixed)
    drafter = llm.engine.drafter
    assert drafter.num_free_blocks == drafter.num_kv_blocks  # every finished sequence was released


def test_engine_with_an_unrelated_draft(tiny_model_dir: Path, draft_dir: Path, plain_bits) -> None:
    """A random draft model: plain decoding's bits, and few of its drafts accepted."""
    mixed = [E2E_PARAMS[i % len(E2E_PARAMS)] for i in range(len(PROMPTS))]
    llm = speculative(tiny_model_dir, draft_dir)
    assert output_bits(llm.generate(PROMPTS, mixed, use_tqdm=False)) == plain_bits(mixed)
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 50
    assert stats.acceptance_rate < 0.15  # 0.03 when measured


def test_engine_with_a_small_cache(tiny_model_dir: Path, plain_bits) -> None:
    """A target cache too small for the batch: preemptions (the drafter releases and later prefills again) and a
    draft cache as small as the target's (sequences it cannot hold draft nothing); plain decoding's bits."""
    mixed = [E2E_PARAMS[i % len(E2E_PARAMS)] for i in range(len(PROMPTS))]
    llm = speculative(tiny_model_dir, tiny_model_dir, num_kv_blocks=10, max_model_len=40)
    drafter = llm.engine.drafter
    assert drafter.num_kv_blocks == 10
    preempted, released, empty = [], [], []
    preempt, release, propose = llm.engine.scheduler._preempt, drafter.release, drafter.propose
    llm.engine.scheduler._preempt = lambda seq: (preempted.append(seq.arrival), preempt(seq))[1]
    drafter.release = lambda seq_id: (released.append(seq_id), release(seq_id))[1]

    def counting(requests):
        got = propose(requests)
        empty.extend(r.seq_id for r, p in zip(requests, got, strict=True) if not p)
        return got

    drafter.propose = counting
    assert output_bits(llm.generate(PROMPTS, mixed, use_tqdm=False)) == plain_bits(mixed)
    assert preempted and set(preempted) <= set(released)
    assert empty  # some requests found the draft's cache full
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert drafter.num_free_blocks == drafter.num_kv_blocks


def test_dtype_length_and_cache_follow_the_target(tiny_model_dir: Path, draft_dir: Path, tmp_path: Path) -> None:
    import json
    import shutil

    bf16 = tmp_path / "draft-bf16"
    shutil.copytree(draft_dir, bf16)
    config = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    drafter = make_drafter(tiny_model_dir, bf16, max_model_len=48, num_kv_blocks=40)
    assert drafter.config_used.dtype == "float32"  # the target's ("auto": its checkpoint's), not the draft's
    assert {p.dtype for p in drafter.runner.model.parameters()} == {draft_model.torch.float32}
    assert drafter.max_model_len == 48
    assert drafter.num_kv_blocks == 40  # as many tokens as the target's cache
    assert make_drafter(tiny_model_dir, bf16, dtype="bfloat16").config_used.dtype == "bfloat16"


def test_a_cache_too_small_for_one_sequence_is_an_error(tiny_model_dir: Path, draft_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(draft_model, "CPU_KV_CACHE_BYTES", 1 << 10)
    with pytest.raises(ValueError, match="draft model's KV cache needs 64 blocks"):
        make_drafter(tiny_model_dir, draft_dir)
