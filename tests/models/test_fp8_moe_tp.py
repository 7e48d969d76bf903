"""FP8 experts under tensor parallelism (2 and 4 gloo processes): each rank loads its I / N of every expert with
its slice of the scales (the gate and up projections' rows, block scales cut at the rank's first row; the down
projection's K blocks), and with the chunk tree the logits are bitwise those of one process with the tree, alone
and in a mixed prefill + chunk + decode batch, for a Qwen3-MoE FP8 block checkpoint (128 x 128 blocks, per-128
activations; experts of 1024, and Qwen3-30B-A3B's 768, whose tree chunks cut the blocks and whose ranks at TP 4
hold 192 columns each, sharing a block and its scale with a neighbour, the group maxima of the activations
gathered), a compressed-tensors per-channel one (per-token activations between the expert matmuls, whose scales
span the ranks' columns) and online FP8. Negative controls: the sharded FP8 experts with a plain all-reduce depend
on the TP size (also at 768, whose TP 4 ranks then compute their down projections in pieces of one block), and one
process without the tree differs from the tree."""

import pytest
import torch
from fp8_checkpoints import save_fp8
from paged_runner import PagedRunner
from safetensors.torch import load_file
from tiny_models import max_rel_err, save_tiny_moe
from tp_spawn import run_ranks

from lockstep.distributed import Shard, TPGroup
from lockstep.layers.moe import SparseMoeBlock
from lockstep.models.loader import load_model
from lockstep.models.quantization import fp8_scheme, load_full_precision
from lockstep.ops import fp8

# As tests/models/test_fp8_tp.py: 16 heads of 64 and MLPs of 1024 (the experts' I, the dense layer 1's), so every
# row-parallel K is 1024 and the tree's 8 chunks are whole 128-column blocks. 4 experts, top 2.
SHAPE = dict(
    hidden_size=64, intermediate_size=1024, moe_intermediate_size=1024, num_attention_heads=16,
    num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2,
)  # fmt: skip
LAYOUTS = ("fp8-block", "ct-channel", "online", "fp8-block-768", "dummy-768")
TP_SIZES = [2, 4]
# Qwen3-30B-A3B's experts are 768 wide: the tree's chunks of 96 cut the 128-column blocks (computed in pieces), and
# at TP 4 so do the ranks' 192 columns (TP 8, 96 a rank: tests/ops/test_moe_fp8_tree.py's simulated ranks).
PLAIN = ("ct-channel", "fp8-block-768")  # the layouts also run without the tree (the all-reduce)


def _sequences() -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(5)
    return tuple(torch.randint(0, 97, (n,), generator=gen).tolist() for n in (13, 21))


def run_model(tp: TPGroup, folder: str, how: str | None, tp_invariant: bool) -> dict[str, torch.Tensor]:
    """Logits of a two-step mixed batch (a prefills, b its first chunk; then a decodes, b the rest), and of a
    prefilled alone. ``how``: None (the checkpoint as it is), "fp8" (online FP8) or "dummy" (random weights in the
    checkpoint's FP8 layout, quantized on each rank)."""
    a, b = _sequences()
    load = dict(quantization=how) if how != "dummy" else dict(load_format="dummy")
    model = load_model(folder, tp=tp, tp_invariant=tp_invariant, **load)
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and block.w13.dtype == fp8.FP8 and block.w2.dtype == fp8.FP8
    runner = PagedRunner(model, block_size=4)
    h1a, h1b = runner.forward([("a", a[:-1], 0), ("b", b[:9], 0)])
    h2a, h2b = runner.forward([("a", a[-1:], len(a) - 1), ("b", b[9:], 9)])
    batch = model.compute_logits(torch.cat([h1a, h2a, h1b, h2b]))
    alone = model.compute_logits(PagedRunner(model, block_size=4).forward([("a", a, 0)])[0])
    return dict(batch=batch, alone=alone)


def run_layouts(tp: TPGroup, folders: dict[str, tuple[str, str | None]]) -> dict:
    out = {name: run_model(tp, folder, q, True) for name, (folder, q) in folders.items()}
    for name in PLAIN:
        out[f"all-reduce {name}"] = run_model(tp, *folders[name], False)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[str, str | None]]:
    full = save_tiny_moe(tmp_path_factory.mktemp("moe-wide"), "qwen3_moe", **SHAPE)
    out = {"online": (str(full), "fp8")}
    for layout in ("fp8-block", "ct-channel"):
        out[layout] = (str(save_fp8(full, tmp_path_factory.mktemp(layout), layout)), None)
    narrow = save_tiny_moe(tmp_path_factory.mktemp("moe-768"), "qwen3_moe", **(SHAPE | {"moe_intermediate_size": 768}))
    out["fp8-block-768"] = (str(save_fp8(narrow, tmp_path_factory.mktemp("fp8-block-768"), "fp8-block")), None)
    # Random weights in the block layout, quantized on each rank: the experts' block scales from gathered maxima
    # where the ranks cut blocks. KV heads of 128 rows (Qwen3-30B-A3B's), so no rank's k/v rows start mid-block.
    heads = SHAPE | dict(moe_intermediate_size=768, num_attention_heads=8, num_key_value_heads=4, head_dim=128)
    dummy = save_tiny_moe(tmp_path_factory.mktemp("moe-768-kv128"), "qwen3_moe", **heads)
    out["dummy-768"] = (str(save_fp8(dummy, tmp_path_factory.mktemp("dummy-768"), "fp8-block")), "dummy")
    return out


@pytest.fixture(scope="module")
def one_process(folders) -> dict:
    return run_layouts(TPGroup(), folders)


@pytest.fixture(scope="module", params=TP_SIZES, ids=[f"tp{n}" for n in TP_SIZES])
def ranks(request, folders) -> tuple[int, list[dict]]:
    return request.param, run_ranks(run_layouts, request.param, folders)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_expert_logits_do_not_depend_on_the_tp_size(ranks, one_process, layout):
    size, results = ranks
    expected = one_process[layout]
    a = len(_sequences()[0])
    assert torch.equal(expected["batch"][:a], expected["alone"])  # batched and chunked = alone, in one process
    for rank, res in enumerate(results):
        for run in ("batch", "alone"):
            got, want = res[layout][run], expected[run]
            assert torch.equal(got, want), f"TP {size} rank {rank} {run}: {int((got != want).sum())} logits differ"


@pytest.mark.parametrize("layout", PLAIN)
def test_negative_control_fp8_experts_all_reduce_depends_on_the_tp_size(ranks, one_process, layout):
    size, results = ranks
    plain, reference = results[0][f"all-reduce {layout}"]["batch"], one_process[f"all-reduce {layout}"]["batch"]
    assert not torch.equal(plain, reference), f"TP {size}: the all-reduce matched: the check proves nothing"
    # 3e-7 (ct-channel), 4e-7 (768 at TP 2); 5.2e-2 at TP 4 of 768, where an activation's e4m3 rounding flips
    # (the experts alone: ~1e-7, tests/ops/test_moe_fp8_tree.py's fast-mode check).
    assert max_rel_err(plain, reference) <= 1e-1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_negative_control_one_process_without_the_tree_differs(one_process, folders, layout):
    ordinary = run_model(TPGroup(), *folders[layout], False)["batch"]
    tree = one_process[layout]["batch"]
    assert not torch.equal(ordinary, tree)
    # Other numerics of the same model: a sum that rounds otherwise can flip an activation's e4m3 rounding, which
    # the tiny peaked model carries to its logits (4e-7 to 5.2e-2 seen across these layouts; the experts alone
    # differ by ~1e-7, tests/ops/test_moe_fp8_tree.py).
    assert max_rel_err(ordinary, tree) <= 1e-1


def test_a_rank_loads_its_slice_of_the_expert_scales(folders):
    # Rank 1 of 4 without processes (a checkpoint's scales need no collectives to load): rows 256..512 of each
    # gate and up projection, the second half of the 128-row block scales' rows 0..4; K blocks 2..4 of down's.
    folder = folders["fp8-block"][0]
    tensors = load_file(f"{folder}/model.safetensors")
    block = load_model(folder, tp=TPGroup(rank=1, size=4)).model.layers[0].mlp
    pre = "model.layers.0.mlp.experts"
    assert block.w13.shape == (4, 512, 64) and block.w2.shape == (4, 64, 256)
    for e in range(4):
        for part, proj in enumerate(("gate_proj", "up_proj")):
            rows = slice(part * 256, (part + 1) * 256)
            full = fp8.expand_block_scale(tensors[f"{pre}.{e}.{proj}.weight_scale_inv"], 1024, 128)
            assert torch.equal(block.w13_scale[e, rows], full[256:512])
            w8 = tensors[f"{pre}.{e}.{proj}.weight"][256:512]
            assert torch.equal(block.w13[e, rows].view(torch.uint8), w8.view(torch.uint8))
        down = tensors[f"{pre}.{e}.down_proj.weight_scale_inv"]  # [1, 8]
        assert torch.equal(block.w2_scale[e], fp8.expand_block_scale(down[:, 2:4], 64, 128))
        w8 = tensors[f"{pre}.{e}.down_proj.weight"][:, 256:512]
        assert torch.equal(block.w2[e].view(torch.uint8), w8.view(torch.uint8))
    # I = 768, rank 1 of 4: rows 192..384, from the middle of block row 1 into block row 2; down's columns 192..384
    # cut K block 1 (shared with rank 0, its scale held by both) and end with block 2 whole.
    folder = folders["fp8-block-768"][0]
    tensors = load_file(f"{folder}/model.safetensors")
    block = load_model(folder, tp=TPGroup(rank=1, size=4), tp_invariant=True).model.layers[0].mlp
    assert block.w13.shape == (4, 384, 64) and block.w2.shape == (4, 64, 192) and block.w2_scale.shape == (4, 64, 2)
    for e in range(4):
        for part, proj in enumerate(("gate_proj", "up_proj")):
            full = fp8.expand_block_scale(tensors[f"{pre}.{e}.{proj}.weight_scale_inv"], 768, 128)
            assert torch.equal(block.w13_scale[e, part * 192 : (part + 1) * 192], full[192:384])
        down = tensors[f"{pre}.{e}.down_proj.weight_scale_inv"]  # [1, 6]
        assert torch.equal(block.w2_scale[e], fp8.expand_block_scale(down[:, 1:3], 64, 128))
    # LLM.load_weights of full-precision weights into this rank: its mid-block K slice quantized with its blocks'
    # scales gives back the checkpoint's e4m3 values (the slice's first 64 columns are block 1's last 64).
    w8 = tensors[f"{pre}.0.down_proj.weight"]
    full = fp8.dequantize(w8, fp8.expand_block_scale(tensors[f"{pre}.0.down_proj.weight_scale_inv"], 64, 128))
    dest = torch.empty(64, 192, dtype=fp8.FP8)
    scheme = fp8_scheme({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    load_full_precision(dest, full, Shard(1, 192, 384, 768), block.w2_scale[0], None, scheme)
    assert torch.equal(dest.view(torch.uint8), w8[:, 192:384].view(torch.uint8))
    unaligned = fp8.quantize_with_scales(full[:, 192:384], block.w2_scale[0])  # negative control: read from 0
    assert not torch.equal(unaligned.view(torch.uint8), w8[:, 192:384].view(torch.uint8))


def test_expert_sizes_the_tree_cannot_cut_are_refused(tmp_path, folders):
    # I = 20: not 8 chunks. I = 24 at TP 2: a rank's 12 columns cut the one 128-column block, which both hold.
    odd = save_tiny_moe(tmp_path / "odd", "qwen3_moe", **(SHAPE | dict(moe_intermediate_size=20)))
    with pytest.raises(ValueError, match=r"mlp.experts: the FP8 chunk tree needs .* a multiple of 8, got 20"):
        load_model(save_fp8(odd, tmp_path / "odd-block", "fp8-block"), tp_invariant=True)
    narrow = save_tiny_moe(tmp_path / "small", "qwen3_moe", **(SHAPE | dict(moe_intermediate_size=24)))
    small = save_fp8(narrow, tmp_path / "small-block", "fp8-block")
    tensors = load_file(f"{small}/model.safetensors")
    block = load_model(small, tp=TPGroup(rank=1, size=2), tp_invariant=False).model.layers[0].mlp
    down = tensors["model.layers.0.mlp.experts.2.down_proj.weight_scale_inv"]  # [1, 1]
    assert torch.equal(block.w2_scale[2], fp8.expand_block_scale(down, 64, 128))
    assert load_model(small, tp_invariant=True).model.layers[0].mlp.tree  # one process: chunks of 3 in one block
    # Per-channel scales with per-token activations have no block to cut: any I' runs.
    channel = save_fp8(narrow, tmp_path / "small-channel", "ct-channel")
    assert load_model(channel, tp=TPGroup(rank=1, size=2), tp_invariant=True).model.layers[0].mlp.tree
