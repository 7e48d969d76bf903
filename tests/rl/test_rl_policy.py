"""The trainable policy (lockstep.rl.policy): its SiLU-and-mul gradient, and whole-model gradients equal to
float64 finite differences of transformers' Llama and identical run to run."""

import torch
import torch.nn.functional as F
from gradients import check_directional, randn

from lockstep.rl import load_policy, token_logprobs
from lockstep.rl.policy import silu_and_mul


def test_silu_and_mul_grad():
    def silu_ref(gu):
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u

    check_directional(silu_and_mul, silu_ref, [3 * randn(13, 140)])


def test_silu_and_mul_backward_has_the_expressions_values():
    """The in-place backward rounds as the textbook expressions do, bit for bit, in fp32 and bf16 (odd widths)."""
    for dtype, shape in ((torch.float32, (13, 142)), (torch.bfloat16, (17, 2 * 129)), (torch.bfloat16, (1, 6))):
        gate_up = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(shape[0]))).to(dtype)
        grad = torch.randn(shape[0], shape[1] // 2, generator=torch.Generator().manual_seed(7)).to(dtype)
        x = gate_up.clone().requires_grad_()
        silu_and_mul(x).backward(grad)
        gate, up = gate_up.float().chunk(2, dim=-1)
        g, sig = grad.float(), torch.sigmoid(gate)
        want = torch.cat((g * up * sig * (1.0 + gate * (1.0 - sig)), g * gate * sig), dim=-1).to(dtype)
        assert x.grad.dtype == dtype and torch.equal(x.grad, want), dtype
        assert not torch.equal(x.grad, torch.zeros_like(want))


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


def test_silu_and_mul_backward_kernel_matches_the_formula():
    """ops.gated_backward's Triton kernel (the CUDA path; the interpreter here) against the CPU's formula, which
    the test above pins to the textbook expressions: within fp32 rounding in fp32, one bf16 rounding in bf16."""
    from lockstep.ops.gated_backward import silu_and_mul_backward

    for dtype, rows, width in ((torch.float32, 13, 1031), (torch.bfloat16, 5, 129)):
        gate_up = (3 * torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(rows))).to(dtype)
        grad = torch.randn(rows, width, generator=torch.Generator().manual_seed(1)).to(dtype)
        x = gate_up.clone().requires_grad_()
        silu_and_mul(x).backward(grad)
        got = silu_and_mul_backward(gate_up, grad)
        assert got.dtype == dtype and got.abs().max() > 0.1
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
        torch.testing.assert_close(got, x.grad, **tol)
        assert torch.equal(got, silu_and_mul_backward(gate_up, grad))  # run to run
