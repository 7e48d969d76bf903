"""Gradients through the batch-invariant ops: finite, equal to float64 finite differences, identical run to run.

Each op-level test compares the autograd Function's fp32 gradient, projected on a random direction, with the
central finite difference of a float64 reference of the same function along that direction.
"""

import pytest
import torch
import torch.nn.functional as F

from lockstep.layers.attention import AttentionMetadata
from lockstep.layers.torch_kernels import torch_write_kv
from lockstep.ops import autograd
from lockstep.rl import attention, load_policy, token_logprobs
from lockstep.rl.policy import silu_and_mul


def _check_directional(fn32, fn64, inputs: list[torch.Tensor], eps: float = 1e-6, rtol: float = 2e-3) -> None:
    """``sum(fn32(*inputs) * w)``'s gradient, dotted with a random direction, vs. fp64 finite differences."""
    gen = torch.Generator().manual_seed(0)
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn32(*leaves)
    w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out.double() * w).sum().backward()
    for x in leaves:
        assert torch.isfinite(x.grad).all()
    dirs = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in inputs]
    analytic = sum((x.grad.double() * d).sum() for x, d in zip(leaves, dirs, strict=True))
    x64 = [x.detach().double() for x in inputs]

    def f(sign: float) -> torch.Tensor:
        return (fn64(*[x + sign * eps * d for x, d in zip(x64, dirs, strict=True)]) * w).sum()

    numeric = (f(1.0) - f(-1.0)) / (2 * eps)
    assert abs(float(analytic) - float(numeric)) <= rtol * max(1.0, abs(float(numeric))), (analytic, numeric)


def _randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bias", [False, True])
def test_linear_grad(bias):
    x, w, b = _randn(17, 33), _randn(19, 33, seed=2) * 0.2, _randn(19, seed=3)
    if bias:
        _check_directional(autograd.linear, F.linear, [x, w, b])
    else:
        _check_directional(lambda x, w: autograd.linear(x, w), lambda x, w: F.linear(x, w), [x, w])


def _rms_ref(x, w, eps=1e-6):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_rms_norm_grad():
    x, w, r = _randn(17, 40), 1 + 0.1 * _randn(40, seed=2), _randn(17, 40, seed=3)
    _check_directional(lambda x, w: autograd.rms_norm(x, w, 1e-6), _rms_ref, [x, w])

    def fused(x, w, r):  # both outputs: the normed sum and the residual stream
        out, h = autograd.rms_norm(x, w, 1e-6, r)
        return torch.cat((out, 0.5 * h), dim=-1)

    def fused_ref(x, w, r):
        return torch.cat((_rms_ref(x + r, w), 0.5 * (x + r)), dim=-1)

    _check_directional(fused, fused_ref, [x, w, r])


def test_log_softmax_and_silu_grad():
    _check_directional(autograd.log_softmax, lambda x: torch.log_softmax(x, -1), [3 * _randn(7, 1000)])
    gate, up = _randn(13, 70).chunk(2, dim=-1)

    def silu_ref(gu):
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u

    _check_directional(silu_and_mul, silu_ref, [3 * _randn(13, 140)])


def test_paged_attention_grad():
    # Two sequences (70 > one 64-position tile, and 5), GQA 4 q / 2 kv heads, head_dim 8, pages of 4.
    lens, hq, hkv, d, page = [70, 5], 4, 2, 8, 4
    n = sum(lens)
    q, k, v = _randn(n, hq, d), _randn(n, hkv, d, seed=2), _randn(n, hkv, d, seed=3)
    blocks = [-(-s // page) for s in lens]
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    tables[0, : blocks[0]] = torch.arange(blocks[0]) + blocks[1]  # not in order of the flattened batch
    tables[1, : blocks[1]] = torch.arange(blocks[1])
    slots = torch.cat([tables[i, torch.arange(s) // page].long() * page + torch.arange(s) % page
                       for i, s in enumerate(lens)])  # fmt: skip
    starts = torch.tensor([0, lens[0], n], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = d**-0.5

    def lockstep_attn(q, k, v):
        caches = [(torch.zeros(sum(blocks), page, hkv, d), torch.zeros(sum(blocks), page, hkv, d))]
        meta = AttentionMetadata(slots, tables, seq_lens, starts, caches)
        torch_write_kv(k, v, *caches[0], slots)
        return attention.paged_attention(q, *caches[0], meta, scale)

    def ref(q, k, v):
        outs = []
        for i in range(len(lens)):
            s = slice(int(starts[i]), int(starts[i + 1]))
            qi, ki, vi = (t[s].transpose(0, 1) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qi[None], ki[None], vi[None], is_causal=True,
                                                       scale=scale, enable_gqa=True)[0].transpose(0, 1))  # fmt: skip
        return torch.cat(outs)

    _check_directional(lockstep_attn, ref, [q, k, v])


def _named_grads(policy) -> dict[str, torch.Tensor]:
    """Each Hugging Face tensor name's gradient (slices of the stacked weights' gradients)."""
    saved = [(p, p.data) for p in policy.parameters()]
    try:
        for p, _ in saved:
            p.data = p.grad
        return {name: g.clone() for name, g in policy.checkpoint_tensors().items()}
    finally:
        for p, data in saved:
            p.data = data


PROMPTS = [[1, 2, 3, 4, 5], [10, 20, 30], [7] * 19]
COMPLETIONS = [[6, 7, 8, 9], [40, 50, 60, 70, 80, 90], [8, 9]]


def _loss_and_grads(folder, micro_batch_size):
    policy = load_policy(folder)
    lps = token_logprobs(policy, PROMPTS, COMPLETIONS, micro_batch_size=micro_batch_size)
    loss = sum(lp.sum() * (i + 1) for i, lp in enumerate(lps))
    loss.backward()
    return loss.detach(), _named_grads(policy)


def test_model_gradient_matches_float64_finite_differences(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    loss32, grads = _loss_and_grads(tiny_model_dir, micro_batch_size=2)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert all(g.abs().sum() > 0 for g in grads.values())

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64, attn_implementation="eager")
    params = dict(hf.named_parameters())
    assert set(params) == set(grads)

    def hf_loss() -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
            ids = torch.tensor([p + c[:-1]])
            lps = torch.log_softmax(hf(ids).logits[0, len(p) - 1 :], -1).gather(1, torch.tensor(c)[:, None])
            total = total + lps.sum() * (i + 1)
        return total

    with torch.no_grad():
        assert abs(float(hf_loss()) - float(loss32)) < 1e-3 * abs(float(loss32))
        gen = torch.Generator().manual_seed(0)
        for trial in range(3):
            dirs = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in params.items()}
            analytic = sum(float((grads[n].double() * d).sum()) for n, d in dirs.items())
            # HF's eager Llama runs RMSNorm and the attention softmax in fp32 even for fp64 weights, so its loss
            # carries fp32 rounding noise (~1e-8 relative): a larger step keeps that noise out of the difference.
            eps = 1e-4
            base = {n: p.clone() for n, p in params.items()}
            values = []
            for sign in (1.0, -1.0):
                for n, p in params.items():
                    p.copy_(base[n] + sign * eps * dirs[n])
                values.append(float(hf_loss()))
            for n, p in params.items():
                p.copy_(base[n])
            numeric = (values[0] - values[1]) / (2 * eps)
            assert abs(analytic - numeric) <= 2e-3 * abs(numeric), (trial, analytic, numeric)


def test_gradients_identical_run_to_run(tiny_model_dir):
    loss_a, grads_a = _loss_and_grads(tiny_model_dir, micro_batch_size=2)
    loss_b, grads_b = _loss_and_grads(tiny_model_dir, micro_batch_size=2)
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    # Another packing: the same forward bits (the loss), gradients equal up to rounding.
    loss_c, grads_c = _loss_and_grads(tiny_model_dir, micro_batch_size=1)
    assert torch.equal(loss_a, loss_c)
    for name in grads_a:
        torch.testing.assert_close(grads_c[name], grads_a[name], rtol=1e-4, atol=1e-5)
