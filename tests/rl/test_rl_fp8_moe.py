"""The RL trainer over an FP8 mixture-of-experts sampler: a policy whose experts hold full-precision masters and
quantize them in the forward as the engine holds them (``quantization.Fp8ExpertsTrain``) reproduces the engine's
sampled logprobs bit for bit on a tiny Qwen3-MoE (online FP8, online FP8 with the chunk tree, a Qwen3-FP8 block
checkpoint, a compressed-tensors per-channel one), before and after an optimizer step synced with
``LLM.load_weights``. The straight-through backward reaches the experts' masters, finite and nonzero, and equals
the bf16 experts' backward at the dequantized weights. Negative controls: the full-precision policy of the same
weights differs from the FP8 sampler, so does the policy with only its experts unquantized, and the step changes
the answers."""

from pathlib import Path

import pytest
import torch
from fp8_checkpoints import save_fp8
from tiny_models import save_tiny_moe

from lockstep import LLM, SamplingParams
from lockstep.layers.moe import SparseMoeBlock
from lockstep.ops import autograd, fp8, moe
from lockstep.rl import load_policy, token_logprobs

PROMPTS = [[(5 * i + 3 * j) % 95 for j in range(9 + 5 * i)] for i in range(4)]
PARAMS = [SamplingParams(temperature=1.0, seed=21 + i, max_tokens=6 + i, ignore_eos=True) for i in range(4)]
CASES = {
    "online": ("full", {"quantization": "fp8"}),
    "online-tree": ("full", {"quantization": "fp8", "tp_invariant": True}),
    "fp8-block": ("fp8-block", {}),
    "ct-channel": ("ct-channel", {}),
}


def _llm(folder: Path, **kwargs) -> LLM:
    return LLM(str(folder), max_num_batched_tokens=32, max_num_seqs=3, **kwargs)


def _sample(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs) for o in outs]


def _bits(xs) -> bytes:
    return torch.tensor(xs, dtype=torch.float32).numpy().tobytes()


def _same_bits(policy, samples, micro_batch_size: int = 3) -> list[bool]:
    lps = token_logprobs(policy, PROMPTS, [t for t, _ in samples], micro_batch_size=micro_batch_size)
    return [_bits(lp.detach().tolist()) == _bits(lp_s) for lp, (_, lp_s) in zip(lps, samples, strict=True)]


def _blocks(policy) -> list[SparseMoeBlock]:
    return [m for m in policy.modules() if isinstance(m, SparseMoeBlock)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    full = save_tiny_moe(tmp_path_factory.mktemp("moe"), "qwen3_moe")
    out = {"full": full}
    for layout in ("fp8-block", "ct-channel"):
        out[layout] = save_fp8(full, tmp_path_factory.mktemp(layout), layout)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_fp8_moe_trainer_reproduces_the_fp8_sampler(folders, case):
    which, kwargs = CASES[case]
    samples = _sample(_llm(folders[which], **kwargs))
    policy = load_policy(folders[which], **kwargs)
    blocks = _blocks(policy)
    assert blocks and all(b.fp8_train is not None and b.w13.dtype == torch.float32 for b in blocks)
    assert all(_same_bits(policy, samples)), case
    assert all(_same_bits(policy, samples, micro_batch_size=1)), case
    # The loss reaches every expert's masters (and the routers), straight through the quantization.
    lps = token_logprobs(policy, PROMPTS, [t for t, _ in samples])
    sum(lp.sum() for lp in lps).backward()
    for block in blocks:
        for p in (block.gate.weight, block.w13, block.w2):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    # Negative controls: the full-precision policy of the same weights is another model, and so is this policy
    # with its experts' masters unquantized (every other layer still FP8): the experts' FP8 bits are seen.
    plain = load_policy(folders["full"], tp_invariant=kwargs.get("tp_invariant", False))
    assert not any(_same_bits(plain, samples))
    for block in blocks:
        block.fp8_train = None
    assert not any(_same_bits(policy, samples))


@pytest.mark.parametrize("case", ["online", "fp8-block"])
def test_a_step_synced_by_load_weights_keeps_trainer_and_sampler_equal(folders, case):
    which, kwargs = CASES[case]
    llm = _llm(folders[which], **kwargs)
    policy = load_policy(folders[which], **kwargs)
    opt = torch.optim.SGD(policy.parameters(), lr=0.3)
    first = _sample(llm)
    lps = token_logprobs(policy, PROMPTS, [t for t, _ in first], micro_batch_size=2)
    sum(lp.sum() for lp in lps).backward()
    opt.step()
    llm.load_weights(policy.checkpoint_tensors())  # the masters; the engine quantizes them as the trainer does
    samples = _sample(llm)
    assert samples != first  # the step changed the answers
    assert all(_same_bits(policy, samples)), case


@pytest.mark.parametrize("tree", [False, True], ids=["plain", "tree"])
def test_the_straight_through_backward_of_fp8_experts(tree):
    gen = torch.Generator().manual_seed(0)
    e, h, i, n = 4, 48, 24, 9
    x = torch.randn(n, h, generator=gen).requires_grad_(True)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).requires_grad_(True)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).requires_grad_(True)
    weights, ids = moe.route(torch.randn(n, e, generator=gen), 2, True)
    weights.requires_grad_(True)
    q13, q2 = (fp8.quantize_weight(w.detach().reshape(-1, w.shape[2])) for w in (w13, w2))
    quantized = (q13[0].view(w13.shape), q13[1].view(e, 2 * i, 1), q2[0].view(w2.shape), q2[1].view(e, h, 1))
    y = autograd.moe_experts_fp8(x, w13, w2, weights, ids, quantized, None, tree)
    g = torch.randn(n, h, generator=gen)
    (y * g).sum().backward()
    # The bf16 experts' backward at the dequantized weights the forward used.
    deq13 = fp8.dequantize(q13[0], q13[1]).view(w13.shape).requires_grad_(True)
    deq2 = fp8.dequantize(q2[0], q2[1]).view(w2.shape).requires_grad_(True)
    xr, wr = x.detach().requires_grad_(True), weights.detach().requires_grad_(True)
    (moe.experts_reference(xr, deq13, deq2, wr, ids) * g).sum().backward()
    for got, want in ((x.grad, xr.grad), (w13.grad, deq13.grad), (w2.grad, deq2.grad), (weights.grad, wr.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bench_fp8_moe_rl_runs_on_the_cpu(tmp_path) -> None:
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "bench" / "fp8_moe_rl.py"
    done = subprocess.run([sys.executable, str(script), "--tiny", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "fp8_moe_rl.json").read_text())
    assert [r["case"] for r in report["cases"]] == ["online", "online-tree", "fp8-block", "fp8-block-tree"]
    assert all(r["bitwise_equal"] == r["sequences"] and r["grads_ok"] for r in report["cases"])
    assert report["negative_control"]["max_abs_diff"] > 0 and report["failures"] == []


@pytest.mark.parametrize("tree", [False, True], ids=["default", "tree"])
def test_a_patched_transformers_moe_reproduces_an_online_fp8_moe_engine(tmp_path, tree, monkeypatch):
    # transformers' Qwen3-MoE patched with quantization="fp8": its projections and its experts quantized per
    # channel at each forward, as LLM(quantization="fp8") holds them, the router in full precision.
    from types import SimpleNamespace

    from test_hf_model import _assert_engine_bits, _completion_logprobs, _load_hf, _max_diff, _sample
    from tiny_models import TINY_EOS, save_tiny_hf

    from lockstep.rl.hf import layers as hf_layers
    from lockstep.rl.hf import patch_model, sampler_weights

    folder = save_tiny_hf(tmp_path / "moe", "qwen3_moe", seed=6, scale=2.0, bos_token_id=None, eos_token_id=TINY_EOS)
    samples = _sample(folder, quantization="fp8", tp_invariant=tree)
    model = patch_model(_load_hf(folder), tp_invariant=tree)
    assert _max_diff(_completion_logprobs(model, samples, "left"), samples) > 0  # negative control: no FP8
    patch_model(model, tp_invariant=tree, quantization="fp8")
    for layout in ("left", "packed"):
        _assert_engine_bits(_completion_logprobs(model, samples, layout), samples)
    with monkeypatch.context() as m:  # negative control: the FP8 patch with its experts in full precision
        plain = SimpleNamespace(
            fp8_linear=autograd.fp8_linear,
            moe_experts_fp8=lambda x, w13, w2, weights, ids, *_: hf_layers.K.moe_experts(x, w13, w2, weights, ids),
        )
        m.setattr(hf_layers, "autograd", plain)
        assert _max_diff(_completion_logprobs(model, samples, "left"), samples) > 0
    # The straight-through backward reaches every expert master; one step, synced through sampler_weights.
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    sum(lp.sum() for lp in _completion_logprobs(model, samples, "right")).backward()
    experts = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert experts
    for e in experts:
        for w in (e.gate_up_proj, e.down_proj):
            assert w.grad is not None and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0
    opt.step()
    llm = LLM(str(folder), quantization="fp8", tp_invariant=tree, max_num_seqs=4, max_num_batched_tokens=16)
    llm.load_weights(sampler_weights(model))
    prompts = [p for p, _, _ in samples[:4]]
    params = [SamplingParams(temperature=1.0, seed=50 + i, max_tokens=7, ignore_eos=True) for i in range(4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = [(p, o.token_ids, o.token_logprobs) for p, o in zip(prompts, outs, strict=True)]
    _assert_engine_bits(_completion_logprobs(model, after, "left"), after)
