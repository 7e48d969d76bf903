"""FP8 through ``LLM`` under tensor parallelism (2 gloo worker processes): online FP8, a Qwen3-FP8 block checkpoint
and a Qwen3-MoE FP8 block checkpoint (FP8 experts) give the bits of one process with the chunk tree, alone and in a
batch; ``LLM.load_weights`` reaches every rank (full-precision weights re-quantized there, or e4m3 weights with
their block scales, each rank keeping its slice) and the engine then answers as a fresh one of those weights does.
The negative control: one process without the tree differs."""

from pathlib import Path

import pytest
from fp8_checkpoints import save_fp8
from safetensors.torch import load_file
from test_llm import bits, run_mixed
from test_llm_tp import alone, make_llm
from tiny_models import save_char_tokenizer, save_tiny_hf, save_tiny_llama, save_tiny_moe

# As tests/models/test_fp8_tp.py: o_proj's and down_proj's K of 1024 are whole 128-column blocks in each chunk.
WIDE = dict(hidden_size=64, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=2, head_dim=64)
# A Qwen3-MoE of that shape: 4 experts of I = 1024 (FP8 experts, sharded with their scales), top 2.
WIDE_MOE = WIDE | dict(moe_intermediate_size=1024, num_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def folders(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    wide, wide_b = (save_tiny_hf(tmp_path_factory.mktemp("wide"), "qwen3", seed=s, **WIDE) for s in (0, 1))
    for folder in (wide, wide_b):
        save_char_tokenizer(folder)
    moe, moe_b = (save_tiny_moe(tmp_path_factory.mktemp("wide-moe"), seed=s, **WIDE_MOE) for s in (0, 1))
    return {
        "moe-block": save_fp8(moe, tmp_path_factory.mktemp("wide-moe-block"), "fp8-block"),
        "moe-block-other": save_fp8(moe_b, tmp_path_factory.mktemp("wide-moe-block-b"), "fp8-block"),
        "online": tiny_model_dir,
        "online-other": save_tiny_llama(tmp_path_factory.mktemp("tiny-b"), seed=1),
        "block": save_fp8(wide, tmp_path_factory.mktemp("wide-block"), "fp8-block"),
        "block-other": save_fp8(wide_b, tmp_path_factory.mktemp("wide-block-b"), "fp8-block"),
    }


def _runs(llm) -> dict:
    return {"alone": alone(llm), "batch": [bits(o) for o in run_mixed(llm, 12, 3)]}


@pytest.mark.parametrize("which", ["online", "block", "moe-block"])
def test_an_fp8_engine_at_tp2_gives_the_tp1_tree_bits(folders, which):
    kwargs = {"quantization": "fp8"} if which == "online" else {}
    reference = _runs(make_llm(folders[which], tp_invariant=True, **kwargs))
    assert reference["batch"] == reference["alone"]
    with make_llm(folders[which], tensor_parallel_size=2, **kwargs) as llm:
        got = _runs(llm)
        # online: full-precision tensors, re-quantized on each rank; block: e4m3 tensors and their block scales
        llm.load_weights(load_file(folders[f"{which}-other"] / "model.safetensors"))
        reloaded = alone(llm)
    assert got == reference
    assert alone(make_llm(folders[which], **kwargs)) != reference["alone"]  # negative control: no tree
    fresh = alone(make_llm(folders[f"{which}-other"], tp_invariant=True, **kwargs))
    assert reloaded == fresh and reloaded != reference["alone"]
