"""FP8 layers under tensor parallelism (2 and 4 gloo processes): each rank loads its slice of the weights and of
their scales, and with the chunk tree the logits are bitwise those of one process with the tree, for a Qwen3-FP8
block checkpoint (128 x 128 blocks, per-128 activations), a compressed-tensors per-channel one (per-token
activations, whose scales span the ranks' columns) and online FP8 (per-channel scales computed from the whole
matrix on each rank). Negative controls: the same sharded FP8 model with a plain all-reduce, and one process
without the tree, differ. A block size that the shards or the tree's chunks cut is refused by name."""

import pytest
import torch
from fp8_checkpoints import save_fp8
from paged_runner import PagedRunner
from safetensors.torch import load_file
from tiny_models import max_rel_err, save_tiny_hf
from tp_spawn import run_ranks

from lockstep.distributed import TPGroup
from lockstep.models.loader import load_model
from lockstep.ops import fp8

# 16 heads of 64 and an MLP of 1024: o_proj's and down_proj's K of 1024 make the tree's 8 chunks whole 128-column
# blocks. 2 KV heads of 64 rows: at TP 2 each rank's K/V rows start inside a 128-row scale block (rank 1 at row 64).
SHAPE = dict(hidden_size=64, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=2, head_dim=64)
LAYOUTS = ("fp8-block", "ct-channel", "online")
TP_SIZES = [2, 4]


def _sequences() -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(3)
    return tuple(torch.randint(0, 97, (n,), generator=gen).tolist() for n in (19, 30))


def run_model(tp: TPGroup, folder: str, quantization: str | None, tp_invariant: bool) -> torch.Tensor:
    """Logits of a two-step mixed batch (prefill + chunk, then decode + the rest)."""
    a, b = _sequences()
    model = load_model(folder, tp=tp, tp_invariant=tp_invariant, quantization=quantization)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == fp8.FP8
    runner = PagedRunner(model, block_size=4)
    h1a, h1b = runner.forward([("a", a[:-1], 0), ("b", b[:11], 0)])
    h2a, h2b = runner.forward([("a", a[-1:], len(a) - 1), ("b", b[11:], 11)])
    return model.compute_logits(torch.cat([h1a, h2a, h1b, h2b]))


def run_layouts(tp: TPGroup, folders: dict[str, tuple[str, str | None]]) -> dict:
    out = {name: run_model(tp, folder, q, True) for name, (folder, q) in folders.items()}
    out["all-reduce"] = run_model(tp, *folders["fp8-block"], False)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[str, str | None]]:
    full = save_tiny_hf(tmp_path_factory.mktemp("qwen3-wide"), "qwen3", **SHAPE)
    out = {"online": (str(full), "fp8")}
    for layout in ("fp8-block", "ct-channel"):
        out[layout] = (str(save_fp8(full, tmp_path_factory.mktemp(layout), layout)), None)
    return out


@pytest.fixture(scope="module")
def one_process(folders) -> dict:
    return run_layouts(TPGroup(), folders)


@pytest.fixture(scope="module", params=TP_SIZES, ids=[f"tp{n}" for n in TP_SIZES])
def ranks(request, folders) -> tuple[int, list[dict]]:
    return request.param, run_ranks(run_layouts, request.param, folders)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_logits_do_not_depend_on_the_tp_size(ranks, one_process, layout):
    size, results = ranks
    expected = one_process[layout]
    for rank, res in enumerate(results):
        got = res[layout]
        assert torch.equal(got, expected), f"TP {size} rank {rank}: {int((got != expected).sum())} logits differ"


def test_negative_control_fp8_all_reduce_depends_on_the_tp_size(ranks, one_process):
    size, results = ranks
    plain, reference = results[0]["all-reduce"], one_process["all-reduce"]
    assert not torch.equal(plain, reference), f"TP {size}: the all-reduce matched: the check proves nothing"
    assert max_rel_err(plain, reference) <= 2e-2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_negative_control_one_process_without_the_tree_differs(one_process, folders, layout):
    ordinary = run_model(TPGroup(), *folders[layout], False)
    tree = one_process[layout]
    assert not torch.equal(ordinary, tree)
    # other numerics of the same model (a sum that rounds otherwise can flip an activation's e4m3 rounding)
    assert max_rel_err(ordinary, tree) <= 2e-2


def test_a_rank_loads_its_slice_of_the_scales(folders):
    # Rank 1 of 2 without processes (loading needs no collectives for a checkpoint's scales).
    folder = folders["fp8-block"][0]
    tensors = load_file(f"{folder}/model.safetensors")
    model = load_model(folder, tp=TPGroup(rank=1, size=2))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    pre = "model.layers.0"
    q, k, _ = attn.qkv_proj.weight_scale.split(attn.qkv_proj.out_parts)
    full_q = fp8.expand_block_scale(tensors[f"{pre}.self_attn.q_proj.weight_scale_inv"], 1024, 128)
    full_k = fp8.expand_block_scale(tensors[f"{pre}.self_attn.k_proj.weight_scale_inv"], 128, 128)
    assert torch.equal(q, full_q[512:])
    assert torch.equal(k, full_k[64:])  # rows 64..128: the second half of one scale block
    down = tensors[f"{pre}.mlp.down_proj.weight_scale_inv"]  # [1, 8]: columns 512.. are blocks 4..8
    assert torch.equal(mlp.down_proj.weight_scale, fp8.expand_block_scale(down[:, 4:], 64, 128))
    w8 = tensors[f"{pre}.mlp.down_proj.weight"][:, 512:]
    assert torch.equal(mlp.down_proj.weight.view(torch.uint8), w8.view(torch.uint8))


def test_block_sizes_that_do_not_fit_are_refused(tiny_model_dir, tmp_path):
    # The tiny Llama's o_proj has K = 64: the tree's chunks of 8 columns are not 128-column scale blocks.
    block = save_fp8(tiny_model_dir, tmp_path / "block", "fp8-block")
    with pytest.raises(ValueError, match=r"o_proj: the FP8 chunk tree cuts K=64 into 8 chunks of 8 columns"):
        load_model(block, tp_invariant=True)
    # Per-channel scales with per-token activations have no block to cut: the same model runs the tree.
    channel = load_model(save_fp8(tiny_model_dir, tmp_path / "channel", "ct-channel"), tp_invariant=True)
    assert channel.model.layers[0].self_attn.o_proj.tree
    # Dummy weights in a block layout are quantized on each rank: a rank whose rows start mid-block is refused.
    with pytest.raises(ValueError, match=r"k_proj|qkv_proj.*inside a 128-row FP8 scale block"):
        wide = save_fp8(save_tiny_hf(tmp_path / "wide", "qwen3", **SHAPE), tmp_path / "wide-block", "fp8-block")
        load_model(wide, tp=TPGroup(rank=1, size=2), load_format="dummy")
