"""lockstep.rl.hf: a transformers model patched with ``patch_model`` computes, bit for bit, the logprobs the engine
sampled with, for every family, alone, padded (left and right), packed, with gradient checkpointing and under
torch.compile; the unpatched model does not (the negative control); gradients agree with float64 finite
differences; save_pretrained and PEFT LoRA keep working."""

from pathlib import Path

import pytest
import torch
from tiny_models import TINY_EOS, save_tiny_hf
from tp_spawn import run_ranks

from lockstep import LLM, SamplingParams
from lockstep.rl.hf import is_patched, patch_model, sampler_weights, selective_log_softmax, unpatch_model

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


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, list]:
    """A tiny random Llama and the engine's samples from it."""
    folder = save_tiny_hf(tmp_path_factory.mktemp("hf-llama-train"), "llama", seed=6, scale=2.0,
                          bos_token_id=None, eos_token_id=TINY_EOS, pad_token_id=None)  # fmt: skip
    return folder, _sample(folder)


def _loss(lps: list[torch.Tensor]) -> torch.Tensor:
    return sum(lp.sum() * (i + 1) for i, lp in enumerate(lps))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_changes_no_bit(llama):
    folder, samples = llama
    results = []
    calls = []
    for checkpointing in (False, True):
        model = patch_model(_load_hf(folder)).train()
        if checkpointing:
            model.activation_checkpointing_enable()
            for layer in model.model.layers:  # count the checkpointed calls
                inner = layer._gradient_checkpointing_func
                layer._gradient_checkpointing_func = lambda *a, inner=inner, **k: calls.append(1) or inner(*a, **k)
        lps = _completion_logprobs(model, samples, "left")
        _assert_engine_bits(lps, samples)
        _loss(lps).backward()
        results.append(_grads(model))
    assert len(calls) == len(model.model.layers)
    off, on = results
    assert set(off) == set(on) and len(off) == len(list(model.parameters()))
    for name in off:
        assert torch.equal(off[name], on[name]), name


def test_torch_compile_keeps_the_bits(llama):
    folder, samples = llama
    model = patch_model(_load_hf(folder))
    compiled = torch.compile(model)
    _assert_engine_bits(_completion_logprobs(compiled, samples, "right"), samples)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_gradients_match_float64_finite_differences(tmp_path, arch):
    """The patched fp32 model's gradient of a loss over a padded batch, dotted with random directions, against
    central differences of transformers' own model in float64 (q/k/v biases in Qwen2, q/k norms in Qwen3)."""
    folder = save_tiny_hf(tmp_path, arch, seed=7, scale=1.0)
    samples = [(p[:12], c[:6], [0.0] * 6) for p, c in zip(ROUND_1, [[3, 1, 4, 1, 5, 9]] * 4, strict=False)]
    model = patch_model(_load_hf(folder))
    loss32 = _loss(_completion_logprobs(model, samples, "left"))
    loss32.backward()
    grads = _grads(model)
    assert len(grads) == len(list(model.parameters())) and all(g.abs().sum() > 0 for g in grads.values())

    ref = _load_hf(folder, torch.float64)
    params = dict(ref.named_parameters())
    assert set(params) == set(grads)
    with torch.no_grad():
        assert abs(float(_loss(_completion_logprobs(ref, samples, "left"))) - float(loss32)) < 1e-4 * abs(float(loss32))
        gen = torch.Generator().manual_seed(0)
        for trial in range(2):
            dirs = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in params.items()}
            analytic = sum(float((grads[n].double() * d).sum()) for n, d in dirs.items())
            eps = 1e-4  # transformers' RMSNorm runs in fp32 even in a float64 model: keep its noise out
            base = {n: p.clone() for n, p in params.items()}
            values = []
            for sign in (1.0, -1.0):
                for n, p in params.items():
                    p.copy_(base[n] + sign * eps * dirs[n])
                values.append(float(_loss(_completion_logprobs(ref, samples, "left"))))
            for n, p in params.items():
                p.copy_(base[n])
            numeric = (values[0] - values[1]) / (2 * eps)
            assert abs(analytic - numeric) <= 2e-3 * abs(numeric), (trial, analytic, numeric)


def test_save_pretrained_round_trips(llama, tmp_path):
    import json

    folder, samples = llama
    model = patch_model(_load_hf(folder))
    model.save_pretrained(tmp_path)
    assert "lockstep" not in json.dumps(json.loads((tmp_path / "config.json").read_text()))
    again = _load_hf(tmp_path)
    assert not is_patched(again)
    original = _load_hf(folder).state_dict()
    assert again.state_dict().keys() == original.keys()
    assert all(torch.equal(again.state_dict()[n], t) for n, t in original.items())
    _assert_engine_bits(_completion_logprobs(patch_model(again), samples, "packed"), samples)


def test_peft_lora_sampler_with_merged_weights_has_the_trainers_bits(llama):
    """A LoRA step changes the model; the engine loaded with ``sampler_weights`` (the adapters merged as the
    patched forward merges them) then samples tokens whose logprobs the PEFT model reproduces bit for bit."""
    from peft import LoraConfig, get_peft_model

    folder, samples = llama
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(patch_model(_load_hf(folder)), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    assert is_patched(model)
    _assert_engine_bits(_completion_logprobs(model, samples, "left"), samples)  # B = 0: the base model's bits
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    _loss(_completion_logprobs(model, samples, "left")).backward()
    opt.step()
    assert _max_diff(_completion_logprobs(model, samples, "left"), samples) > 0  # the step moved the model

    weights = dict(sampler_weights(model))
    assert set(weights) == set(_load_hf(folder).state_dict())  # checkpoint names, the tiny Llama's head untied
    llm = LLM(str(folder), max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=96)
    llm.load_weights(weights.items())
    params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=9, ignore_eos=True) for i in range(4)]
    fresh = [(p, o.token_ids, o.token_logprobs) for p, o in
             zip(ROUND_1, llm.generate(ROUND_1, params, use_tqdm=False), strict=True)]  # fmt: skip
    _assert_engine_bits(_completion_logprobs(model, fresh, "right"), fresh)
    # PEFT's own merge computes the same weights up to rounding.
    merged = model.merge_and_unload().state_dict()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, merged[name], rtol=1e-5, atol=1e-6)


def test_peft_lora_with_dropout_trains(llama):
    """Dropout cannot be merged into a weight: the layer runs as PEFT's module (the sampler's bits are then not
    promised), and gradients still reach the adapters."""
    from peft import LoraConfig, get_peft_model

    folder, samples = llama
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "down_proj"])
    model = get_peft_model(patch_model(_load_hf(folder)), config).train()
    _loss(_completion_logprobs(model, samples, "left")).backward()
    lora = [p for n, p in model.named_parameters() if "lora_B" in n]  # (A's gradient is B^T times: zero at first)
    assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)


def test_layout_errors(llama):
    folder, _ = llama
    model = patch_model(_load_hf(folder))
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="position_ids must number"):
        model(input_ids=ids, position_ids=torch.tensor([[2, 3, 4, 5]]))  # not from 0
    with pytest.raises(ValueError, match="position_ids must number"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 3, 4]]))  # a gap
    with pytest.raises(ValueError, match="no tokens"):
        model(input_ids=ids, attention_mask=torch.zeros_like(ids))
    with pytest.raises(ValueError, match="longer than"):
        model(input_ids=torch.zeros(1, 300, dtype=torch.int64))


def _ddp_rank(group, folder: Path, samples: list) -> dict:
    """One DDP rank (gloo): the patched model wrapped in DistributedDataParallel, its half of the samples."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(patch_model(_load_hf(folder)))
    mine = samples[group.rank :: group.size]
    lps = _completion_logprobs(model, mine, "left")
    _loss(lps).backward()
    return {"diff": _max_diff(lps, mine), "grads": _grads(model.module)}


def test_ddp_two_processes(llama):
    """DDP over gloo: each rank's logprobs are the engine's bits, and the all-reduced gradients equal (to
    rounding) the mean of the two halves' gradients in one process."""
    folder, samples = llama
    ranks = run_ranks(_ddp_rank, 2, folder, samples)
    assert [r["diff"] for r in ranks] == [0.0, 0.0]
    model = patch_model(_load_hf(folder))
    for half in (samples[0::2], samples[1::2]):
        (_loss(_completion_logprobs(model, half, "left")) / 2).backward()
    want = _grads(model)
    for name, grad in want.items():
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name
        torch.testing.assert_close(ranks[0]["grads"][name], grad, rtol=1e-5, atol=1e-5)


def test_autocast_is_off_inside_the_patched_model(llama):
    """A trainer's mixed precision (``bf16=True``: autocast around the forward) would compute what no sampler does;
    the patched forwards turn it off and keep the engine's fp32 bits."""
    folder, samples = llama
    model = patch_model(_load_hf(folder))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lps = _completion_logprobs(model, samples, "right")
    _assert_engine_bits(lps, samples)


def test_trl_fused_head_call_gives_the_engine_bits(llama):
    """TRL's trainers call ``model(..., labels=labels, fused_lm_head=True)`` and read ``log_probs``: lockstep's fused
    head (installed over TRL's) returns the engine's bits there, zeros at the ignored labels."""
    from trl.trainer.utils import add_fused_lm_head as trl_fused_head

    from lockstep.rl.hf.fused_head import add_fused_lm_head

    folder, samples = llama
    model = patch_model(_load_hf(folder))
    trl_fused_head(model, outputs=("log_probs", "entropy"))
    add_fused_lm_head(model)
    ids, mask, first = _padded(samples, "left")
    ids = torch.cat((ids, torch.full((len(samples), 1), TINY_EOS)), dim=1)  # room for the last completion token
    mask = torch.cat((mask, torch.zeros(len(samples), 1, dtype=mask.dtype)), dim=1)
    labels = torch.full_like(ids, -100)
    for i, (p, c, _) in enumerate(samples):
        start = first[i] + len(p)
        ids[i, start + len(c) - 1] = c[-1]
        mask[i, start + len(c) - 1] = 1
        labels[i, start : start + len(c)] = torch.tensor(c)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    lps = [out.log_probs[i, first[i] + len(p) - 1 : first[i] + len(p) - 1 + len(c)] for i, (p, c, _) in
           enumerate(samples)]  # fmt: skip
    _assert_engine_bits(lps, samples)
    assert torch.equal(out.log_probs[labels[:, 1:] == -100], torch.zeros(int((labels[:, 1:] == -100).sum())))
    assert out.entropy is not None and bool((out.entropy[labels[:, 1:] != -100] > 0).all())
    assert torch.isfinite(out.loss) and not hasattr(model(input_ids=ids, attention_mask=mask), "log_probs")
