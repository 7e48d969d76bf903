"""Bad image input through LLM and the engine: each is a ValueError that names the problem, and nothing leaks (no
request, KV block or encoder cache entry is left behind; the next request gets the bits it would have had)."""

import base64
import io
from pathlib import Path

import pytest
from tiny_vlm import save_tiny_vlm, tiny_image

from lockstep.engine.llm_engine import LLMEngine
from lockstep.llm import LLM
from lockstep.sampling_params import SamplingParams

PLACE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"user: {PLACE}Describe this image.\nassistant:"
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-qwen3-vl"), "qwen3_vl")


def png_url(image, cut: int = 0) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    data = buf.getvalue()
    return "data:image/png;base64," + base64.b64encode(data[: len(data) - cut]).decode()


def held(engine: LLMEngine) -> tuple[bool, int, int]:
    bm = engine.scheduler.block_manager
    return engine.has_unfinished_requests(), len(engine.runner.encoder_cache), bm.num_blocks - bm.num_free_blocks


def chat(url: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]
    return [{"role": "user", "content": parts}]


def test_bad_images_are_refused_by_name_and_nothing_leaks(vlm_dir: Path) -> None:
    llm = LLM(str(vlm_dir), block_size=4, num_kv_blocks=256, limit_mm_per_prompt={"image": 2}, max_image_pixels=40_000)
    image = tiny_image(96, 64, 1)
    good = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
    [before] = llm.generate(good, PARAMS, use_tqdm=False)
    cases = [
        (lambda: llm.chat(chat("data:image/png;base64," + base64.b64encode(b"GIF89a junk").decode())), "read as an"),
        (lambda: llm.chat(chat(png_url(tiny_image(64, 64, 2), cut=300))), "corrupt or truncated"),
        (lambda: llm.chat(chat(png_url(tiny_image(256, 200, 3)))), "51200 pixels; at most 40000"),
        (lambda: llm.chat(chat("https://example.com/cat.png")), "--allowed-media-domains"),
        (lambda: llm.chat(chat("file:///etc/passwd")), "allowed_local_media_path"),
        (
            lambda: llm.generate({"prompt": PLACE * 3 + "x", "multi_modal_data": {"image": [image] * 3}}, PARAMS),
            "3 images; at most 2",
        ),
        (lambda: llm.generate(PROMPT, PARAMS), "placeholder"),  # a placeholder without an image
        (
            lambda: llm.generate({"prompt": PLACE * 2, "multi_modal_data": {"image": image}}, PARAMS),
            "2 image placeholder",
        ),
        (lambda: llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": image}}, PARAMS), "0 image"),
        (
            lambda: llm.generate({"prompt": PROMPT, "multi_modal_data": {"video": image}}, PARAMS),
            "multi_modal_data takes",
        ),
        (
            lambda: llm.generate(
                {"prompt": PROMPT, "multi_modal_data": {"image": image}, "mm_processor_kwargs": {"fps": 2}}, PARAMS
            ),
            "mm_processor_kwargs takes",
        ),
        # One bad prompt in a list: nothing of the call runs.
        (lambda: llm.generate([good, {"prompt": PROMPT, "multi_modal_data": {"image": "nope"}}], PARAMS), "prompt 1"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words):
            call()
        assert held(llm.engine) == (False, 0, 0), words
    [after] = llm.generate(good, PARAMS, use_tqdm=False)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert after.outputs[0].token_logprobs == before.outputs[0].token_logprobs


def test_images_to_a_text_only_model(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=64)
    with pytest.raises(ValueError, match="text-only"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": tiny_image(32, 32)}}, PARAMS)
    with pytest.raises(ValueError, match="text-only"):
        llm.chat(chat(png_url(tiny_image(32, 32))), PARAMS)
    assert held(llm.engine) == (False, 0, 0)


def test_mm_processor_kwargs_set_the_image_size(vlm_dir: Path) -> None:
    """max_pixels per request (or for the engine) resizes the image: fewer image tokens."""
    llm = LLM(str(vlm_dir), block_size=4, num_kv_blocks=256)
    image = tiny_image(160, 128, 4)  # 20 tokens at the folder's sizes
    full = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, PARAMS, use_tqdm=False)[0]
    small_prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image}, "mm_processor_kwargs": {"max_pixels": 4096}}
    small = llm.generate(small_prompt, PARAMS, use_tqdm=False)[0]
    assert len(full.prompt_token_ids) - len(small.prompt_token_ids) == 20 - 2  # smart_resize: 64 x 32 pixels
    engine_wide = LLM(str(vlm_dir), block_size=4, num_kv_blocks=256, mm_processor_kwargs={"max_pixels": 4096})
    again = engine_wide.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, PARAMS, use_tqdm=False)[0]
    assert again.prompt_token_ids == small.prompt_token_ids
    assert again.outputs[0].token_logprobs == small.outputs[0].token_logprobs


def test_abort_mid_image_frees_its_features_and_blocks(vlm_dir: Path) -> None:
    llm = LLM(str(vlm_dir), block_size=4, num_kv_blocks=256, max_num_batched_tokens=8, max_num_seqs=8)
    engine = llm.engine
    ids = engine.tokenizer.encode(f"u: {PLACE}?", add_special_tokens=False)
    ids, mm = engine.process_images(ids, [tiny_image(160, 128, 4)])
    engine.add_request("r", ids, PARAMS, mm=mm)
    engine.step()  # a chunk of 8 that ends inside the 20-token image
    seq = engine.scheduler.get("r")
    assert seq.mm.images[0].offset < seq.num_computed_tokens < seq.mm.images[0].end
    assert len(engine.runner.encoder_cache) == 1
    engine.abort("r")
    assert held(engine) == (False, 0, 0)
    # The engine refuses inputs that do not belong to the prompt.
    with pytest.raises(ValueError, match="placeholder"):
        engine.add_request("s", ids[:-3] + [1, 2, 3, 4], PARAMS, mm=mm)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        engine.add_request("t", ids, SamplingParams(truncate_prompt_tokens=5), mm=mm)
    assert held(engine) == (False, 0, 0)


def test_warm_up_of_a_vision_language_engine(vlm_dir: Path) -> None:
    """On CUDA the engine warms up at start: its random prompts must not hold a placeholder without an image, and
    an image request of each warm-up size that fits runs (then nothing is left behind)."""
    from lockstep.engine import warmup

    llm = LLM(str(vlm_dir), block_size=4, num_kv_blocks=512, max_num_batched_tokens=512, max_num_seqs=16)
    encoded = []
    encode = llm.engine.runner.model.encode_images
    llm.engine.runner.model.encode_images = lambda p, g: encoded.append(g.tolist()) or encode(p, g)
    ran = warmup.warm_up(llm.engine, lengths=(1, 5, 100, 500))
    # 224 x 224 is 14 x 14 patches of 16; the folder's processor caps 448 x 448 at 256 x 256 pixels (16 x 16).
    assert encoded == [[[1, 14, 14]], [[1, 16, 16]]] and ran == 4 + 3 + 16 + 2 + 2
    assert held(llm.engine) == (False, 0, 0) and not llm.engine.scheduler.block_manager.hash_to_block_id
