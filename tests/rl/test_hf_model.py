"""lockstep.rl.hf: a transformers model patched with ``patch_model`` computes, bit for bit, the logprobs the engine
sampled with, for every family, alone, padded (left and right), packed, with gradient checkpointing and under
torch.compile; the unpatched model does not (the negative control); gradients agree with float64 finite
differences; save_pretrained and PEFT LoRA keep working."""

from pathlib import Path

import pytest
import torch
from tiny_models import TINY_EOS, save_tiny_hf

from lockstep import LLM, SamplingParams
from lockstep.rl.hf import is_patched, patch_model, selective_log_softmax, unpatch_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"]

# A shared 20-token prefix (over one 16-slot page: the second round hits the prefix cache), a one-token prompt,
# and a 70-token one (its completion crosses the attention's 64-position tile).
PREFIX = [(5 * j + 3) % 95 for j in range(20)]
ROUND_1 = [PREFIX + [1, 2, 3], [40], [(7 * j) % 95 for j in range(70)], PREFIX[:9]]
ROUND_2 = [PREFIX + [9, 8], PREFIX + [1, 2, 3, 4]]


def _load_hf(folder: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)


def _sample(folder: Path, dtype: str = "float32", **engine_args) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, completion, the engine's token_logprobs) of samples taken with chunked prefill (16 tokens a step,
    4 sequences at a time) and, in the second round, prefix-cache hits."""
    llm = LLM(str(folder), dtype=dtype, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=96, **engine_args)
    samples = []
    for rnd, prompts in enumerate((ROUND_1, ROUND_2)):
        params = [SamplingParams(temperature=1.0, seed=100 * rnd + i, max_tokens=11, ignore_eos=True) for i in
                  range(len(prompts))]  # fmt: skip
        for p, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
            samples.append((p, out.token_ids, out.token_logprobs))
    llm.close()
    return samples


def _padded(samples, side: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(input_ids, attention_mask, first)`` of the samples padded on ``side``; ``first[i]``: the column of
    sequence i's first token. The last completion token is only predicted, never fed."""
    seqs = [p + c[:-1] for p, c, _ in samples]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), TINY_EOS, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    first = []
    for i, s in enumerate(seqs):
        start = width - len(s) if side == "left" else 0
        ids[i, start : start + len(s)] = torch.tensor(s)
        mask[i, start : start + len(s)] = 1
        first.append(start)
    return ids, mask, first


def _completion_logprobs(model, samples, layout: str) -> list[torch.Tensor]:
    """The model's logprob of each completion token, from one batch laid out as ``layout``: "alone" (one forward
    per sequence), "right" / "left" (padded), "packed" (one row, position_ids restarting at 0)."""
    if layout == "alone":
        return [_completion_logprobs(model, [s], "right")[0] for s in samples]
    if layout == "packed":
        seqs = [p + c[:-1] for p, c, _ in samples]
        ids = torch.tensor([sum(seqs, [])])
        pos = torch.tensor([[j for s in seqs for j in range(len(s))]])
        targets = torch.tensor([[t for p, c, _ in samples for t in p[1:] + c]])
        lp = selective_log_softmax(model(input_ids=ids, position_ids=pos).logits, targets)[0]
        out, offset = [], 0
        for (p, _, _), s in zip(samples, seqs, strict=True):
            out.append(lp[offset + len(p) - 1 : offset + len(s)])
            offset += len(s)
        return out
    ids, mask, first = _padded(samples, layout)
    logits = model(input_ids=ids, attention_mask=mask).logits  # [batch, width, vocab]
    out = []
    for i, (p, c, _) in enumerate(samples):
        rows = torch.arange(first[i] + len(p) - 1, first[i] + len(p) - 1 + len(c))
        out.append(selective_log_softmax(logits[i, rows], torch.tensor(c)))
    return out


def _max_diff(lps: list[torch.Tensor], samples) -> float:
    return max(float((lp.detach() - torch.tensor(s[2])).abs().max()) for lp, s in zip(lps, samples, strict=True))


def _assert_engine_bits(lps: list[torch.Tensor], samples) -> None:
    for i, (lp, (_, _, want)) in enumerate(zip(lps, samples, strict=True)):
        assert lp.dtype == torch.float32
        assert torch.equal(lp.detach(), torch.tensor(want)), (i, (lp.detach() - torch.tensor(want)).abs().max())


@pytest.fixture(scope="module", params=ARCHS)
def family(request, tmp_path_factory) -> tuple[Path, list]:
    """A tiny random checkpoint of each family and the engine's samples from it."""
    folder = save_tiny_hf(tmp_path_factory.mktemp(f"hf-{request.param}"), request.param, seed=3, scale=2.0,
                          bos_token_id=None, eos_token_id=TINY_EOS, pad_token_id=None)  # fmt: skip
    return folder, _sample(folder)


def test_patched_model_reproduces_engine_logprobs(family):
    folder, samples = family
    model = _load_hf(folder)
    # The negative control: transformers' own kernels miss the sampler's bits.
    assert _max_diff(_completion_logprobs(model, samples, "right"), samples) > 0
    assert patch_model(model) is model and is_patched(model)
    for layout in ("alone", "right", "left", "packed"):
        _assert_engine_bits(_completion_logprobs(model, samples, layout), samples)
    unpatch_model(model)
    assert not is_patched(model)
    assert _max_diff(_completion_logprobs(model, samples, "right"), samples) > 0


def test_bf16_padded_and_packed(tmp_path):
    folder = save_tiny_hf(tmp_path, "qwen3", seed=4, scale=2.0, bos_token_id=None, eos_token_id=TINY_EOS)
    samples = _sample(folder, dtype="bfloat16")
    model = patch_model(_load_hf(folder, torch.bfloat16))
    for layout in ("left", "packed"):
        _assert_engine_bits(_completion_logprobs(model, samples, layout), samples)


def test_tp_invariant_matches_tp_invariant_engine(tmp_path):
    folder = save_tiny_hf(tmp_path, "qwen3_moe", seed=5, scale=2.0, bos_token_id=None, eos_token_id=TINY_EOS)
    samples = _sample(folder, tp_invariant=True)
    model = _load_hf(folder)
    patch_model(model)
    assert _max_diff(_completion_logprobs(model, samples, "left"), samples) > 0  # default numerics: another sum
    patch_model(model, tp_invariant=True)
    _assert_engine_bits(_completion_logprobs(model, samples, "left"), samples)
    _assert_engine_bits(_completion_logprobs(model, samples, "packed"), samples)
