"""Speculative decoding under tensor parallelism (gloo worker processes): a verify step is an ordinary step to the
workers, and the outputs are the TP 1 tree numerics' bits with and without drafts: n-gram drafting, synchronous
and under async scheduling (a verify chunk's fed first token reaches the workers as any fed row does), and a draft
model, which runs unsharded on rank 0 next to the sharded target."""

from pathlib import Path

import pytest
import test_eagle3
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


# -- EAGLE-3: the head runs on rank 0, on the target's streams at its aux layers (full rows: every layer's output
# is all-reduced, so rank 0 holds the whole residual stream), with the embedding read from the target's checkpoint
# (rank 0's own is a shard).

eagle3_target_dir, eagle3_head_dir = test_eagle3.target_dir, test_eagle3.head_dir


def _eagle3_run(target: Path, head: Path, **kwargs) -> tuple[list, list, list]:
    """Bits, proposals (``test_eagle3._recording``) and launches (``test_eagle3._launches``) of an EAGLE-3 run."""
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    with LLM(str(target), block_size=4, num_kv_blocks=256, seed=0, speculative_config=spec, **kwargs) as llm:
        calls, launches = test_eagle3._recording(llm), test_eagle3._launches(llm)
        got = test_eagle3._bits(llm.generate(test_eagle3.PROMPTS, EAGLE3_PARAMS, use_tqdm=False))
        return got, calls, launches


EAGLE3_PARAMS = [test_eagle3.GREEDY, test_eagle3.SEEDED] * 2


@pytest.fixture(scope="module")
def eagle3_tp1(eagle3_target_dir: Path, eagle3_head_dir: Path) -> tuple[list, list]:
    """TP 1 with the tree numerics: plain decoding's bits, and the head's proposals (synchronous)."""
    plain = LLM(str(eagle3_target_dir), block_size=4, num_kv_blocks=256, seed=0, tp_invariant=True)
    expected = test_eagle3._bits(plain.generate(test_eagle3.PROMPTS, EAGLE3_PARAMS, use_tqdm=False))
    got, calls, _ = _eagle3_run(eagle3_target_dir, eagle3_head_dir, tp_invariant=True)
    assert got == expected
    return expected, calls


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_eagle3_gives_tp1_plain_bits_and_tp1_drafts(
    eagle3_target_dir: Path, eagle3_head_dir: Path, eagle3_tp1, async_scheduling: bool
) -> None:
    expected, tp1_calls = eagle3_tp1
    got, calls, launches = _eagle3_run(
        eagle3_target_dir, eagle3_head_dir, tensor_parallel_size=2, async_scheduling=async_scheduling
    )
    assert got == expected
    assert len(calls) >= 2 * len(test_eagle3.PROMPTS)
    if async_scheduling:  # verify chunks drafted one behind, their first token fed on every rank
        assert (True, True) in launches
    else:  # the head saw rank 0's streams as TP 1 computes them: the same drafts, call for call
        assert calls == tp1_calls
