"""The RL trainer over an FP8 sampler: a policy with full-precision master weights whose forward quantizes them as
the engine holds them reproduces the engine's sampled logprobs bit for bit (online FP8, a Qwen3-FP8 block
checkpoint, a compressed-tensors per-channel one, and online FP8 with the chunk tree), before and after optimizer
steps synced with ``LLM.load_weights``; after the sync the engine answers as a fresh engine of those weights does.
The straight-through backward has the gradients it documents. A transformers model patched with
``patch_model(quantization="fp8")`` reproduces an online-FP8 engine too, before and after a step synced with
``sampler_weights``. Negative controls: a full-precision policy (or patch) differs from the FP8 sampler, and the
steps do change the answers."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import save_fp8
from safetensors.torch import load_file, save_file

from lockstep import LLM, SamplingParams
from lockstep.ops import autograd, fp8
from lockstep.rl import load_policy, token_logprobs

PROMPTS = [[(5 * i + 3 * j) % 95 for j in range(9 + 5 * i)] for i in range(4)]
PARAMS = [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=6 + i, ignore_eos=True) for i in range(4)]
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


def _same_bits(policy, samples) -> list[bool]:
    lps = token_logprobs(policy, PROMPTS, [tokens for tokens, _ in samples], micro_batch_size=3)
    return [_bits(lp.detach().tolist()) == _bits(lp_s) for lp, (_, lp_s) in zip(lps, samples, strict=True)]


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    out = {"full": tiny_model_dir}
    for layout in ("fp8-block", "ct-channel"):
        out[layout] = save_fp8(tiny_model_dir, tmp_path_factory.mktemp(layout), layout)
    return out


def _fresh_folder(policy, source: Path, dst: Path) -> Path:
    """A checkpoint of the policy's weights as the engine holds them: its master weights (online FP8: the engine
    quantizes them when it loads); for an FP8 checkpoint, the masters quantized with the checkpoint's own scales
    (``fp8.quantize_with_scales``, computed here from the source files, not by the engine)."""
    dst.mkdir()
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    masters = {k: v.detach().clone() for k, v in policy.checkpoint_tensors().items()}
    tensors = load_file(source / "model.safetensors")
    if json.loads((source / "config.json").read_text()).get("quantization_config") is None:
        out = masters
    else:
        out = dict(tensors)  # the scales as they are
        for name, t in tensors.items():
            if t.dtype != fp8.FP8:
                out[name] = masters.get(name, t)
                continue
            prefix = name.removesuffix(".weight")
            scale = tensors.get(f"{prefix}.weight_scale_inv", tensors.get(f"{prefix}.weight_scale")).float()
            rows = fp8.expand_block_scale(scale, t.shape[0], 128) if scale.shape[0] != t.shape[0] else scale
            out[name] = fp8.quantize_with_scales(masters[name], rows)
    save_file({k: v.contiguous() for k, v in out.items()}, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("case", list(CASES))
def test_the_fp8_trainer_reproduces_the_fp8_sampler(folders, case):
    which, kwargs = CASES[case]
    llm = _llm(folders[which], **kwargs)
    samples = _sample(llm)
    policy = load_policy(folders[which], **kwargs)
    q = policy.model.layers[0].self_attn.qkv_proj
    assert q.weight.dtype == torch.float32 and q.weight.requires_grad and q.fp8_train is not None
    assert all(_same_bits(policy, samples)), case
    # Negative control: the full-precision policy of the same weights is another model.
    plain = load_policy(folders["full"], tp_invariant=kwargs.get("tp_invariant", False))
    assert not any(_same_bits(plain, samples))


@pytest.mark.parametrize("case", list(CASES))
def test_steps_synced_by_load_weights_keep_trainer_and_sampler_equal(folders, case, tmp_path):
    which, kwargs = CASES[case]
    llm = _llm(folders[which], **kwargs)
    policy = load_policy(folders[which], **kwargs)
    opt = torch.optim.SGD(policy.parameters(), lr=0.3)
    first = samples = _sample(llm)
    for _ in range(2):
        lps = token_logprobs(policy, PROMPTS, [tokens for tokens, _ in samples], micro_batch_size=2)
        opt.zero_grad()
        sum(lp.sum() for lp in lps).backward()
        assert policy.model.layers[1].mlp.down_proj.weight.grad.abs().sum() > 0
        opt.step()
        llm.load_weights(policy.checkpoint_tensors())
        samples = _sample(llm)
        assert all(_same_bits(policy, samples)), case
    assert samples != first  # the steps changed the answers
    fresh_folder = _fresh_folder(policy, folders[which], tmp_path / "fresh")
    assert _sample(_llm(fresh_folder, **kwargs)) == samples
    if which != "full":  # the FP8 tensors and the checkpoint's scales, loaded as they are
        other = _llm(folders[which], **kwargs)
        other.load_weights(load_file(fresh_folder / "model.safetensors"))
        assert _sample(other) == samples


def test_the_straight_through_backward():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 200, generator=gen, dtype=torch.float64).float().requires_grad_(True)
    master = (torch.randn(30, 200, generator=gen) / 10).requires_grad_(True)
    bias = torch.randn(30, generator=gen).requires_grad_(True)
    w8, scale = fp8.quantize_weight(master.detach())
    y = autograd.fp8_linear(x, master, bias, w8, scale, None)
    assert torch.equal(y, fp8.fp8_linear(x.detach(), w8, scale, bias.detach(), None))  # the forward's bits
    g = torch.randn(5, 30, generator=gen)
    (y * g).sum().backward()
    deq = fp8.dequantize(w8, scale).double()
    torch.testing.assert_close(x.grad.double(), g.double() @ deq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(master.grad.double(), g.double().t() @ x.detach().double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bias.grad, g.sum(0))
    assert not torch.allclose(x.grad.double(), g.double() @ master.detach().double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tree", [False, True], ids=["default", "tree"])
def test_a_patched_transformers_model_reproduces_an_online_fp8_engine(tmp_path, tree):
    from test_hf_model import _assert_engine_bits, _completion_logprobs, _load_hf, _max_diff, _sample
    from tiny_models import TINY_EOS, save_tiny_hf

    from lockstep.rl.hf import patch_model, sampler_weights

    folder = save_tiny_hf(tmp_path / "qwen3", "qwen3", seed=6, scale=2.0, bos_token_id=None, eos_token_id=TINY_EOS)
    samples = _sample(folder, quantization="fp8", tp_invariant=tree)
    model = patch_model(_load_hf(folder), tp_invariant=tree)
    assert _max_diff(_completion_logprobs(model, samples, "left"), samples) > 0  # negative control: no FP8
    patch_model(model, tp_invariant=tree, quantization="fp8")
    for layout in ("left", "packed"):
        _assert_engine_bits(_completion_logprobs(model, samples, layout), samples)
    # One step, synced through sampler_weights: the engine re-quantizes, the trainer quantizes alike.
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    sum(lp.sum() for lp in _completion_logprobs(model, samples, "right")).backward()
    opt.step()
    llm = LLM(str(folder), quantization="fp8", tp_invariant=tree, max_num_seqs=4, max_num_batched_tokens=16)
    llm.load_weights(sampler_weights(model))
    prompts = [p for p, _, _ in samples[:4]]
    params = [SamplingParams(temperature=1.0, seed=50 + i, max_tokens=7, ignore_eos=True) for i in range(4)]
    after = [(p, o.token_ids, o.token_logprobs) for p, o in zip(prompts, llm.generate(prompts, params, use_tqdm=False),
                                                                strict=True)]  # fmt: skip
    _assert_engine_bits(_completion_logprobs(model, after, "left"), after)
