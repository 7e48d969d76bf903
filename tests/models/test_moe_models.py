"""The mixtures of experts, Qwen3-MoE and Mixtral: parity with Hugging Face transformers on tiny random checkpoints,
bitwise batch invariance, and their config and checkpoint checks."""

import json

import pytest
import torch
from paged_runner import PagedRunner
from safetensors.torch import load_file, save_file
from tiny_models import hf_logits, max_rel_err, save_tiny_hf

from lockstep.distributed import Shard, TPGroup
from lockstep.layers.moe import SparseMoeBlock
from lockstep.models.llama import LlamaForCausalLM, LlamaMLP, ModelConfig
from lockstep.models.loader import load_model, read_config

KERNELS = pytest.mark.parametrize("kernels", ["invariant", "default", "torch"])

CASES = {
    # 3 layers, layer 1 dense (mlp_only_layers), top 3 of 8 renormalised.
    "qwen3_moe": dict(arch="qwen3_moe"),
    # decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense; top 2 of 8 not renormalised.
    "qwen3_moe-step2": dict(
        arch="qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False,
        num_experts_per_tok=2,
    ),
    "mixtral": dict(arch="mixtral"),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CASES))
def tiny_moe(request, tmp_path_factory):
    """(case, folder, token ids of two sequences, transformers' logits for each)."""
    folder = save_tiny_hf(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (23, 41)]
    return request.param, folder, seqs, [hf_logits(folder, s) for s in seqs]


def test_configs_are_read_as_transformers_reads_them(tiny_moe):
    case, folder, _, _ = tiny_moe
    config = read_config(folder)
    sparse = [config.is_moe_layer(i) for i in range(config.num_layers)]
    expected = {"qwen3_moe": [True, False, True], "qwen3_moe-step2": [False, True, False, True]}
    assert sparse == expected.get(case, [True, True])
    model = load_model(folder)
    for layer, is_sparse in zip(model.model.layers, sparse, strict=True):
        assert isinstance(layer.mlp, SparseMoeBlock if is_sparse else LlamaMLP)
    assert config.qk_norm == case.startswith("qwen3")
    assert config.norm_topk_prob == (case != "qwen3_moe-step2")


@KERNELS
def test_tiny_moe_matches_transformers_in_a_mixed_batch(tiny_moe, kernels):
    _, folder, (a, b), (ref_a, ref_b) = tiny_moe
    model = load_model(folder, kernels=kernels)
    runner = PagedRunner(model, block_size=4)
    # A prefill beside a chunk, then a decode beside a middle chunk, then a decode alone.
    h1a, h1b = runner.forward([("a", a[:-1], 0), ("b", b[:17], 0)])
    h2a, h2b = runner.forward([("a", a[-1:], len(a) - 1), ("b", b[17:-1], 17)])
    (h3b,) = runner.forward([("b", b[-1:], len(b) - 1)])
    assert max_rel_err(model.compute_logits(torch.cat([h1a, h2a])), ref_a) <= 1e-4
    assert max_rel_err(model.compute_logits(torch.cat([h1b, h2b, h3b])), ref_b) <= 1e-4


def test_bf16_runs_close_to_fp32(tiny_moe):
    _, folder, (a, _), (ref_a, _) = tiny_moe
    model = load_model(folder, dtype=torch.bfloat16)
    ours = PagedRunner(model).prefill_logits("a", a).double()
    # In norm rather than elementwise: a near-tie in the router may pick another expert in bf16.
    assert (ours - ref_a.double()).norm() / ref_a.double().norm() <= 3e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_tiny_moe_is_batch_invariant(tiny_moe, dtype):
    _, folder, (a, b), _ = tiny_moe
    model = load_model(folder, dtype=dtype)
    alone = model.compute_logits(PagedRunner(model).forward([("a", a, 0)])[0])
    runner = PagedRunner(model, block_order=list(range(63, -1, -1)))
    runner.forward([("b", b[:17], 0)])
    _, hidden = runner.forward([("b", b[17:], 17), ("a", a, 0)])
    batched = model.compute_logits(hidden)
    assert torch.equal(alone, batched), f"{int((alone != batched).sum())} logits differ"
    # Decoding the last token reproduces the prefill's row.
    runner = PagedRunner(model)
    runner.forward([("a", a[:-1], 0)])
    (last,) = runner.forward([("a", a[-1:], len(a) - 1)])
    assert torch.equal(model.compute_logits(last), alone[-1:])


def test_default_kernels_on_moe_depend_on_the_batch(tiny_moe):
    # Negative control: torch's per-expert F.linear picks its CPU kernel from the number of tokens at the expert.
    _, folder, (a, _), _ = tiny_moe
    model = load_model(folder, kernels="default")
    full = PagedRunner(model).prefill_logits("a", a)
    runner = PagedRunner(model)
    runner.forward([("a", a[:-1], 0)])
    (last,) = runner.forward([("a", a[-1:], len(a) - 1)])
    assert not torch.equal(model.compute_logits(last), full[-1:])


# --- configs and checkpoints -----------------------------------------------------------------------------------


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.fixture
def moe_copy(tmp_path):
    return save_tiny_hf(tmp_path / "moe", "qwen3_moe")


def test_released_qwen3_moe_configs_name_num_experts(moe_copy):
    config = json.loads((moe_copy / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")  # how Qwen3-30B-A3B's config.json spells it
    (moe_copy / "config.json").write_text(json.dumps(config))
    assert read_config(moe_copy).num_experts == 8


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(num_experts_per_tok=9), r"num_experts_per_tok must be in \[1, num_experts=8\], got 9"),
        (dict(num_local_experts=0), "num_experts=0"),
        (dict(decoder_sparse_step=0), "decoder_sparse_step must be >= 1"),
        (dict(use_sliding_window=True), "use_sliding_window"),
    ],
)
def test_bad_moe_configs_raise(moe_copy, changes, message):
    _edit_config(moe_copy, **changes)
    with pytest.raises(ValueError, match=message):
        load_model(moe_copy)


def test_missing_expert_tensor_is_named(moe_copy):
    weights = load_file(moe_copy / "model.safetensors")
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, moe_copy / "model.safetensors", {"format": "pt"})
    with pytest.raises(ValueError, match="missing tensor.*'model.layers.2.mlp.experts.5.up_proj.weight'"):
        load_model(moe_copy)


def test_expert_shape_mismatch_is_named(moe_copy):
    _edit_config(moe_copy, moe_intermediate_size=20)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.experts.0.\w+_proj.weight' has shape"):
        load_model(moe_copy)


def test_checkpoint_names_map_onto_the_stacked_experts(moe_copy):
    model = load_model(moe_copy)
    weights = load_file(moe_copy / "model.safetensors")
    block = model.model.layers[2].mlp
    assert torch.equal(block.w13[5, :24], weights["model.layers.2.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(block.w13[5, 24:], weights["model.layers.2.mlp.experts.5.up_proj.weight"])
    assert torch.equal(block.w2[5], weights["model.layers.2.mlp.experts.5.down_proj.weight"])
    assert torch.equal(block.gate.weight, weights["model.layers.2.mlp.gate.weight"])
    assert set(model.checkpoint_tensors()) == set(weights)


def test_moe_under_tensor_parallelism_splits_every_expert(moe_copy):
    # Rank 1 of 2 holds 12 of the 24 intermediate columns of each of the 8 experts; the router stays whole
    # (tests/models/test_moe_tp.py runs the ranks).
    model = LlamaForCausalLM(read_config(moe_copy), tp=TPGroup(rank=1, size=2), device="meta")
    block = model.model.layers[2].mlp
    assert block.w13.shape == (8, 24, 64) and block.w2.shape == (8, 64, 12) and block.gate.weight.shape == (8, 64)
    shards = model.checkpoint_shards()
    assert shards["model.layers.2.mlp.experts.5.up_proj.weight"] == Shard(0, 12, 24, 24)
    assert shards["model.layers.2.mlp.experts.5.down_proj.weight"] == Shard(1, 12, 24, 24)
    assert "model.layers.2.mlp.gate.weight" not in shards


def test_a_dense_architecture_with_experts_is_refused():
    with pytest.raises(ValueError, match="LlamaForCausalLM with num_experts=4"):
        ModelConfig("LlamaForCausalLM", 97, 64, 80, 2, 4, 2, 16, 1e-6, num_experts=4, num_experts_per_tok=2)
