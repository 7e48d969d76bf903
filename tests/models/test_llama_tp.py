"""The Llama family sharded over 2 and 4 gloo processes: logits bitwise equal to one process with the chunk tree,
close to the ordinary model, and a plain all-reduce (the negative control) that is not."""

import pytest
import torch
from paged_runner import PagedRunner
from tiny_models import max_rel_err, save_tiny_hf
from tp_spawn import run_ranks

from lockstep.distributed import TPGroup
from lockstep.models.loader import load_model

TP_SIZES = [2, 4]
CHECKPOINTS = {
    # Qwen3: per-head q/k norms, head_dim 32; tied embeddings, so the vocab-parallel head shares the embedding.
    "qwen3-tied": dict(arch="qwen3", tie_word_embeddings=True),
    # Biases everywhere: o_proj's and down_proj's go in once, after the tree.
    "llama-bias": dict(arch="llama", attention_bias=True, mlp_bias=True),
}


def _sequences() -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, 97, (n,), generator=gen).tolist() for n in (23, 41))


def run_model(tp: TPGroup, folder: str, dtype: torch.dtype, tp_invariant: bool | None) -> dict[str, torch.Tensor]:
    """Logits of a flattened prefill + decode batch, and of one sequence prefilled alone."""
    a, b = _sequences()
    model = load_model(folder, dtype=dtype, tp=tp, tp_invariant=tp_invariant)
    runner = PagedRunner(model, block_size=4)
    # Step 1: a prefills all but its last token, b its first chunk. Step 2: a decodes, b prefills the rest.
    h1a, h1b = runner.forward([("a", a[:-1], 0), ("b", b[:17], 0)])
    h2a, h2b = runner.forward([("a", a[-1:], len(a) - 1), ("b", b[17:], 17)])
    batch = model.compute_logits(torch.cat([h1a, h2a, h1b, h2b]))
    alone = model.compute_logits(PagedRunner(model, block_size=4).forward([("a", a, 0)])[0])
    return dict(batch=batch, alone=alone)


CASES = [
    ("llama", torch.float32),
    ("llama", torch.bfloat16),
    ("qwen3-tied", torch.float32),
    ("llama-bias", torch.float32),
]


def run_cases(tp: TPGroup, folders: dict[str, str]) -> dict:
    """Every case at this TP size with the chunk tree, and the fp32 llama with a plain all-reduce."""
    out = {(name, dtype): run_model(tp, folders[name], dtype, True) for name, dtype in CASES}
    out["all-reduce"] = run_model(tp, folders["llama"], torch.float32, False)
    return out


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    made = {name: str(save_tiny_hf(tmp_path_factory.mktemp(name), **kw)) for name, kw in CHECKPOINTS.items()}
    return {"llama": str(tiny_model_dir), **made}


@pytest.fixture(scope="module")
def one_process(folders) -> dict:
    """TP 1 in this process: the same layer code, every collective a no-op."""
    return run_cases(TPGroup(), folders)


@pytest.fixture(scope="module", params=TP_SIZES, ids=[f"tp{n}" for n in TP_SIZES])
def ranks(request, folders) -> tuple[int, list[dict]]:
    return request.param, run_ranks(run_cases, request.param, folders)


def assert_every_rank_matches(ranks, one_process, case) -> None:
    """Every rank's mixed-batch logits equal one process's, and a sequence alone has its rows of the mixed batch
    (batch invariance at this TP size too)."""
    size, results = ranks
    expected = one_process[case]["batch"]
    for rank, res in enumerate(results):
        got = res[case]["batch"]
        assert torch.equal(got, expected), f"TP {size} rank {rank}: {int((got != expected).sum())} logits differ"
        alone = res[case]["alone"]
        assert torch.equal(alone, got[: alone.shape[0]])


@pytest.mark.parametrize("case", CASES, ids=[f"{name}-{str(dtype)[6:]}" for name, dtype in CASES])
def test_logits_do_not_depend_on_the_tp_size(ranks, one_process, case):
    assert_every_rank_matches(ranks, one_process, case)


def test_a_plain_all_reduce_depends_on_the_tp_size(ranks, one_process):
    # Negative control: the same harness, the same sharded model, its row-parallel layers summed by an
    # all-reduce of each rank's sequential partial instead of the tree.
    size, results = ranks
    plain = results[0]["all-reduce"]["batch"]
    assert not torch.equal(plain, one_process["all-reduce"]["batch"])
    assert max_rel_err(plain, one_process["all-reduce"]["batch"]) <= 1e-4


@pytest.mark.parametrize("name", ["llama", "qwen3-tied", "llama-bias"])
def test_tree_numerics_are_close_to_the_ordinary_model(one_process, folders, name):
    tree = one_process[(name, torch.float32)]["batch"]
    ordinary = run_model(TPGroup(), folders[name], torch.float32, False)["batch"]  # the model as it was
    assert max_rel_err(tree, ordinary) <= 1e-4
    assert not torch.equal(tree, ordinary)  # the tree is other numerics, not the same bits


# --- sharding without processes: a rank's shapes and the slices it loads -----------------------------------------


def test_a_rank_loads_only_its_slices(tiny_model_dir):
    from safetensors.torch import load_file

    full = load_file(str(tiny_model_dir / "model.safetensors"))
    # Building and loading needs no collectives, so rank 1 of 4 can be made in this process.
    model = load_model(tiny_model_dir, tp=TPGroup(rank=1, size=4))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert (attn.num_heads, attn.num_kv_heads) == (1, 1)  # 4 query heads and 2 KV heads over 4 ranks
    assert model.kv_cache_shape(8, 4) == (8, 4, 1, 16)
    q, k, v = attn.qkv_proj.weight.split(attn.qkv_proj.out_parts)
    assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"][16:32])
    assert torch.equal(k, full["model.layers.0.self_attn.k_proj.weight"][0:16])  # rank 1 shares KV head 0
    assert torch.equal(v, full["model.layers.0.self_attn.v_proj.weight"][0:16])
    assert torch.equal(attn.o_proj.weight, full["model.layers.0.self_attn.o_proj.weight"][:, 16:32])
    gate, up = mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(gate, full["model.layers.0.mlp.gate_proj.weight"][20:40])
    assert torch.equal(up, full["model.layers.0.mlp.up_proj.weight"][20:40])
    assert torch.equal(mlp.down_proj.weight, full["model.layers.0.mlp.down_proj.weight"][:, 20:40])
    # vocab 97 in slices of 25 rows: rank 1 holds 25..50
    assert torch.equal(model.model.embed_tokens.weight, full["model.embed_tokens.weight"][25:50])
    assert torch.equal(model.lm_head.weight, full["lm_head.weight"][25:50])
    last = load_model(tiny_model_dir, tp=TPGroup(rank=3, size=4))
    assert torch.equal(last.lm_head.weight[:22], full["lm_head.weight"][75:])
    assert not last.lm_head.weight[22:].any()  # the short last slice is zero-padded


def test_shapes_tp_cannot_split_raise(tiny_model_dir):
    with pytest.raises(ValueError, match="num_attention_heads=4 cannot be split evenly"):
        load_model(tiny_model_dir, tp=TPGroup(rank=0, size=3))
    with pytest.raises(ValueError, match="num_attention_heads=4 cannot be split evenly"):
        load_model(tiny_model_dir, tp=TPGroup(rank=0, size=8))
    with pytest.raises(ValueError, match="batch-invariant kernel set"):
        load_model(tiny_model_dir, kernels="default", tp_invariant=True)
