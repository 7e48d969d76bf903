"""Speculative decoding under tensor parallelism (gloo worker processes): a verify step is an ordinary step to the
workers, and the outputs are the TP 1 tree numerics' bits with and without drafts: n-gram drafting, synchronous
and under async scheduling (a verify chunk's fed first token reaches the workers as any fed row does), and a draft
model, which runs unsharded on rank 0 next to the sharded target."""

from pathlib import Path

import pytest
from test_llm import BLOCK, TARGET_PARAMS, TARGET_PROMPTS, bits
from tiny_models import TINY_EOS, save_char_tokenizer, save_tiny_hf

from lockstep.llm import LLM

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


@pytest.fixture(scope="module")
def tp1_plain(tiny_model_dir: Path) -> list[tuple]:
    with LLM(str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=512, tp_invariant=True) as llm:
        return [bits(o) for o in llm.generate(TARGET_PROMPTS, TARGET_PARAMS, use_tqdm=False)]


def _tp2(folder: Path, spec: dict, **kwargs) -> tuple[list[tuple], int]:
    with LLM(
        str(folder), block_size=BLOCK, num_kv_blocks=512, tensor_parallel_size=2, speculative_config=spec, **kwargs
    ) as llm:
        got = [bits(o) for o in llm.generate(TARGET_PROMPTS, TARGET_PARAMS, use_tqdm=False)]
        return got, llm.engine.spec_stats.num_draft_tokens


def test_tp2_speculation_gives_tp1_plain_bits(tiny_model_dir: Path, tp1_plain) -> None:
    got, drafted = _tp2(tiny_model_dir, NGRAM)
    assert drafted > 0
    assert got == tp1_plain


def test_tp2_async_speculation_gives_tp1_plain_bits(tiny_model_dir: Path, tp1_plain) -> None:
    # Without the penalised and bad-words requests (after whose samples every step is read back), so steps run
    # ahead and verify chunks drafted one token behind take their first token from the device on every rank.
    keep = [i for i, p in enumerate(TARGET_PARAMS) if not (p.penalized or p.bad_words)]
    with LLM(
        str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=512, tensor_parallel_size=2, speculative_config=NGRAM,
        async_scheduling=True,
    ) as llm:  # fmt: skip
        launches = []
        launch = llm.engine.runner.launch
        llm.engine.runner.launch = lambda b, feed=None: (
            launches.append((feed is not None, b.has_drafts)) or launch(b, feed)
        )
        prompts, params = [TARGET_PROMPTS[i] for i in keep], [TARGET_PARAMS[i] for i in keep]
        got = [bits(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert (True, True) in launches
    assert got == [tp1_plain[i] for i in keep]


def test_tp2_draft_model_gives_tp1_plain_bits(tiny_model_dir: Path, tp1_plain, tmp_path: Path) -> None:
    # A one-layer Qwen3 draft of the same tokenizer: the draft (TP 1, rank 0) proposes, the TP 2 target verifies.
    draft = tmp_path / "draft"
    save_tiny_hf(draft, "qwen3", seed=3, scale=2.0, num_hidden_layers=1, bos_token_id=None, eos_token_id=TINY_EOS)
    save_char_tokenizer(draft)
    got, drafted = _tp2(tiny_model_dir, {"model": str(draft), "num_speculative_tokens": 3})
    assert drafted > 0
    assert got == tp1_plain
