"""TP 8, the largest size the chunk tree supports, as eight gloo processes, for Llama, Qwen3-MoE and Mixtral:
TP 1's bits, and a one-process trainer that reproduces the TP 8 sampler (a module of its own: test_llm_tp.py keeps
a TP engine open per module, and a process drives one tensor-parallel engine at a time)."""

from pathlib import Path

import pytest
from test_llm import bits, run_mixed
from test_llm_tp import RL_PROMPTS, alone, as_float_bits, make_llm, rl_samples
from tiny_models import save_tiny_llama, save_tiny_moe

from lockstep.rl import load_policy, token_logprobs


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mixtral"])
def test_tp8_on_gloo_gives_tp1s_bits_and_a_one_process_trainer_reproduces_it(tmp_path: Path, arch: str) -> None:
    # The largest TP size the chunk tree supports, as eight gloo processes (models with 8 heads; 2 KV heads, so
    # each is replicated over 4 ranks; the experts split by their width): the targets alone and in a batch of 34,
    # and sampled completions, have TP 1's bits with the tree, and a one-process trainer with the tree reproduces
    # the TP 8 sampler's logprobs.
    folder = tmp_path / f"{arch}-eight-heads"
    if arch == "llama":
        save_tiny_llama(folder, num_attention_heads=8, head_dim=8)
    else:
        save_tiny_moe(folder, arch, num_attention_heads=8)
    reference = make_llm(folder, tp_invariant=True)
    want = {"alone": alone(reference), "batch": [bits(o) for o in run_mixed(reference, 31, 1)]}
    with make_llm(folder, tensor_parallel_size=8) as llm:
        assert len(llm.engine.workers.pids) == 7
        got = {"alone": alone(llm), "batch": [bits(o) for o in run_mixed(llm, 31, 1)]}
        samples = rl_samples(llm)
    assert got == want
    assert samples == rl_samples(reference)
    policy = load_policy(folder, tp_invariant=True)
    lps = token_logprobs(policy, RL_PROMPTS, [tokens for tokens, _ in samples], micro_batch_size=2)
    assert [as_float_bits(lp.tolist()) for lp in lps] == [as_float_bits(lp) for _, lp in samples]
