"""Tensor parallelism through ``LLM``: a request's token ids, logprobs and prompt logprobs are the same bits at TP 1
(``tp_invariant=True``), 2 and 4 (gloo worker processes), and at each TP size under the invariance matrix (alone,
in a batch, chunked prefill, prefix-cache hit, preemption; TP 8: tests/test_llm_tp8.py). The RL trainer at TP 1
with the tree numerics reproduces a TP 2 and TP 4 sampler's logprobs, and ``LLM.load_weights`` reaches every
rank. Negative controls: one process without the tree, and a trainer without it, differ from the tensor-parallel
engine."""

import dataclasses
import struct
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_llm import BLOCK, TARGET_PARAMS, TARGET_PROMPTS, bits, run_mixed
from tiny_models import save_tiny_llama

from lockstep.engine.scheduler import Scheduler
from lockstep.llm import LLM
from lockstep.rl import load_policy, token_logprobs
from lockstep.sampling_params import SamplingParams

TP_SIZES = [2, 4]


def make_llm(folder: Path, **kwargs) -> LLM:
    return LLM(str(folder), block_size=BLOCK, num_kv_blocks=512, **kwargs)


@contextmanager
def scheduled(llm: LLM, **limits):
    """Run with other scheduler limits (a smaller token budget or cache). The scheduler and the block manager live
    in rank 0 alone, so one spawned engine serves every case; the workers just run the steps they are sent."""
    engine = llm.engine
    saved = engine.scheduler
    engine.scheduler = Scheduler(dataclasses.replace(engine.config, **limits), eos_token_ids=engine.eos_token_ids)
    try:
        yield engine.scheduler
    finally:
        engine.scheduler = saved


def alone(llm: LLM) -> list[tuple]:
    return [
        bits(llm.generate([prompt], p, use_tqdm=False)[0])
        for prompt, p in zip(TARGET_PROMPTS, TARGET_PARAMS, strict=True)
    ]


def invariance_matrix(llm: LLM) -> dict[str, list[tuple]]:
    """The targets' bits alone and in each case of the matrix, on one engine."""
    out = {"alone": alone(llm), "batch_of_34": [bits(o) for o in run_mixed(llm, 31, 1)]}
    with scheduled(llm, max_num_batched_tokens=7, max_num_seqs=7):
        out["chunked_7"] = [bits(o) for o in run_mixed(llm, 8, 2)]
    with scheduled(llm, num_kv_blocks=12, max_model_len=49, max_num_batched_tokens=64, max_num_seqs=64) as scheduler:
        preempted = []
        schedule = scheduler.schedule

        def spy():
            batch = schedule()
            preempted.extend(batch.preempted)
            return batch

        scheduler.schedule = spy
        out["preemption"] = [bits(o) for o in run_mixed(llm, 10, 8)]
        assert preempted, "the cache was big enough: nothing was preempted"
    with scheduled(llm) as scheduler:
        llm.generate([p + [1, 2, 3] for p in TARGET_PROMPTS], SamplingParams(max_tokens=2), use_tqdm=False)
        cached = {}
        add = scheduler.add

        def spy_add(seq):
            add(seq)
            cached[seq.request_id] = seq

        scheduler.add = spy_add
        outs = run_mixed(llm, 5, 9)
        asked = [p.prompt_logprobs is not None for p in TARGET_PARAMS]  # those compute every prompt position
        hits = [cached[o.request_id].num_cached_tokens for o, a in zip(outs, asked, strict=True) if not a]
        assert min(hits) >= 2 * BLOCK, f"no prefix-cache hit: {hits}"
        out["prefix_hit"] = [bits(o) for o in outs]
    return out


# -- the sampler side of the RL check: a few sampled completions with their logprobs ------------------------------

RL_PROMPTS = [[(3 * i + 7 * j) % 95 for j in range(5 + 4 * i)] for i in range(5)]
RL_PARAMS = [SamplingParams(temperature=1.0, seed=40 + i, max_tokens=6 + i, ignore_eos=True) for i in range(5)]


def rl_samples(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(RL_PROMPTS, RL_PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs) for o in outs]


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Another checkpoint of the same architecture, and its tensors (what a trainer would send)."""
    from safetensors.torch import load_file

    folder = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-b"), seed=1)
    return folder, load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def tp1(tiny_model_dir: Path, other_weights) -> dict:
    """TP 1 with the chunk tree, in this process: the bits every TP size must give."""
    llm = make_llm(tiny_model_dir, tp_invariant=True)
    fresh = make_llm(other_weights[0], tp_invariant=True)
    return {"matrix": invariance_matrix(llm), "rl": rl_samples(llm), "reloaded": alone(fresh)}


@pytest.fixture(scope="module", params=TP_SIZES, ids=[f"tp{n}" for n in TP_SIZES])
def tp(request, tiny_model_dir: Path, other_weights) -> tuple[int, dict]:
    """One spawned engine per TP size, closed before the next starts (a process drives one at a time)."""
    with make_llm(tiny_model_dir, tensor_parallel_size=request.param) as llm:
        assert llm.engine.config.tp_invariant and len(llm.engine.workers.pids) == request.param - 1
        runs = {"matrix": invariance_matrix(llm), "rl": rl_samples(llm)}
        llm.load_weights(other_weights[1])  # whole checkpoint tensors: each rank keeps its slice
        runs["reloaded"] = alone(llm)
        yield request.param, runs


def test_tp1_with_the_tree_is_batch_invariant(tp1: dict) -> None:
    reference = tp1["matrix"]["alone"]
    assert len({r[0] for r in reference}) == len(reference)  # the targets did not all follow one path
    for case, got in tp1["matrix"].items():
        assert got == reference, case


@pytest.mark.parametrize("case", ["alone", "batch_of_34", "chunked_7", "preemption", "prefix_hit"])
def test_outputs_do_not_depend_on_the_tp_size(tp: tuple[int, dict], tp1: dict, case: str) -> None:
    size, runs = tp
    got, reference = runs["matrix"][case], tp1["matrix"]["alone"]
    differ = [i for i, (g, r) in enumerate(zip(got, reference, strict=True)) if g != r]
    assert not differ, f"TP {size}, {case}: targets {differ} differ from TP 1"
    assert runs["rl"] == tp1["rl"]


def test_load_weights_reaches_every_rank(tp: tuple[int, dict], tp1: dict) -> None:
    # The spawned engine after LLM.load_weights answers like a fresh engine on those weights; they are other weights.
    size, runs = tp
    assert runs["reloaded"] == tp1["reloaded"], f"TP {size}"
    assert runs["reloaded"] != runs["matrix"]["alone"]


def test_negative_control_one_process_without_the_tree_differs(tp1: dict, tiny_model_dir: Path) -> None:
    # The engine's default at TP 1 (the ordinary linear): close to the tree, never the same bits everywhere. The
    # harness above would see it.
    ordinary = alone(make_llm(tiny_model_dir))
    assert ordinary != tp1["matrix"]["alone"]
    assert [r[0][:3] for r in ordinary] == [r[0][:3] for r in tp1["matrix"]["alone"]]  # and not another model


def as_float_bits(xs) -> list[bytes]:
    return [struct.pack("<f", x) for x in xs]


@pytest.mark.parametrize("tree", [True, False], ids=["tree", "negative-control-no-tree"])
def test_a_one_process_trainer_reproduces_the_tp_sampler(tp: tuple[int, dict], tiny_model_dir: Path, tree: bool):
    size, runs = tp
    samples = runs["rl"]
    policy = load_policy(tiny_model_dir, tp_invariant=tree)
    completions = [tokens for tokens, _ in samples]
    lps = token_logprobs(policy, RL_PROMPTS, completions, micro_batch_size=2)
    same = [
        as_float_bits(lp.detach().tolist()) == as_float_bits(sampled)
        for lp, (_, sampled) in zip(lps, samples, strict=True)
    ]
    if tree:
        assert all(same), f"TP {size}: sequences {[i for i, s in enumerate(same) if not s]} differ"
        # ... and the gradient reaches the tree's weights.
        sum(lp.sum() for lp in lps).backward()
        assert policy.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0
    else:
        assert not all(same), f"TP {size}: the trainer without the tree matched: the check proves nothing"
        close = [
            torch.allclose(lp.detach(), torch.tensor(s), atol=1e-4) for lp, (_, s) in zip(lps, samples, strict=True)
        ]
        assert all(close)
