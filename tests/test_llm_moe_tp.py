"""Mixtures of experts under tensor parallelism through ``LLM``: on tiny Qwen3-MoE and Mixtral checkpoints a
request's token ids, logprobs and prompt logprobs are the same bits at TP 1 (``tp_invariant=True``), 2 and 4 (gloo
worker processes) in every case of the dense TP matrix (alone, in a batch, chunked prefill, preemption, a
prefix-cache hit), and a one-process trainer with the tree reproduces a TP sampler's logprobs. Negative controls:
one process without the tree, and the trainer without it."""

from pathlib import Path

import pytest
from test_llm_tp import RL_PROMPTS, alone, as_float_bits, invariance_matrix, make_llm, rl_samples

from lockstep.rl import load_policy, token_logprobs

TP_SIZES = [2, 4]
CASES = ["alone", "batch_of_34", "chunked_7", "preemption", "prefix_hit"]


@pytest.fixture(scope="module")
def tp1(tiny_moe_dir: Path) -> dict[str, list[tuple]]:
    return invariance_matrix(make_llm(tiny_moe_dir, tp_invariant=True))


@pytest.fixture(scope="module", params=TP_SIZES, ids=[f"tp{n}" for n in TP_SIZES])
def tp(request, tiny_moe_dir: Path) -> tuple[int, dict[str, list[tuple]]]:
    with make_llm(tiny_moe_dir, tensor_parallel_size=request.param) as llm:
        assert llm.engine.config.tp_invariant and len(llm.engine.workers.pids) == request.param - 1
        yield request.param, invariance_matrix(llm) | {"rl": rl_samples(llm)}


def test_moe_tp1_with_the_tree_is_batch_invariant(tp1) -> None:
    assert len({r[0] for r in tp1["alone"]}) == len(tp1["alone"])  # the targets did not all follow one path
    for case in CASES[1:]:
        assert tp1[case] == tp1["alone"], case


@pytest.mark.parametrize("case", CASES)
def test_moe_outputs_do_not_depend_on_the_tp_size(tp, tp1, case: str) -> None:
    size, got = tp
    differ = [i for i, (g, r) in enumerate(zip(got[case], tp1["alone"], strict=True)) if g != r]
    assert not differ, f"TP {size}, {case}: targets {differ} differ from TP 1"


def test_moe_negative_control_one_process_without_the_tree_differs(tp1, tiny_moe_dir: Path) -> None:
    ordinary = alone(make_llm(tiny_moe_dir))
    assert ordinary != tp1["alone"]
    assert [r[0][:3] for r in ordinary] == [r[0][:3] for r in tp1["alone"]]  # and not another model


@pytest.mark.parametrize("tree", [True, False], ids=["tree", "negative-control-no-tree"])
def test_a_one_process_moe_trainer_reproduces_the_tp_sampler(tp, tiny_moe_dir: Path, tree: bool) -> None:
    size, runs = tp
    policy = load_policy(tiny_moe_dir, tp_invariant=tree)
    lps = token_logprobs(policy, RL_PROMPTS, [tokens for tokens, _ in runs["rl"]], micro_batch_size=2)
    same = [as_float_bits(lp.detach().tolist()) == as_float_bits(s) for lp, (_, s) in zip(lps, runs["rl"], strict=True)]
    if not tree:
        assert not all(same), f"TP {size}: the trainer without the tree matched: the check proves nothing"
        return
    assert all(same), f"TP {size}: sequences {[i for i, s in enumerate(same) if not s]} differ"
    sum(lp.sum() for lp in lps).backward()  # the gradient reaches the experts and the router through the tree
    sparse = next(layer.mlp for layer in policy.model.layers if hasattr(layer.mlp, "w2"))
    assert sparse.w2.grad.abs().sum() > 0 and sparse.gate.weight.grad.abs().sum() > 0
