"""The invariance matrix of tests/test_llm.py on tiny mixtures of experts (Qwen3-MoE and Mixtral): a request's
token ids, logprobs and prompt logprobs are the same bits alone, in any batch, under chunked prefill, after a
prefix-cache hit, after preemption, and equal to what a fresh prefill of the same sequence computes."""

from pathlib import Path

import pytest
import torch
from test_llm import (
    BLOCK,
    MATRIX,
    TARGET_PARAMS,
    TARGET_PROMPTS,
    bits,
    fresh_prefills,
    make_llm,
    prompt_vs_decode,
    run_after_prefix_warmup,
    run_mixed,
    run_preempted,
)
from tiny_models import save_tiny_moe


@pytest.fixture(scope="module")
def moe_reference(tiny_moe_dir: Path) -> list[tuple]:
    """Each target run alone, on a fresh engine."""
    refs = []
    for prompt, p in zip(TARGET_PROMPTS, TARGET_PARAMS, strict=True):
        [out] = make_llm(tiny_moe_dir).generate([prompt], p, use_tqdm=False)
        assert len(out.token_ids) == p.max_tokens
        refs.append(bits(out))
    assert len({r[0] for r in refs}) == len(refs)  # the targets took different paths
    return refs


@pytest.mark.parametrize("case", ["batch_of_34", "chunked_16", "chunked_64", "max_num_seqs_3"])
def test_moe_invariance_matrix(tiny_moe_dir: Path, moe_reference: list[tuple], case: str) -> None:
    kwargs, num_others, seed = MATRIX[case]
    outs = run_mixed(make_llm(tiny_moe_dir, **kwargs), num_others, seed)
    assert [bits(o) for o in outs] == moe_reference


def test_moe_invariance_after_preemption(tiny_moe_dir: Path, moe_reference: list[tuple]) -> None:
    outs = run_preempted(tiny_moe_dir)
    assert [bits(o) for o in outs] == moe_reference


def test_moe_invariance_after_prefix_cache_hit(tiny_moe_dir: Path, moe_reference: list[tuple]) -> None:
    outs, cached = run_after_prefix_warmup(tiny_moe_dir)
    hits = [
        cached[o.request_id].num_cached_tokens
        for o, p in zip(outs, TARGET_PARAMS, strict=True)
        if p.prompt_logprobs is None
    ]
    assert min(hits) >= BLOCK * 2, "no prefix-cache hit"
    assert [bits(o) for o in outs] == moe_reference


def test_moe_decode_equals_a_fresh_prefill(tiny_moe_dir: Path, moe_reference: list[tuple]) -> None:
    got, expect = fresh_prefills(make_llm(tiny_moe_dir, enable_prefix_caching=False), moe_reference)
    assert got == expect
    assert prompt_vs_decode(make_llm(tiny_moe_dir, max_num_batched_tokens=7, max_num_seqs=7), moe_reference) == [
        True
    ] * len(TARGET_PROMPTS)


def test_moe_default_kernels_follow_the_batch(tiny_moe_dir: Path) -> None:
    # Negative control: on torch's kernels the same matrix sees some target's bits change with the batch.
    llm = make_llm(tiny_moe_dir, kernels="default")
    alone = [bits(llm.generate([p], s, use_tqdm=False)[0]) for p, s in zip(TARGET_PROMPTS, TARGET_PARAMS, strict=True)]
    batched = [bits(o) for o in run_mixed(make_llm(tiny_moe_dir, kernels="default"), 31, 1)]
    assert batched != alone


def test_a_transformers_state_dict_syncs_into_the_engine(tiny_moe_dir: Path, tmp_path: Path) -> None:
    # An RL trainer on transformers 5 holds the experts fused (mlp.experts.gate_up_proj [E, 2I, H], down_proj
    # [E, H, I]; Mixtral's router under mlp.gate): load_weights takes its state_dict as it is, and the engine then
    # answers like a fresh engine on the checkpoint those weights came from.
    import transformers

    arch = "qwen3_moe" if "qwen3_moe" in tiny_moe_dir.name else "mixtral"
    other = save_tiny_moe(tmp_path / "other", arch, seed=5)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
    state = trainer.state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)  # the fused layout this is about
    llm = make_llm(tiny_moe_dir)
    loaded = llm.load_weights(state)
    assert any(".experts.0." in name for name in loaded)
    prompt, params = TARGET_PROMPTS[1], TARGET_PARAMS[1]
    synced = bits(llm.generate([prompt], params, use_tqdm=False)[0])
    assert synced == bits(make_llm(other).generate([prompt], params, use_tqdm=False)[0])
    assert synced != bits(make_llm(tiny_moe_dir).generate([prompt], params, use_tqdm=False)[0])  # it changed
