"""Speculative decoding under tensor parallelism (gloo worker processes): a verify step is an ordinary step to the
workers, and the outputs are the TP 1 tree numerics' bits with and without drafts."""

from pathlib import Path

from test_llm import BLOCK, TARGET_PARAMS, TARGET_PROMPTS, bits

from lockstep.llm import LLM


def test_tp2_speculation_gives_tp1_plain_bits(tiny_model_dir: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with LLM(str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=512, tp_invariant=True) as llm:
        plain = [bits(o) for o in llm.generate(TARGET_PROMPTS, TARGET_PARAMS, use_tqdm=False)]
    with LLM(
        str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=512, tensor_parallel_size=2, speculative_config=spec
    ) as llm:
        got = [bits(o) for o in llm.generate(TARGET_PROMPTS, TARGET_PARAMS, use_tqdm=False)]
        assert llm.engine.spec_stats.num_draft_tokens > 0
    assert got == plain
