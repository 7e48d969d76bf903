"""Tensor parallelism for vision-language models through ``LLM``: image requests give the same bits at TP 2 (gloo
worker processes; the decoder split, the vision tower run on rank 0 and its image rows broadcast) as at TP 1 with
the chunk tree (``tp_invariant=True``), alone, in a batch of image and text requests and under chunked prefill
that cuts through image tokens. Negative control: one process without the tree differs."""

import dataclasses
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_llm_vlm import TARGETS, bits, chunks_inside_images, make_llm, prompt_of, run_mixed
from tiny_vlm import save_tiny_vlm

from lockstep.engine.scheduler import Scheduler


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-qwen3-vl-tp"), "qwen3_vl")


@contextmanager
def scheduled(llm, **limits):
    """Run with other scheduler limits; the scheduler and the encoder cache it fills live in rank 0 alone."""
    engine = llm.engine
    saved = engine.scheduler
    config = dataclasses.replace(engine.config, **limits)
    engine.scheduler = Scheduler(config, eos_token_ids=engine.eos_token_ids, encoder_cache=engine.runner.encoder_cache)
    try:
        yield engine.scheduler
    finally:
        engine.scheduler = saved


def runs(llm) -> dict[str, list[tuple]]:
    out = {"alone": [bits(llm.generate(prompt_of(t, im), p, use_tqdm=False)[0]) for t, im, p in TARGETS]}
    out["batch_of_8"] = [bits(o) for o in run_mixed(llm, 4, 3)]
    with scheduled(llm, max_num_batched_tokens=8, max_num_seqs=8):
        inside = chunks_inside_images(llm)
        out["chunked_8"] = [bits(o) for o in run_mixed(llm, 4, 5)]
        assert inside, "no chunk cut through an image's tokens"
    return out


def test_tp2_image_requests_equal_tp1_with_the_tree(vlm_dir: Path) -> None:
    reference = runs(make_llm(vlm_dir, tp_invariant=True))
    assert all(got == reference["alone"] for got in reference.values())
    with make_llm(vlm_dir, tensor_parallel_size=2) as llm:
        assert llm.engine.config.tp_invariant and len(llm.engine.workers.pids) == 1
        got = runs(llm)
    for case, outs in got.items():
        assert outs == reference["alone"], case
    # Negative control: TP 1 without the tree reduces the row-parallel matmuls another way.
    plain = make_llm(vlm_dir)
    assert [bits(plain.generate(prompt_of(t, im), p, use_tqdm=False)[0]) for t, im, p in TARGETS] != reference["alone"]
