import dataclasses
import math
import random

import pytest
import torch

from lockstep.layers import sampler
from lockstep.layers.sampler import (
    Sampler,
    SamplingError,
    argmax_lowest,
    gumbel_noise,
    mix64,
    row_key,
    sample_row,
    uniform_noise,
)
from lockstep.ops import log_softmax_at as ops_log_softmax_at
from lockstep.sampling_params import SamplingParams

VOCABS = (1, 3, 17, 127, 1000)


def sample(x: torch.Tensor, params: SamplingParams, seed: int | None, position: int) -> int:
    return sample_row(x, dataclasses.replace(params, seed=seed), position)


def seeded(params: list[SamplingParams], seeds: list[int | None]) -> list[SamplingParams]:
    return [dataclasses.replace(p, seed=s) for p, s in zip(params, seeds, strict=True)]


def logits_batch(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_hash_matches_scalar_reference() -> None:
    # The vectorised int64 hash (wrapping multiplies, masked shifts) equals splitmix64 on Python ints.
    for seed, pos in [(0, 0), (1, 5), (2**62 + 12345, 999), (-7, 3)]:
        key = row_key(seed, pos)
        u = uniform_noise(seed, pos, 50)
        for t in (0, 1, 17, 49):
            h = mix64((t * 0x9E3779B97F4A7C15) ^ key)
            assert u[t].item() == ((h >> 11) + 0.5) * 2.0**-53
    u = uniform_noise(3, 4, 100_000)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01  # roughly uniform


@pytest.mark.parametrize("vocab", VOCABS)
def test_greedy_ties_go_to_lowest_id(vocab: int) -> None:
    x = logits_batch(5, vocab)
    x[:, vocab // 2 :] = x.max() + 1  # a tie across the upper half
    assert argmax_lowest(x).tolist() == [vocab // 2] * 5
    x[2, 0] = x.max() + 1
    assert argmax_lowest(x).tolist()[2] == 0
    ids, _ = Sampler()(x, [SamplingParams(temperature=0)] * 5, [0] * 5)
    assert ids == argmax_lowest(x).tolist()


def test_seeded_noise_is_a_pure_function_of_seed_and_position() -> None:
    vocab, rows = 127, 9
    x = logits_batch(rows, vocab)
    params = [
        SamplingParams(temperature=0.9, top_k=40 if i % 3 == 0 else -1, top_p=0.8 if i % 2 else 1.0)
        for i in range(rows)
    ]
    seeds = [100 + i for i in range(rows)]
    positions = [7 * i for i in range(rows)]
    params = seeded(params, seeds)
    ids, lps = Sampler()(x, params, positions)
    # Any row order, any sub-batch, alone: the same token and the same logprob bits.
    perm = list(range(rows))
    random.Random(0).shuffle(perm)
    pids, plps = Sampler()(x[perm], [params[i] for i in perm], [positions[i] for i in perm])
    for j, i in enumerate(perm):
        assert pids[j] == ids[i] and plps[j] == lps[i]
    for i in range(rows):
        one_id, one_lp = Sampler()(x[i : i + 1].clone(), [params[i]], [positions[i]])
        assert one_id == [ids[i]] and one_lp == [lps[i]]
        assert sample_row(x[i].clone(), params[i], positions[i]) == ids[i]


def test_different_seeds_and_positions_differ() -> None:
    x = torch.zeros(1000)  # uniform: the sample is decided by the noise alone
    p = SamplingParams(temperature=1.0)
    by_seed = {sample(x, p, s, 0) for s in range(50)}
    by_pos = {sample(x, p, 1, pos) for pos in range(50)}
    assert len(by_seed) > 40 and len(by_pos) > 40
    assert not torch.equal(gumbel_noise(1, 2, 64), gumbel_noise(1, 3, 64))
    assert not torch.equal(gumbel_noise(1, 2, 64), gumbel_noise(2, 2, 64))


def test_gumbel_max_matches_the_distribution() -> None:
    # Frequencies over many (seed) draws follow softmax(x / T).
    x = torch.tensor([0.0, 1.0, 2.0, -1.0])
    p = SamplingParams(temperature=0.7)
    n = 4000
    counts = torch.bincount(torch.tensor([sample(x, p, s, 3) for s in range(n)]), minlength=4).double()
    expected = torch.softmax(x.double() / 0.7, 0) * n
    assert ((counts - expected).abs() / expected.sqrt()).max() < 4.5


@pytest.mark.parametrize("vocab", VOCABS)
def test_top_k_and_top_p_restrict_the_support(vocab: int) -> None:
    x = logits_batch(1, vocab, seed=vocab)[0]
    order = torch.argsort(x.double(), descending=True, stable=True).tolist()
    k = max(1, vocab // 4)
    samples = {sample(x, SamplingParams(temperature=2.0, top_k=k), s, 0) for s in range(300)}
    assert samples <= set(order[:k])
    if vocab >= 17:
        assert len(samples) > 1
    # top_p: the smallest head whose fp64 mass reaches p.
    probs = torch.softmax(x.double() / 2.0, 0)
    cum = torch.cumsum(probs[order], 0)
    head = int((cum < 0.5).sum()) + 1
    samples = {sample(x, SamplingParams(temperature=2.0, top_p=0.5), s, 0) for s in range(300)}
    assert samples <= set(order[:head])
    assert sample(x, SamplingParams(temperature=2.0, top_p=1e-9), 5, 0) == order[0]


@pytest.mark.parametrize("vocab", VOCABS)
def test_logprobs_match_fp64_reference(vocab: int) -> None:
    x = logits_batch(4, vocab, seed=1)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=1.0, logprobs=0)] * 2
    ids, lps = Sampler()(x, seeded(params, [None, 1, None, 2]), [3, 4, 5, 6])
    ref = torch.log_softmax(x.double(), -1)
    for i in range(4):
        assert math.isclose(lps[i].logprob, ref[i, ids[i]].item(), rel_tol=1e-5, abs_tol=1e-5)
        n = params[i].logprobs
        assert len(lps[i].top) == min(n, vocab)
        want = torch.argsort(ref[i], descending=True, stable=True)[:n].tolist()
        assert [t for t, _ in lps[i].top] == want
        for t, lp in lps[i].top:
            assert math.isclose(lp, ref[i, t].item(), rel_tol=1e-5, abs_tol=1e-5)
        # The rank is the place in a stable descending sort of the returned (fp32) logprobs.
        ours = Sampler().log_softmax(x[i : i + 1])[0]
        order = torch.argsort(ours, descending=True, stable=True).tolist()
        assert lps[i].rank == order.index(ids[i]) + 1


def test_ranks_count_ties_to_the_lower_id_and_are_none_unless_asked() -> None:
    x = torch.zeros(3, 10)
    x[:, 7] = 1.0
    rows = [SamplingParams(temperature=0, logit_bias={4: 5.0}, logprobs=0), SamplingParams(temperature=0, logprobs=2)]
    rows.append(SamplingParams(temperature=0))
    ids, lps = Sampler()(x, rows, [0, 0, 0], [([1], 1)] * 3)
    # Row 0 chose 4 (biased; logprobs stay raw): level with 0..3, 5, 6, 8, 9 and behind 7 -> after 7, 0, 1, 2, 3.
    assert ids == [4, 7, 7] and [lp.rank for lp in lps] == [6, 1, None]
    assert lps[0].top == () and [t for t, _ in lps[1].top] == [7, 0]


def test_top_logprob_ties_go_to_lower_id() -> None:
    x = torch.zeros(1, 10)
    x[0, 7] = 1.0
    _, lps = Sampler()(x, [SamplingParams(temperature=0, logprobs=4)], [0])
    assert [t for t, _ in lps[0].top] == [7, 0, 1, 2]


def test_steps_without_ranks_take_log_softmax_at_with_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    # A step whose rows want no ranks or top tokens takes the sampled tokens' logprobs from ops.log_softmax_at
    # (on CUDA: row stats, no [rows, vocab] result; faked here, the kernel interpreted) with the bits of the whole
    # log_softmax gathered, which a sampler without log_softmax_at (or a step with ranks) takes.
    x = logits_batch(5, 300, seed=2)
    params = seeded([SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=20)] * 2, [None, 1, None, 2])
    params.append(SamplingParams(temperature=0))
    calls = []
    monkeypatch.setattr(sampler.ops, "log_softmax_at", lambda *a: calls.append(1) or ops_log_softmax_at(*a))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    fast = Sampler()  # built after the patch: it takes the patched op
    ids, lps = fast(x, params, [3, 4, 5, 6, 7])
    full_ids, full_lps = Sampler(lambda t: sampler.ops.log_softmax(t))(x, params, [3, 4, 5, 6, 7])
    assert calls and ids == full_ids
    assert [lp.logprob for lp in lps] == [lp.logprob for lp in full_lps]  # fp32 values, compared exactly
    calls.clear()
    fast(x, [dataclasses.replace(p, logprobs=0) for p in params], [3, 4, 5, 6, 7])
    assert not calls  # ranks need the whole log_softmax


def test_sampling_needs_a_seed() -> None:
    with pytest.raises(ValueError, match="seed"):
        sample(torch.zeros(5), SamplingParams(temperature=1.0), None, 0)


@pytest.mark.parametrize("vocab", (3, 127, 1000))
def test_rows_sampled_together_equal_rows_alone(vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The CUDA grouping (every temperature row without top-p in one call), run here on the CPU: each row's token
    # equals the one it gets alone, whatever its neighbours' temperature, top-k and top-p.
    rows = 24
    x = logits_batch(rows, vocab, seed=vocab)
    x[3, : vocab // 2] = x[3].max()  # ties at the top-k cut and at the argmax
    ks = [-1, 1, 2, vocab - 1, vocab, vocab + 5, 40]
    params = [
        SamplingParams(
            temperature=(0.0, 0.3, 0.8, 1.0, 2.5)[i % 5], top_k=ks[i % len(ks)], top_p=0.7 if i % 4 == 1 else 1.0
        )
        for i in range(rows)
    ]
    seeds = [1000 + 7 * i for i in range(rows)]
    positions = [i * 13 % 50 for i in range(rows)]
    alone = [sample(x[i].clone(), params[i], seeds[i], positions[i]) for i in range(rows)]
    monkeypatch.setattr(sampler, "BATCHED_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(sampler, "ROWS_PER_CALL", 5)  # several calls, the last one short
    params = seeded(params, seeds)
    together, _ = Sampler()(x, params, positions)
    assert together == alone
    perm = list(range(rows))
    random.Random(vocab).shuffle(perm)
    shuffled, _ = Sampler()(x[perm], [params[i] for i in perm], [positions[i] for i in perm])
    assert shuffled == [alone[i] for i in perm]


@pytest.mark.parametrize("vocab", (3, 17, 127, 1000))
def test_penalties_and_bias_match_an_fp64_reference(vocab: int) -> None:
    # vLLM's formulas, element by element in Python floats: bias, then repetition (prompt or output tokens),
    # frequency (output counts), presence (output tokens).
    rng = random.Random(vocab)
    x = logits_batch(1, vocab, seed=vocab)[0]
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
    num_prompt = len(tokens) // 2
    bias = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(3)}
    p = SamplingParams(
        temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.6, logit_bias=bias
    )
    got = sampler.adjust_row(x, p, tokens, num_prompt)
    output = tokens[num_prompt:]
    for t in range(vocab):
        v = float(x[t]) + bias.get(t, 0.0)
        if t in tokens:
            v = v / 1.3 if v > 0 else v * 1.3
        v -= 0.4 * output.count(t) + (0.6 * -1 if t in output else 0.0)
        assert math.isclose(float(got[t]), v, rel_tol=1e-5, abs_tol=1e-5), t
    # Without penalties or bias the row is untouched (the same tensor).
    assert sampler.adjust_row(x, SamplingParams(temperature=0.7), tokens, num_prompt) is x


def test_penalties_steer_the_choice_but_logprobs_stay_raw() -> None:
    x = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    history = [([3, 1, 1], 1)]  # prompt [3], output [1, 1]
    raw_ids, raw_lps = Sampler()(x, [SamplingParams(temperature=0, logprobs=4)], [3], history)
    assert raw_ids == [1]
    ids, lps = Sampler()(x, [SamplingParams(temperature=0, logprobs=4, frequency_penalty=2.0)], [3], history)
    assert ids == [3]  # token 1 drops to 3 - 2 * 2 = -1; token 3 (only in the prompt) keeps 2
    assert lps[0].top == raw_lps[0].top  # the same raw distribution
    ids, _ = Sampler()(x, [SamplingParams(temperature=0, logit_bias={0: 10.0})], [3], history)
    assert ids == [0]
    with pytest.raises(ValueError, match="penalties need"):
        Sampler()(x, [SamplingParams(temperature=0, presence_penalty=1.0)], [3])


def test_min_p_keeps_tokens_within_the_ratio() -> None:
    # Probabilities (T=1) proportional to exp(x): min_p 0.3 keeps tokens with p >= 0.3 * p_max: ids 0 and 1 only.
    x = torch.tensor([2.0, 1.0, 0.0, -1.0]) + 0.5
    kept = {sample(x, SamplingParams(temperature=1.0, min_p=0.3), s, 0) for s in range(300)}
    assert kept == {0, 1}
    assert {sample(x, SamplingParams(temperature=1.0, min_p=1.0), s, 0) for s in range(50)} == {0}


def test_nan_counts_as_minus_inf_and_an_id_is_always_in_the_vocabulary() -> None:
    # Issue 13: a NaN score made the argmax return the vocabulary size, which then broke the whole step.
    x = logits_batch(4, 17)
    x[0, 3] = float("nan")
    x[0, 5] = x[0].nan_to_num().max() + 1
    x[1] = float("nan")
    x[2] = float("-inf")
    x[3, :] = float("-inf")
    x[3, 16] = float("nan")
    assert argmax_lowest(x).tolist() == [5, 0, 0, 0]


def test_a_row_with_nothing_to_sample_fails_alone() -> None:
    # Rows whose scores are all NaN or -inf (a NaN temperature, NaN logits) get an error, not a token; every other
    # row gets the token and logprob bits it gets alone, greedy or sampled, alone or grouped.
    vocab, rows = 127, 6
    x = logits_batch(rows, vocab, seed=3)
    x[4] = float("nan")  # the model's logits themselves
    params = seeded([SamplingParams(temperature=(0.0, 0.8)[i % 2], logprobs=2) for i in range(rows)], range(rows))
    params[1].temperature = float("nan")  # bypasses validation, as a bug would
    sampled = Sampler().sample(x, params, list(range(rows)))
    assert set(sampled.errors) == {1, 4} and all("NaN or -inf" in why for why in sampled.errors.values())
    assert [sampled.token_ids[i] for i in (1, 4)] == [-1, -1]
    assert all(math.isnan(sampled.logprobs[i].logprob) for i in (1, 4))
    for i in (0, 2, 3, 5):
        alone = Sampler().sample(x[i : i + 1].clone(), [params[i]], [i])
        assert (alone.token_ids, alone.logprobs) == ([sampled.token_ids[i]], [sampled.logprobs[i]])
    with pytest.raises(SamplingError, match="row 1: no token can be sampled") as err:
        Sampler()(x, params, list(range(rows)))
    assert set(err.value.errors) == {1, 4}


def test_a_row_that_raises_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # A row whose own sampling raises (here: no seed, a bug upstream; then a bias on a token id past the
    # vocabulary) is reported; the rest of its group is sampled again one row at a time, to the same bits.
    vocab, rows = 127, 7
    x = logits_batch(rows, vocab, seed=4)
    params = seeded([SamplingParams(temperature=0.9) for _ in range(rows)], [10 + i for i in range(rows)])
    params[2].seed = None
    params[5] = SamplingParams(temperature=0, logit_bias={3: 1.0})
    params[5].logit_bias = {vocab + 3: 1.0}
    history = [([1, 2], 2)] * rows
    want = {i: sample_row(x[i].clone(), params[i], i) for i in (0, 1, 3, 4, 6)}
    for grouped in (False, True):
        if grouped:  # the CUDA grouping, several rows a call, on the CPU
            monkeypatch.setattr(sampler, "BATCHED_DEVICES", ("cpu", "cuda"))
            monkeypatch.setattr(sampler, "ROWS_PER_CALL", 4)
        sampled = Sampler().sample(x, params, list(range(rows)), history)
        assert sorted(sampled.errors) == [2, 5], sampled.errors
        assert "needs a seed" in sampled.errors[2] and "IndexError" in sampled.errors[5]
        assert {i: sampled.token_ids[i] for i in want} == want


@pytest.mark.parametrize("vocab", (3, 127, 1000))
def test_masked_rows_choose_within_their_mask_alone_or_batched(vocab: int) -> None:
    # Structured outputs: a row's mask sets its disallowed tokens to -inf before the choice; its token equals the
    # one its masked logits give alone, in any row order and beside unmasked rows, whose bits do not change. The
    # logprobs stay those of the raw logits.
    rows = 7
    x = logits_batch(rows, vocab, seed=vocab + 1)
    gen = torch.Generator().manual_seed(vocab)
    params = seeded([SamplingParams(temperature=(0.0, 0.9)[i % 2], logprobs=2) for i in range(rows)], range(rows))
    masked = [0, 3, 4]
    mask = torch.rand(len(masked), vocab, generator=gen) < 0.3
    mask[:, 0] = True  # never empty
    positions = list(range(rows))
    sampled = Sampler().sample(x, params, positions, allowed=(masked, mask))
    plain = Sampler().sample(x, params, positions)
    for i in range(rows):
        row = x[i : i + 1].clone()
        if i in masked:
            row[0, ~mask[masked.index(i)]] = float("-inf")
            assert mask[masked.index(i), sampled.token_ids[i]]
        else:
            assert (sampled.token_ids[i], sampled.logprobs[i]) == (plain.token_ids[i], plain.logprobs[i])
        alone = Sampler().sample(row, [params[i]], [i])
        assert alone.token_ids == [sampled.token_ids[i]]
        raw = Sampler().sample(x[i : i + 1], [params[i]], [i])  # the logprobs are the raw row's
        assert sampled.logprobs[i].top == raw.logprobs[0].top
    # The same rows in another order, the masks following their rows.
    perm = [5, 3, 0, 6, 1, 4, 2]
    moved = [perm.index(i) for i in masked]
    shuffled = Sampler().sample(x[perm], [params[i] for i in perm], [positions[i] for i in perm], allowed=(moved, mask))
    assert shuffled.token_ids == [sampled.token_ids[i] for i in perm]


def test_a_row_whose_mask_allows_nothing_fails_alone() -> None:
    x = logits_batch(3, 50, seed=1)
    params = [SamplingParams(temperature=0.0)] * 3
    mask = torch.zeros(1, 50, dtype=torch.bool)
    sampled = Sampler().sample(x, params, [0, 1, 2], allowed=([1], mask))
    assert set(sampled.errors) == {1} and "grammar allows none" in sampled.errors[1]
    assert [sampled.token_ids[i] for i in (0, 2)] == [int(x[0].argmax()), int(x[2].argmax())]


def test_token_controls_for_all_rows_at_once_equal_vllms_order_row_by_row() -> None:
    # The sampler applies allowed_token_ids and the bans (min_tokens, bad words) to every row in one fill after
    # the bias and the penalties; vLLM applies them first, row by row. The same tokens: a -inf stays -inf through a
    # bias and every penalty. The reference here is vLLM's order, one row at a time.
    rng = random.Random(5)
    vocab, rows = 300, 24
    logits = logits_batch(rows, vocab, seed=5) * 4
    params, histories = [], []
    for i in range(rows):
        kw: dict = dict(temperature=rng.choice([0.0, 0.8]), seed=i)
        if i % 2:
            kw["allowed_token_ids"] = rng.sample(range(vocab), 40)
        if i % 3:
            kw["bad_words_token_ids"] = [[rng.randrange(vocab)], [3, rng.randrange(vocab)]]
        if i % 4 == 1:
            kw.update(logit_bias={rng.randrange(vocab): 50.0 for _ in range(3)}, repetition_penalty=1.3)
        if i % 5 == 0:
            kw.update(min_tokens=8, stop_token_ids=[7, 8])
        params.append(SamplingParams(**kw))
        histories.append(([rng.randrange(vocab) for _ in range(9)] + [3], 6))
    s = sampler.Sampler()
    tokens, _ = s(logits, params, [10] * rows, histories)
    for i, p in enumerate(params):
        x = logits[i].clone()
        if p.allowed_token_ids:
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[p.allowed_token_ids] = True
            x[~keep] = float("-inf")
        x[s.banned(p, histories[i], vocab)] = float("-inf")
        x = sampler.adjust_row(x, p, *histories[i])
        assert tokens[i] == sampler.sample_row(x, p, 10), i
        assert not p.allowed_token_ids or tokens[i] in p.allowed_token_ids
        assert tokens[i] not in s.banned(p, histories[i], vocab)
