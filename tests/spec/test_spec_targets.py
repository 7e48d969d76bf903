"""Speculative decoding on other targets than the dense Llama: tiny mixtures of experts (Qwen3-MoE, Mixtral: a
verify chunk's rows route through the experts as any prefill chunk's do) and a tiny Qwen3-VL with image prompts
(drafts follow a decoding image request's tokens; their M-RoPE positions are index + delta, as a decode step's).
Each gives plain decoding's bits (token ids, logprob and top-logprob bits, finish reasons, prompt logprobs) with the
n-gram drafter and with an oracle drafter (plain decoding's own continuation: long accepted runs), synchronous and
under async scheduling; and at TP 2 (gloo) the bits of TP 1 plain decoding with the chunk tree."""

from pathlib import Path

import pytest
from test_llm import BLOCK, TARGET_PARAMS, TARGET_PROMPTS, bits
from test_llm_vlm import TARGETS, prompt_of
from test_llm_vlm import bits as vlm_bits
from tiny_vlm import IMAGE_PAD, save_tiny_vlm

from lockstep.engine import model_runner
from lockstep.llm import LLM

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


class Oracle:
    """Proposes plain decoding's continuation of whichever reference sequence the tokens are a prefix of."""

    def __init__(self, outputs) -> None:
        self.full = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]

    def propose(self, requests) -> list[list[int]]:
        out = []
        for r in requests:
            match = [f for f in self.full if f[: len(r.token_ids)] == r.token_ids]
            out.append(match[0][len(r.token_ids) : len(r.token_ids) + r.num_tokens] if match else [])
        return out

    def release(self, seq_id: int) -> None:
        pass


def _generate(folder: Path, prompts, params, drafter=None, **kwargs):
    kwargs = dict(block_size=BLOCK, num_kv_blocks=1024) | kwargs
    with LLM(str(folder), **kwargs) as llm:
        if drafter is not None:
            llm.engine.drafter = drafter
        return llm.generate(prompts, params, use_tqdm=False), llm.engine.spec_stats


@pytest.fixture(scope="module")
def moe_plain(tiny_moe_dir: Path):
    return _generate(tiny_moe_dir, TARGET_PROMPTS, TARGET_PARAMS)[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_moe_target(tiny_moe_dir: Path, moe_plain, drafter: str, async_scheduling: bool) -> None:
    oracle = Oracle(moe_plain) if drafter == "oracle" else None
    outs, stats = _generate(
        tiny_moe_dir, TARGET_PROMPTS, TARGET_PARAMS, oracle, speculative_config=NGRAM, async_scheduling=async_scheduling
    )
    assert [bits(o) for o in outs] == [bits(o) for o in moe_plain]
    assert stats.num_draft_tokens > 0
    if oracle is not None:
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 20


def test_moe_target_under_tp2(tiny_moe_dir: Path) -> None:
    # The experts sharded over two gloo processes: TP 1 plain decoding's bits with the chunk tree.
    plain, _ = _generate(tiny_moe_dir, TARGET_PROMPTS, TARGET_PARAMS, tp_invariant=True)
    outs, stats = _generate(
        tiny_moe_dir, TARGET_PROMPTS, TARGET_PARAMS, Oracle(plain), speculative_config=NGRAM, tensor_parallel_size=2
    )
    assert [bits(o) for o in outs] == [bits(o) for o in plain]
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 20


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-qwen3-vl"), "qwen3_vl")


@pytest.fixture(scope="module")
def vlm_plain(vlm_dir: Path):
    return _generate(vlm_dir, [prompt_of(t, im) for t, im, _ in TARGETS], [p for _, _, p in TARGETS])[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_vlm_target_with_images(vlm_dir: Path, vlm_plain, drafter: str, async_scheduling: bool) -> None:
    oracle = Oracle(vlm_plain) if drafter == "oracle" else None
    drafted_for_images = []
    if oracle is not None:  # count the drafts image requests got (their prompts hold the image tokens)
        propose = oracle.propose

        def counting(requests):
            out = propose(requests)
            drafted_for_images.extend(len(d) for r, d in zip(requests, out, strict=True) if IMAGE_PAD in r.token_ids)
            return out

        oracle.propose = counting
    prompts, params = [prompt_of(t, im) for t, im, _ in TARGETS], [p for _, _, p in TARGETS]
    outs, stats = _generate(
        vlm_dir, prompts, params, oracle, speculative_config=NGRAM, async_scheduling=async_scheduling
    )
    assert [vlm_bits(o) for o in outs] == [vlm_bits(o) for o in vlm_plain]
    assert stats.num_draft_tokens > 0
    if oracle is not None:
        assert sum(drafted_for_images) > 10 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_negative_control_drafts_without_the_mrope_delta_differ(
    vlm_dir: Path, vlm_plain, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The harness sees a draft row's M-RoPE position: giving an image request's drafts index positions (no delta)
    # changes its outputs, while the text-only request keeps its bits.
    run = model_runner.ModelRunner._multimodal_step

    def without_delta(self, batch, flat):
        out = run(self, batch, flat)
        starts = flat.query_start_loc
        for i, e in enumerate(batch.entries):
            if e.drafts and e.seq.mm is not None:
                for row in range(starts[i + 1] - len(e.drafts), starts[i + 1]):
                    flat.positions[row] -= e.seq.mm.delta
        return out

    monkeypatch.setattr(model_runner.ModelRunner, "_multimodal_step", without_delta)
    prompts, params = [prompt_of(t, im) for t, im, _ in TARGETS], [p for _, _, p in TARGETS]
    outs, _ = _generate(vlm_dir, prompts, params, Oracle(vlm_plain), speculative_config=NGRAM)
    got, want = [vlm_bits(o) for o in outs], [vlm_bits(o) for o in vlm_plain]
    assert all(g != w for g, w in zip(got[:3], want[:3], strict=True))
    assert got[3] == want[3]


def test_vlm_target_under_tp2(vlm_dir: Path) -> None:
    # Image requests drafted for at TP 2 (gloo; the tower on rank 0): TP 1 plain decoding's bits with the chunk tree.
    prompts, params = [prompt_of(t, im) for t, im, _ in TARGETS], [p for _, _, p in TARGETS]
    plain, _ = _generate(vlm_dir, prompts, params, tp_invariant=True)
    outs, stats = _generate(
        vlm_dir, prompts, params, Oracle(plain), speculative_config=NGRAM, tensor_parallel_size=2, async_scheduling=True
    )
    assert [vlm_bits(o) for o in outs] == [vlm_bits(o) for o in plain]
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 10
