"""``patch_model`` on an FSDP2 (``fully_shard``) transformers model, two gloo ranks: patched before or after the
wrapping, and under FSDP2's bf16 mixed precision against a bf16 engine, its logprobs are the engine's bits (FSDP2
gathers each layer's full weights in its pre-forward hook, and the patched forwards run inside those hooks); a
backward through the sharded model gives the gradients of the unwrapped patched model; ``sampler_weights`` gathers
the sharded weights into the tensors an engine loads. The unpatched FSDP2 model misses the bits (the negative
control)."""

from pathlib import Path

import pytest
import torch
from tiny_models import TINY_EOS, save_tiny_hf
from tp_spawn import run_ranks

from lockstep import LLM, SamplingParams
from lockstep.rl.hf import patch_model, sampler_weights, selective_log_softmax

PROMPTS = [[(5 * j + 3) % 95 for j in range(20)], [40], [(7 * j) % 95 for j in range(70)], [1, 2, 3]]


def _sample(folder: Path, weights: dict | None = None, dtype: str = "float32") -> list:
    """(prompt, completion, the engine's token_logprobs) of each of PROMPTS."""
    llm = LLM(str(folder), dtype=dtype, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64)
    if weights is not None:
        llm.load_weights(weights)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=9, ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.close()
    return [(p, o.token_ids, o.token_logprobs) for p, o in zip(PROMPTS, outs, strict=True)]


def _logprobs(model, samples) -> list[torch.Tensor]:
    """Each completion token's logprob, from one left-padded batch."""
    seqs = [p + c[:-1] for p, c, _ in samples]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), TINY_EOS, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits
    out = []
    for i, (p, c, _) in enumerate(samples):
        start = width - len(seqs[i]) + len(p) - 1
        out.append(selective_log_softmax(logits[i, start : start + len(c)], torch.tensor(c)))
    return out


def _max_diff(lps, samples) -> float:
    return max(float((lp.detach() - torch.tensor(s[2])).abs().max()) for lp, s in zip(lps, samples, strict=True))


def _loss(lps) -> torch.Tensor:
    return sum(lp.sum() * (i + 1) for i, lp in enumerate(lps))


def _load(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _shard(model, mesh, **kwargs):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model.lm_head, mesh=mesh, **kwargs)  # as verl wraps it: an FSDPLinear
    return fully_shard(model, mesh=mesh, **kwargs)


def _fsdp_rank(group, folder: str, samples: list, bf16_samples: list) -> dict:
    """Two FSDP2 models over the ranks' gloo mesh, one patched after ``fully_shard`` (first run unpatched: the
    negative control) and one before; each rank's logprobs of every sample, then a backward on its half and an
    optimizer step on the model patched after."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (group.size,))
    after = _shard(_load(folder), mesh)
    result = {"classes": (type(after).__name__, type(after.lm_head).__name__)}
    assert all(isinstance(p, DTensor) for p in after.parameters())
    with torch.no_grad():
        result["unpatched"] = _max_diff(_logprobs(after, samples), samples)
    patch_model(after)
    seen = []  # what the patched layer forward reads: FSDP2's pre-forward hook (prepended) has run before this one
    after.model.layers[0].register_forward_pre_hook(
        lambda m, _: seen.append((type(m.self_attn.q_proj.weight), tuple(m.self_attn.q_proj.weight.shape)))
    )
    before = _shard(patch_model(_load(folder)), mesh)
    with torch.no_grad():
        result["before"] = _max_diff(_logprobs(before, samples), samples)
    # Mixed precision (verl's default): bf16 compute on the fp32 masters, as a bf16 sampler of the fp32 checkpoint.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mixed = patch_model(_shard(_load(folder), mesh, mp_policy=policy))
    with torch.no_grad():
        result["mixed"] = _max_diff(_logprobs(mixed, bf16_samples), bf16_samples)
    del mixed
    mine = samples[group.rank :: group.size]
    lps = _logprobs(after, mine)
    result["after"] = _max_diff(lps, mine)
    q_proj = after.model.layers[0].self_attn.q_proj.weight
    result["seen"] = seen + [(type(q_proj), tuple(q_proj.to_local().shape), tuple(q_proj.shape))]
    _loss(lps).backward()  # FSDP2 reduce-scatters the mean of the ranks' gradients into each shard
    result["grads"] = {n: p.grad.full_tensor() for n, p in after.named_parameters()}
    torch.optim.SGD(after.parameters(), lr=0.5).step()
    # The weight sync: every rank gathers the sharded weights (collectively); an engine loaded with them samples
    # what the stepped FSDP2 model computes.
    stepped = {n: t.clone() for n, t in sampler_weights(after)}
    result["full"] = all(not isinstance(t, DTensor) for t in stepped.values())
    new = _sample(Path(folder), stepped)
    result["changed"] = [c for _, c, _ in new] != [c for _, c, _ in samples]
    with torch.no_grad():
        result["stepped"] = _max_diff(_logprobs(after, new), new)
    return result


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> tuple[Path, list]:
    folder = save_tiny_hf(tmp_path_factory.mktemp("hf-fsdp"), "qwen3", seed=5, scale=2.0, bos_token_id=None,
                          eos_token_id=TINY_EOS, pad_token_id=None)  # fmt: skip
    return folder, _sample(folder)


def test_fsdp2_patched_model_has_the_engine_bits_and_gradients(qwen3):
    folder, samples = qwen3
    bf16 = _sample(folder, dtype="bfloat16")
    ranks = run_ranks(_fsdp_rank, 2, str(folder), samples, bf16, timeout=120)
    assert ranks[0]["classes"] == ("FSDPQwen3ForCausalLM", "FSDPLinear")
    # Inside the hooks the patched layer reads plain full weights; outside, FSDP2 keeps them as DTensor shards.
    (plain, full), (sharded, local, total) = ranks[0]["seen"]
    assert plain is torch.nn.Parameter and sharded.__name__ == "DTensor"
    assert full == total and local[0] * 2 == total[0]
    for r in ranks:
        assert r["unpatched"] > 0  # the negative control: transformers' kernels through FSDP2
        assert r["before"] == 0.0 and r["after"] == 0.0 and r["mixed"] == 0.0
    # The gradients the FSDP2 ranks reduced equal the unwrapped patched model's over both halves (to rounding:
    # FSDP2 sums the halves' gradients in another order).
    model = patch_model(_load(str(folder)))
    for half in (samples[0::2], samples[1::2]):
        (_loss(_logprobs(model, half)) / 2).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    assert set(ranks[0]["grads"]) == set(want)
    for name, grad in want.items():
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(ranks[0]["grads"][name], grad, rtol=1e-5, atol=1e-6)
    assert all(r["full"] and r["changed"] and r["stepped"] == 0.0 for r in ranks)
