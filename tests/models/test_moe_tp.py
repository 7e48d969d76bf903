"""Mixtures of experts sharded over 2 and 4 gloo processes, every expert split along its intermediate dimension:
the logits are bitwise equal to one process with the chunk tree (the experts' down projections reduced through
it), alone and in a mixed batch. Negative controls: a plain all-reduce of the ranks' expert outputs depends on the
TP size, and one process without the tree is other bits."""

import pytest
import torch
from test_llama_tp import assert_every_rank_matches, run_model
from tiny_models import max_rel_err, save_tiny_moe
from tp_spawn import run_ranks

from lockstep.distributed import TPGroup
from lockstep.models.loader import load_model

TP_SIZES = [2, 4]
# Qwen3-MoE: experts 24 wide (3 per chunk), a dense layer among sparse ones; Mixtral: experts 80 wide.
CASES = [("qwen3_moe", torch.float32), ("qwen3_moe", torch.bfloat16), ("mixtral", torch.float32)]


def run_cases(tp: TPGroup, folders: dict[str, str]) -> dict:
    """Every case with the chunk tree at this TP size, and the fp32 cases with a plain all-reduce."""
    out = {(arch, dtype): run_model(tp, folders[arch], dtype, True) for arch, dtype in CASES}
    for arch in folders:
        out[(arch, "all-reduce")] = run_model(tp, folders[arch], torch.float32, False)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return {arch: str(save_tiny_moe(tmp_path_factory.mktemp(f"tp-{arch}"), arch)) for arch in ("qwen3_moe", "mixtral")}


@pytest.fixture(scope="module")
def one_process(folders) -> dict:
    return run_cases(TPGroup(), folders)


@pytest.fixture(scope="module", params=TP_SIZES, ids=[f"tp{n}" for n in TP_SIZES])
def ranks(request, folders) -> tuple[int, list[dict]]:
    return request.param, run_ranks(run_cases, request.param, folders)


@pytest.mark.parametrize("case", CASES, ids=[f"{arch}-{str(dtype)[6:]}" for arch, dtype in CASES])
def test_moe_logits_do_not_depend_on_the_tp_size(ranks, one_process, case):
    assert_every_rank_matches(ranks, one_process, case)


def test_a_plain_all_reduce_of_the_experts_depends_on_the_tp_size(ranks, one_process, folders):
    # Negative control: the same sharded experts, their combined outputs summed by an all-reduce.
    size, results = ranks
    differs = []
    for arch in folders:
        plain, single = results[0][(arch, "all-reduce")]["batch"], one_process[(arch, "all-reduce")]["batch"]
        assert max_rel_err(plain, single) <= 1e-4
        differs.append(not torch.equal(plain, single))
    assert any(differs), f"TP {size}: the all-reduce matched one process everywhere: the check proves nothing"


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_tree_is_close_to_the_ordinary_experts_and_other_bits(one_process, folders, arch):
    tree = one_process[(arch, torch.float32)]["batch"]
    ordinary = one_process[(arch, "all-reduce")]["batch"]  # one process, no tree: the model as it was
    assert max_rel_err(tree, ordinary) <= 1e-4
    assert not torch.equal(tree, ordinary)


def test_a_rank_loads_only_its_expert_slices(folders):
    from safetensors.torch import load_file

    full = load_file(str(folders["mixtral"]) + "/model.safetensors")
    model = load_model(folders["mixtral"], tp=TPGroup(rank=1, size=4))  # no collectives while loading
    block = model.model.layers[1].mlp
    prefix = "model.layers.1.block_sparse_moe"
    assert block.w13.shape == (4, 40, 64) and block.w2.shape == (4, 64, 20)
    assert torch.equal(block.gate.weight, full[f"{prefix}.gate.weight"])  # the router is replicated
    for e in range(4):
        assert torch.equal(block.w13[e, :20], full[f"{prefix}.experts.{e}.w1.weight"][20:40])
        assert torch.equal(block.w13[e, 20:], full[f"{prefix}.experts.{e}.w3.weight"][20:40])
        assert torch.equal(block.w2[e], full[f"{prefix}.experts.{e}.w2.weight"][:, 20:40])


def test_experts_the_tree_cannot_split_raise(tmp_path):
    folder = save_tiny_moe(tmp_path, "qwen3_moe", moe_intermediate_size=18)
    with pytest.raises(ValueError, match="intermediate size 18 is not a multiple of 8"):
        load_model(folder, tp=TPGroup(rank=0, size=2))
    with pytest.raises(ValueError, match="intermediate size=18 cannot be split evenly"):
        load_model(folder, tp=TPGroup(rank=0, size=4))
    load_model(folder, tp_invariant=True)  # one process: the tree zero-pads I to a multiple of 8
