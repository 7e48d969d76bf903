"""Mixtures of experts under tensor parallelism through ``LLM``: on tiny Qwen3-MoE and Mixtral checkpoints a
request's token ids, logprobs and prompt logprobs are the same bits at TP 1 (``tp_invariant=True``), 2 and 4 (gloo
worker processes), alone and in a batch with other requests. Negative control: one process without the tree."""

from pathlib import Path

import pytest
from test_llm import TARGET_PARAMS, TARGET_PROMPTS, bits, make_llm, run_mixed

TP_SIZES = [2, 4]


def runs(llm) -> dict[str, list[tuple]]:
    """The targets' bits, each alone and among 12 other requests."""
    alone = [
        bits(llm.generate([prompt], p, use_tqdm=False)[0])
        for prompt, p in zip(TARGET_PROMPTS, TARGET_PARAMS, strict=True)
    ]
    return {"alone": alone, "batched": [bits(o) for o in run_mixed(llm, 12, 3)]}


@pytest.fixture(scope="module")
def tp1(tiny_moe_dir: Path) -> dict[str, list[tuple]]:
    return runs(make_llm(tiny_moe_dir, tp_invariant=True))


@pytest.fixture(scope="module", params=TP_SIZES, ids=[f"tp{n}" for n in TP_SIZES])
def tp(request, tiny_moe_dir: Path) -> tuple[int, dict[str, list[tuple]]]:
    with make_llm(tiny_moe_dir, tensor_parallel_size=request.param) as llm:
        assert llm.engine.config.tp_invariant and len(llm.engine.workers.pids) == request.param - 1
        yield request.param, runs(llm)


def test_moe_tp1_with_the_tree_is_batch_invariant(tp1) -> None:
    assert len({r[0] for r in tp1["alone"]}) == len(tp1["alone"])  # the targets did not all follow one path
    assert tp1["batched"] == tp1["alone"]


@pytest.mark.parametrize("case", ["alone", "batched"])
def test_moe_outputs_do_not_depend_on_the_tp_size(tp, tp1, case: str) -> None:
    size, got = tp
    differ = [i for i, (g, r) in enumerate(zip(got[case], tp1["alone"], strict=True)) if g != r]
    assert not differ, f"TP {size}, {case}: targets {differ} differ from TP 1"


def test_moe_negative_control_one_process_without_the_tree_differs(tp1, tiny_moe_dir: Path) -> None:
    ordinary = runs(make_llm(tiny_moe_dir))["alone"]
    assert ordinary != tp1["alone"]
    assert [r[0][:3] for r in ordinary] == [r[0][:3] for r in tp1["alone"]]  # and not another model
