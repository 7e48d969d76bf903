"""lockstep.rl on mixtures of experts: the trainer's logprobs equal the sampler's bit for bit (KL = 0) with the
router and the experts in the autograd graph, and the gradients match float64 finite differences of transformers'
model."""

import pytest
import torch

from lockstep import LLM, SamplingParams
from lockstep.layers.moe import SparseMoeBlock
from lockstep.rl import load_policy, token_logprobs

PROMPTS = [[(5 * j + 1) % 95 for j in range(20)] + [i, i + 1] * (i % 3 + 1) for i in range(10)]
PARAMS = [SamplingParams(temperature=0.8, seed=50 + i, max_tokens=4 + (i * 5) % 13) for i in range(10)]


@pytest.fixture(scope="module")
def sampled(tiny_moe_dir):
    """The requests through two engines that batch them differently; their outputs agree."""
    runs = []
    for cfg in (dict(), dict(max_num_batched_tokens=16, max_num_seqs=3)):
        runs.append(LLM(str(tiny_moe_dir), **cfg).generate(PROMPTS, PARAMS, use_tqdm=False))
    assert [o.token_logprobs for o in runs[0]] == [o.token_logprobs for o in runs[1]]
    return runs[0]


@pytest.mark.parametrize("packing", [dict(micro_batch_size=1), dict(micro_batch_size=4), dict()])
def test_moe_trainer_logprobs_equal_sampler_bitwise(tiny_moe_dir, sampled, packing):
    policy = load_policy(tiny_moe_dir)
    lps = token_logprobs(policy, PROMPTS, [o.token_ids for o in sampled], **packing)
    for i, (lp, out) in enumerate(zip(lps, sampled, strict=True)):
        assert lp.requires_grad
        assert torch.equal(lp.detach(), torch.tensor(out.token_logprobs, dtype=torch.float32)), f"sequence {i}"
    # The router and the experts are in the graph: the loss reaches every one of their weights.
    sum(lp.sum() for lp in lps).backward()
    blocks = [m for m in policy.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    for block in blocks:
        for p in (block.gate.weight, block.w13, block.w2):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_moe_negative_control_one_ulp_in_a_router_changes_the_bits(tiny_moe_dir, sampled):
    policy = load_policy(tiny_moe_dir)
    block = next(m for m in policy.modules() if isinstance(m, SparseMoeBlock))
    with torch.no_grad():
        w = block.gate.weight
        w.copy_(torch.nextafter(w, torch.full_like(w, float("inf"))))
    lps = token_logprobs(policy, PROMPTS, [o.token_ids for o in sampled])
    assert not all(torch.equal(lp.detach(), torch.tensor(o.token_logprobs)) for lp, o in zip(lps, sampled, strict=True))


PROMPTS_FD = [[1, 2, 3, 4, 5], [10, 20, 30], [7] * 11]
COMPLETIONS_FD = [[6, 7, 8, 9], [40, 50, 60, 70], [8, 9]]


def _hf_named_grads(policy) -> dict[str, torch.Tensor]:
    """Gradients under transformers' own parameter names (its experts are stacked like ours)."""
    grads = {}
    for name, module in policy.named_modules():
        if isinstance(module, SparseMoeBlock):
            layer = name.rpartition(".")[0]
            grads[f"{layer}.mlp.gate.weight"] = module.gate.weight.grad
            grads[f"{layer}.mlp.experts.gate_up_proj"] = module.w13.grad
            grads[f"{layer}.mlp.experts.down_proj"] = module.w2.grad
    saved = [(p, p.data) for p in policy.parameters()]
    try:
        for p, _ in saved:
            p.data = p.grad
        for name, g in policy.checkpoint_tensors().items():
            if ".experts." not in name and not name.endswith("mlp.gate.weight") and "block_sparse_moe" not in name:
                grads[name] = g.clone()
    finally:
        for p, data in saved:
            p.data = data
    return grads


def test_moe_gradient_matches_float64_finite_differences(tiny_moe_dir):
    from transformers import AutoModelForCausalLM

    policy = load_policy(tiny_moe_dir)
    lps = token_logprobs(policy, PROMPTS_FD, COMPLETIONS_FD, micro_batch_size=2)
    loss32 = sum(lp.sum() * (i + 1) for i, lp in enumerate(lps))
    loss32.backward()
    grads = _hf_named_grads(policy)

    hf = AutoModelForCausalLM.from_pretrained(
        tiny_moe_dir, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    )
    params = dict(hf.named_parameters())
    assert set(params) == set(grads)

    def hf_loss() -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for i, (p, c) in enumerate(zip(PROMPTS_FD, COMPLETIONS_FD, strict=True)):
            logits = hf(torch.tensor([p + c[:-1]])).logits[0, len(p) - 1 :]
            total = total + torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None]).sum() * (i + 1)
        return total

    with torch.no_grad():
        assert abs(float(hf_loss()) - float(loss32)) < 1e-3 * abs(float(loss32))
        gen = torch.Generator().manual_seed(0)
        dirs = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in params.items()}
        analytic = sum(float((grads[n].double() * d).sum()) for n, d in dirs.items())
        # Transformers takes the router softmax (and RMSNorm) in fp32 even for fp64 weights: a step of 1e-4 keeps
        # that noise out of the difference and is still small enough that no router choice flips (1e-3 flips one).
        eps = 1e-4
        base = {n: p.clone() for n, p in params.items()}
        values = []
        for sign in (1.0, -1.0):
            for n, p in params.items():
                p.copy_(base[n] + sign * eps * dirs[n])
            values.append(float(hf_loss()))
        numeric = (values[0] - values[1]) / (2 * eps)
        assert abs(analytic - numeric) <= 2e-3 * abs(numeric), (analytic, numeric)
