"""LLM.load_weights: after a sync the engine answers exactly like a fresh engine loaded with those weights."""

import pytest
import torch

from lockstep import LLM, SamplingParams
from lockstep.models.loader import load_model
from lockstep.rl import load_policy, token_logprobs

PROMPTS = [[(3 * i + j) % 95 for j in range(20 + i)] for i in range(4)]  # > one block: prefix-cache hits
PARAMS = [SamplingParams(temperature=0.9, seed=7 + i, max_tokens=8) for i in range(4)]
PARAMS.append(SamplingParams(temperature=0.0, max_tokens=8))  # greedy


def _bits(outs):
    return [(o.token_ids, o.token_logprobs) for o in outs]


def test_load_weights_equals_fresh_engine(tiny_model_dir, tiny_rl_model_dir_b):
    prompts = PROMPTS + [PROMPTS[0]]
    llm = LLM(str(tiny_model_dir), max_num_batched_tokens=32, max_num_seqs=3)
    before = llm.generate(prompts, PARAMS, use_tqdm=False)  # fills the prefix cache with the old weights' K/V
    other = load_model(tiny_rl_model_dir_b)
    loaded = llm.load_weights(other.checkpoint_tensors())
    assert "model.layers.0.self_attn.q_proj.weight" in loaded
    after = llm.generate(prompts, PARAMS, use_tqdm=False)
    fresh = LLM(str(tiny_rl_model_dir_b), max_num_batched_tokens=32, max_num_seqs=3)
    assert _bits(after) == _bits(fresh.generate(prompts, PARAMS, use_tqdm=False))
    assert _bits(after) != _bits(before)  # negative control: the weights did change the answers
    # And back: an iterable of (name, tensor) pairs works too.
    llm.load_weights(load_model(tiny_model_dir).checkpoint_tensors().items())
    assert _bits(llm.generate(prompts, PARAMS, use_tqdm=False)) == _bits(before)


def test_optimizer_step_then_sync_keeps_trainer_and_sampler_equal(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    policy = load_policy(tiny_model_dir)
    opt = torch.optim.SGD(policy.parameters(), lr=1e-3)
    for _ in range(2):
        outs = llm.generate(PROMPTS, PARAMS[:4], use_tqdm=False)
        lps = token_logprobs(policy, PROMPTS, [o.token_ids for o in outs], micro_batch_size=3)
        for lp, o in zip(lps, outs, strict=True):
            assert torch.equal(lp.detach(), torch.tensor(o.token_logprobs))
        opt.zero_grad()
        sum(lp.sum() for lp in lps).backward()
        opt.step()
        llm.load_weights(policy.checkpoint_tensors())


def test_load_weights_errors(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    with pytest.raises(ValueError, match="unexpected tensor"):
        llm.load_weights({"model.nope.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        llm.load_weights({"model.norm.weight": torch.zeros(3)})
    llm.engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="still running"):
        llm.load_weights({})
    llm.engine.abort("r")
    assert llm.load_weights({}) == []
