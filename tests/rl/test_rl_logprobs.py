"""Trainer logprobs (lockstep.rl.token_logprobs) equal the engine's sampled logprobs bit for bit."""

import pytest
import torch

from lockstep import LLM, SamplingParams
from lockstep.rl import load_policy, micro_batches, token_logprobs

NUM_SEQS = 18


def _prompts() -> list[list[int]]:
    # Odd lengths; a 20-token prefix shared by half of them (> one 16-token block: prefix-cache hits).
    shared = [(5 * j + 1) % 95 for j in range(20)]
    out = []
    for i in range(NUM_SEQS):
        tail = [(7 * i + 3 * j) % 95 for j in range(1 + (i * 5) % 17)]
        out.append(shared + tail if i % 2 else tail)
    return out


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.7 + 0.1 * (i % 4), seed=1000 + i, max_tokens=3 + (i * 7) % 23)
            for i in range(NUM_SEQS)]  # fmt: skip


@pytest.fixture(scope="module")
def sampled(tiny_model_dir):
    """The same requests through engines that batch them very differently; their outputs must agree."""
    prompts, params = _prompts(), _params()
    configs = [
        dict(),  # everything in one big batch
        dict(max_num_batched_tokens=16, max_num_seqs=3),  # chunked prefill, small batches
        dict(max_num_batched_tokens=24, max_num_seqs=7, num_kv_blocks=8, block_size=8),  # preemption
    ]
    runs = []
    for cfg in configs:
        llm = LLM(str(tiny_model_dir), **cfg)
        llm.generate(prompts[:3], params[:3], use_tqdm=False)  # warm the prefix cache
        runs.append(llm.generate(prompts, params, use_tqdm=False))
    for run in runs[1:]:
        assert [o.token_ids for o in run] == [o.token_ids for o in runs[0]]
        assert [o.token_logprobs for o in run] == [o.token_logprobs for o in runs[0]]
    return prompts, runs[0]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(tiny_model_dir)


def _assert_bitwise(lps: list[torch.Tensor], outs) -> None:
    assert len(lps) == len(outs)
    for i, (lp, out) in enumerate(zip(lps, outs, strict=True)):
        assert lp.dtype == torch.float32 and lp.requires_grad
        assert torch.equal(lp.detach(), torch.tensor(out.token_logprobs, dtype=torch.float32)), f"sequence {i}"


@pytest.mark.parametrize("packing", [dict(micro_batch_size=1), dict(micro_batch_size=16), dict(max_num_tokens=40),
                                     dict()])  # fmt: skip
def test_trainer_logprobs_equal_sampler_bitwise(sampled, policy, packing):
    prompts, outs = sampled
    assert sum(len(o.token_ids) for o in outs) > 150
    lps = token_logprobs(policy, prompts, [o.token_ids for o in outs], **packing)
    _assert_bitwise(lps, outs)


def test_reordered_and_repacked_sequences_keep_their_bits(sampled, policy):
    prompts, outs = sampled
    order = list(reversed(range(NUM_SEQS)))
    lps = token_logprobs(policy, [prompts[i] for i in order], [outs[i].token_ids for i in order], micro_batch_size=5)
    _assert_bitwise(lps, [outs[i] for i in order])


def test_negative_control_one_ulp_changes_the_bits(sampled, tiny_model_dir):
    # The harness sees a difference: nudge one weight by one ulp and some logprob moves.
    prompts, outs = sampled
    nudged = load_policy(tiny_model_dir)
    with torch.no_grad():
        w = nudged.lm_head.weight
        w[:, 0] = torch.nextafter(w[:, 0], torch.full_like(w[:, 0], float("inf")))
    lps = token_logprobs(nudged, prompts, [o.token_ids for o in outs], micro_batch_size=16)
    same = [torch.equal(lp.detach(), torch.tensor(o.token_logprobs)) for lp, o in zip(lps, outs, strict=True)]
    assert not all(same)


def test_micro_batches():
    assert micro_batches([3, 3, 3], micro_batch_size=2) == [[0, 1], [2]]
    assert micro_batches([5, 5, 20, 1], max_num_tokens=10) == [[0, 1], [2], [3]]
    assert micro_batches([4, 4, 4], micro_batch_size=2, max_num_tokens=6) == [[0], [1], [2]]
    assert micro_batches([1, 2]) == [[0, 1]]
    with pytest.raises(ValueError):
        micro_batches([1], micro_batch_size=0)


def test_validation(policy):
    with pytest.raises(ValueError, match="at least one token"):
        token_logprobs(policy, [[1, 2]], [[]])
    with pytest.raises(ValueError, match="not a token id"):
        token_logprobs(policy, [[1, 2]], [[1000]])
    with pytest.raises(ValueError, match="prompts for"):
        token_logprobs(policy, [[1, 2]], [[1], [2]])
