import pytest
import torch
import torch.nn.functional as F

import lockstep
from lockstep import (
    batch_invariant_mode,
    check_batch_invariance,
    disable_batch_invariant_mode,
    enable_batch_invariant_mode,
    is_batch_invariant_mode_enabled,
)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _mode_off_after_each_test():
    yield
    disable_batch_invariant_mode()


def test_enable_disable_and_nesting_restore_the_previous_state():
    assert not is_batch_invariant_mode_enabled()
    with batch_invariant_mode():
        assert is_batch_invariant_mode_enabled()
        with batch_invariant_mode():
            assert is_batch_invariant_mode_enabled()
        assert is_batch_invariant_mode_enabled()
        with batch_invariant_mode(False):
            assert not is_batch_invariant_mode_enabled()
        assert is_batch_invariant_mode_enabled()
    assert not is_batch_invariant_mode_enabled()
    enable_batch_invariant_mode()
    enable_batch_invariant_mode()
    assert is_batch_invariant_mode_enabled()
    disable_batch_invariant_mode()
    assert not is_batch_invariant_mode_enabled()


def test_an_exception_inside_the_block_restores_the_state():
    with pytest.raises(RuntimeError, match="boom"), batch_invariant_mode():
        raise RuntimeError("boom")
    assert not is_batch_invariant_mode_enabled()
    enable_batch_invariant_mode()
    with pytest.raises(RuntimeError, match="boom"), batch_invariant_mode(False):
        raise RuntimeError("boom")
    assert is_batch_invariant_mode_enabled()


def test_leaving_the_mode_restores_torchs_own_kernels():
    x, w = randn(1, 576, seed=1), randn(1536, 576, seed=2)
    before = F.linear(x, w)
    with batch_invariant_mode():
        inside = F.linear(x, w)
    after = F.linear(x, w)
    assert torch.equal(before, after)
    assert not torch.equal(before, inside)  # M=1: MKL's gemv path differs from the fixed-tile path


def test_torch_ops_are_routed_and_batch_invariant_inside_the_mode():
    x = randn(129, 200, seed=1)
    w = randn(300, 200, seed=2)
    b = randn(300, seed=3)
    norm_w = randn(200, seed=4)
    fns = {
        "linear": lambda t: F.linear(t, w),
        "linear+bias": lambda t: F.linear(t, w, b),
        "matmul 3-D": lambda t: torch.matmul(t[None], w.t())[0],
        "bmm": lambda t: torch.bmm(t[None], w.t()[None])[0],
        "softmax": lambda t: torch.softmax(t, -1),
        "log_softmax": lambda t: F.log_softmax(t, -1),
        "mean": lambda t: t.mean(-1, keepdim=True),
        "rms_norm": lambda t: F.rms_norm(t, (200,), norm_w, 1e-6),
    }
    with batch_invariant_mode():
        for name, fn in fns.items():
            full = fn(x)
            for m in [1, 2, 3, 7, 17, 64, 127, 128]:
                assert torch.equal(fn(x[:m]), full[:m]), f"{name} differs at m={m}"


def test_values_inside_the_mode_match_fp64():
    x, w = randn(17, 33, seed=1), randn(5, 33, seed=2)
    with batch_invariant_mode():
        out = F.linear(x, w)
        sm = torch.softmax(x, -1)
        mean = x.mean(-1)
    fp32 = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), x.double() @ w.double().t(), **fp32)
    torch.testing.assert_close(sm.double(), torch.softmax(x.double(), -1), **fp32)
    torch.testing.assert_close(mean.double(), x.double().mean(-1), **fp32)


def test_autograd_still_works_inside_the_mode():
    x = randn(4, 8, seed=1).requires_grad_()
    w = randn(3, 8, seed=2).requires_grad_()
    with batch_invariant_mode():
        loss = F.log_softmax(F.linear(x, w), -1).mean()
        loss.backward()
    x_ref, w_ref = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.log_softmax(F.linear(x_ref, w_ref), -1).mean().backward()
    torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=1e-5, atol=1e-6)


def test_other_dtypes_fall_through_to_torch():
    a = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    with batch_invariant_mode():
        assert torch.equal(a @ a.t(), torch.tensor([[14, 38, 62], [38, 126, 214], [62, 214, 366]]))
        d = randn(3, 4).double()
        torch.testing.assert_close(d.mean(-1), d.sum(-1) / 4)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_hf_llama_logits_are_batch_invariant_inside_the_mode():
    model = tiny_llama()
    sample = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(1))
    with batch_invariant_mode():
        report = check_batch_invariance(lambda ids: model(ids).logits, sample, trials=6, max_batch_size=12)
    assert report.invariant, str(report)
    assert "batch-invariant" in str(report)


def test_negative_control_hf_llama_varies_without_the_mode():
    # One token alone is a matrix-vector product for MKL; in a batch it is a matrix product: other bits.
    model = tiny_llama()
    sample = torch.tensor([5])
    report = check_batch_invariance(lambda ids: model(ids).logits, sample, trials=6, max_batch_size=12)
    assert not report.invariant
    assert report.max_abs_diff > 0 and "NOT batch-invariant" in str(report)


def test_public_api_is_exported():
    for name in ["batch_invariant_mode", "check_batch_invariance", "ops"]:
        assert hasattr(lockstep, name)
