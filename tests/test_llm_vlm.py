"""LLM with images, end to end on tiny random Qwen3-VL (and Qwen2.5-VL) checkpoints, and the invariance matrix for
image requests: a request's token ids, logprobs and prompt logprobs are the same bits alone, inside batches of image
and text requests, with its images encoded alone or with others, under chunked prefill that cuts through image
tokens, after a prefix-cache hit on the same image with another question, after preemption, and equal to what a
fresh prefill of the same sequence computes; the default kernels show the harness can see a difference."""

import base64
import io
import random
import struct
from pathlib import Path

import pytest
from tiny_vlm import IMAGE_PAD, hf_vlm, hf_vlm_greedy, process_images, save_tiny_vlm, tiny_image

from lockstep.llm import LLM
from lockstep.outputs import RequestOutput
from lockstep.sampling_params import SamplingParams

BLOCK = 4
PLACE = "<|vision_start|><|image_pad|><|vision_end|>"
# Patch 16, merge 2: an image of W x H pixels is (W / 32) * (H / 32) image tokens.
A, B, C, D = tiny_image(96, 64, 1), tiny_image(128, 96, 2), tiny_image(64, 64, 3), tiny_image(160, 128, 4)
TARGETS = [  # (prompt, images, params): greedy with prompt logprobs, two images seeded, a 20-token image, text
    (
        f"user: {PLACE}Describe this image.\nassistant:",
        [A],
        SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True, prompt_logprobs=2),
    ),
    (
        f"user: {PLACE}What is this?{PLACE}Compare.\nassistant:",
        [B, C],
        SamplingParams(temperature=0.8, seed=1234, top_k=20, max_tokens=8, logprobs=3, ignore_eos=True),
    ),
    (
        f"user: Look: {PLACE}\nassistant:",
        [D],
        SamplingParams(temperature=0.8, seed=7, max_tokens=8, logprobs=2, ignore_eos=True),
    ),
    ("user: no image here, just text.\nassistant:", None, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
]


def prompt_of(text: str, images: list | None) -> str | dict:
    return text if images is None else {"prompt": text, "multi_modal_data": {"image": images}}


def bits(out: RequestOutput) -> tuple:
    """Token ids, logprob bits, top logprobs (id, bits, rank), finish reason and prompt logprobs."""
    f = lambda x: struct.pack("<d", x)
    dicts = lambda ds: tuple(None if d is None else tuple((t, f(v.logprob), v.rank) for t, v in d.items()) for d in ds)
    o = out.outputs[0]
    return (
        tuple(o.token_ids),
        tuple(map(f, o.token_logprobs)),
        dicts(o.logprobs or ()),
        o.finish_reason,
        dicts(out.prompt_logprobs or ()),
    )


def others(rng: random.Random, n: int) -> tuple[list, list[SamplingParams]]:
    """``n`` unrelated requests, image and text: random images (1-3, random sizes), lengths and sampling."""
    prompts, params = [], []
    for _ in range(n):
        text = "".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(1, 20)))
        if rng.random() < 0.6:
            k = rng.randrange(1, 3)
            sizes = [(32 * rng.randrange(1, 6), 32 * rng.randrange(1, 5)) for _ in range(k)]
            images = [tiny_image(w, h, rng.randrange(1000)) for w, h in sizes]
            prompts.append(prompt_of("user: " + PLACE * k + text + "\nassistant:", images))
        else:
            prompts.append("user: " + text + "\nassistant:")
        temperature = rng.choice([0, 0.7, 1.0])
        params.append(SamplingParams(temperature=temperature, seed=rng.randrange(1000), max_tokens=rng.randrange(1, 9)))
    return prompts, params


def run_mixed(llm: LLM, num_others: int, seed: int) -> list[RequestOutput]:
    rng = random.Random(seed)
    prompts, params = others(rng, num_others)
    slots = sorted(rng.sample(range(num_others + len(TARGETS)), len(TARGETS)))
    for slot, (text, images, p) in zip(slots, TARGETS, strict=True):
        prompts.insert(slot, prompt_of(text, images))
        params.insert(slot, p)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_nothing_held(llm)
    return [outs[s] for s in slots]


def assert_nothing_held(llm: LLM) -> None:
    """No request, KV block or encoder cache entry is left behind."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert len(engine.runner.encoder_cache) == 0
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def make_llm(folder: Path, **kwargs) -> LLM:
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("num_kv_blocks", 1024)
    return LLM(str(folder), **kwargs)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-qwen3-vl"), "qwen3_vl")


def alone(folder: Path, **kwargs) -> list[tuple]:
    refs = []
    for text, images, p in TARGETS:
        [out] = make_llm(folder, **kwargs).generate(prompt_of(text, images), p, use_tqdm=False)
        refs.append(bits(out))
    return refs


@pytest.fixture(scope="module")
def reference(vlm_dir: Path) -> list[tuple]:
    """Each target alone, on a fresh engine."""
    refs = alone(vlm_dir)
    assert len({r[0] for r in refs}) == len(refs)
    return refs


def encoder_calls(llm: LLM) -> list[int]:
    """Records the number of images of each ``encode_images`` call the engine makes."""
    calls: list[int] = []
    model = llm.engine.runner.model
    encode = model.encode_images

    def spy(pixel_values, grid_thw):
        calls.append(grid_thw.shape[0])
        return encode(pixel_values, grid_thw)

    model.encode_images = spy
    return calls


def chunks_inside_images(llm: LLM) -> list[int]:
    """Records, for each scheduled chunk that starts inside an image's tokens, its start."""
    starts: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        batch = schedule()
        for e in batch.entries:
            mm = e.seq.mm
            if mm is not None and any(im.offset < e.start < im.end for im in mm.images):
                starts.append(e.start)
        return batch

    llm.engine.scheduler.schedule = spy
    return starts


# (engine settings, number of other requests, layout seed)
MATRIX = {
    "batch_of_6": ({}, 2, 0),
    "batch_of_16": ({}, 12, 1),
    "chunked_8": ({"max_num_batched_tokens": 8, "max_num_seqs": 8}, 6, 2),
    "chunked_13": ({"max_num_batched_tokens": 13, "max_num_seqs": 8}, 6, 3),
    "encoder_one_image_a_step": ({"max_num_encoder_tokens_per_step": 1}, 6, 4),
    "encoder_all_at_once": ({"max_num_encoder_tokens_per_step": 4096}, 8, 5),
    "max_num_seqs_1": ({"max_num_seqs": 1}, 2, 6),
    "no_prefix_caching": ({"enable_prefix_caching": False}, 4, 7),
    "async_scheduling": ({"async_scheduling": True}, 8, 8),
    "async_chunked_8": ({"async_scheduling": True, "max_num_batched_tokens": 8, "max_num_seqs": 8}, 6, 11),
}


@pytest.mark.parametrize("case", list(MATRIX))
def test_invariance_matrix(vlm_dir: Path, reference: list[tuple], case: str) -> None:
    kwargs, num_others, seed = MATRIX[case]
    llm = make_llm(vlm_dir, **kwargs)
    calls, inside = encoder_calls(llm), chunks_inside_images(llm)
    outs = run_mixed(llm, num_others, seed)
    assert [bits(o) for o in outs] == reference
    if "chunked" in case:
        assert inside, "no chunk cut through an image's tokens"
    if case == "encoder_one_image_a_step":
        assert set(calls) == {1}
    if case == "encoder_all_at_once":
        assert max(calls) >= 3, calls  # several requests' images encoded in one call


def test_invariance_after_preemption(vlm_dir: Path, reference: list[tuple]) -> None:
    """A cache too small for all at once: image requests are preempted and encode their images again (no prefix
    caching: a readmitted request would otherwise find its image blocks in the cache)."""
    llm = make_llm(vlm_dir, num_kv_blocks=28, max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=False)
    preempted, encoded = [], []
    schedule = llm.engine.scheduler.schedule

    def spy():
        batch = schedule()
        preempted.extend(s.request_id for s in batch.preempted if s.mm is not None)
        encoded.extend((e.seq.request_id, k) for e in batch.entries for k in e.encode)
        return batch

    llm.engine.scheduler.schedule = spy
    outs = run_mixed(llm, 4, 1)
    assert preempted, "no image request was preempted"
    assert len(set(encoded)) < len(encoded), "no image was encoded again after a preemption"
    assert [bits(o) for o in outs] == reference


def test_prefix_hit_on_the_same_image_with_another_question(vlm_dir: Path, reference: list[tuple]) -> None:
    llm = make_llm(vlm_dir)
    # The same images with other questions, then other images of the same sizes with the targets' questions.
    warm = [prompt_of(text.replace("assistant", "ASSISTANT"), images) for text, images, _ in TARGETS[:3]]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    swapped = [tiny_image(*im.size, 99) for im in (A, B, C, D)]
    cached = {}
    add = llm.engine.scheduler.add

    def spy_add(seq):
        add(seq)
        cached[seq.request_id] = seq

    llm.engine.scheduler.add = spy_add
    [other] = llm.generate(prompt_of(TARGETS[2][0], [swapped[3]]), TARGETS[2][2], use_tqdm=False)
    first_image = cached[other.request_id].mm.images[0]
    # Only the text before the image hits: its blocks hash the new image's pixels.
    assert cached[other.request_id].num_cached_tokens == first_image.offset // BLOCK * BLOCK
    assert bits(other) != reference[2]
    outs = run_mixed(llm, 4, 10)
    for out, (_, images, p) in zip(outs, TARGETS, strict=True):
        seq = cached[out.request_id]
        if images and p.prompt_logprobs is None:
            assert seq.num_cached_tokens >= seq.mm.images[-1].end // BLOCK * BLOCK, "no hit through the images"
    assert [bits(o) for o in outs] == reference


def test_decode_logprobs_equal_a_fresh_prefill(vlm_dir: Path, reference: list[tuple]) -> None:
    """Step i's token and logprobs equal what a one-token prefill of prompt + completion[:i] computes: the prompt
    sent as token ids with its placeholders already expanded, and its images."""
    llm = make_llm(vlm_dir, enable_prefix_caching=False)
    prompts, params, expect = [], [], []
    for (text, images, p), ref in zip(TARGETS, reference, strict=True):
        [first] = llm.generate(prompt_of(text, images), SamplingParams(max_tokens=1), use_tqdm=False)
        expanded = list(first.prompt_token_ids)
        tokens, lps, tops = ref[:3]
        for i in range(len(tokens)):
            ids = expanded + list(tokens[:i])
            prompts.append({"prompt_token_ids": ids} | ({"multi_modal_data": {"image": images}} if images else {}))
            params.append(SamplingParams(**{**vars(p), "max_tokens": 1, "prompt_logprobs": None}))
            expect.append(((tokens[i],), (lps[i],), (tops[i],) if tops else ()))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [bits(o)[:3] for o in outs] == expect


def test_the_same_image_across_requests_and_n_choices_is_encoded_once(vlm_dir: Path, reference: list[tuple]) -> None:
    """The first target twice, and another question on its image with n=3 seeded choices, in one batch: the encoder
    runs once (one image), every request shares those features, and the bits equal each request's own encoding:
    the target alone (``reference``) and the n choices run one at a time without prefix caching (each encodes the
    image afresh)."""
    text, images, p = TARGETS[0]
    ask = prompt_of(f"user: {PLACE}What is in it?\nassistant:", images)
    n_params = SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=6, logprobs=1, ignore_eos=True)
    serial = make_llm(vlm_dir, max_num_seqs=1, enable_prefix_caching=False)
    calls = encoder_calls(serial)
    [one_by_one] = serial.generate(ask, n_params, use_tqdm=False)
    assert sum(calls) == 3  # each choice encoded its own copy

    llm = make_llm(vlm_dir)
    calls = encoder_calls(llm)
    outs = llm.generate([prompt_of(text, images), ask, prompt_of(text, images)], [p, n_params, p], use_tqdm=False)
    cache = llm.engine.runner.encoder_cache
    assert calls == [1] and cache.encoded == 1 and cache.shared == 4
    assert bits(outs[0]) == bits(outs[2]) == reference[0]

    def choices(out: RequestOutput) -> list[tuple]:
        return [(tuple(c.token_ids), tuple(struct.pack("<d", x) for x in c.token_logprobs)) for c in out.outputs]

    assert choices(outs[1]) == choices(one_by_one) and len(set(choices(outs[1]))) > 1
    assert_nothing_held(llm)


def test_negative_control_default_kernels_differ(vlm_dir: Path) -> None:
    """The same harness on torch's default kernels sees the batch in the bits (proof the matrix could fail)."""
    ref = alone(vlm_dir, batch_invariant=False)
    differ = []
    for case in ("batch_of_16", "chunked_8"):
        kwargs, num_others, seed = MATRIX[case]
        outs = run_mixed(make_llm(vlm_dir, batch_invariant=False, **kwargs), num_others, seed)
        differ += [case] if [bits(o) for o in outs] != ref else []
    assert differ, "torch's default kernels gave the same bits alone and batched: the matrix proves nothing"


def test_the_image_matters(vlm_dir: Path, reference: list[tuple]) -> None:
    text, _, p = TARGETS[0]
    [out] = make_llm(vlm_dir).generate(prompt_of(text, [tiny_image(96, 64, 50)]), p, use_tqdm=False)
    assert bits(out)[0] != reference[0][0]


def test_greedy_ids_equal_transformers(vlm_dir: Path, reference: list[tuple]) -> None:
    """End to end against transformers' own model: the same image and question, the same greedy ids."""
    text, images, p = TARGETS[0]
    llm = make_llm(vlm_dir)
    [out] = llm.generate(prompt_of(text, images), SamplingParams(max_tokens=1), use_tqdm=False)
    pixel_values, grid = process_images(vlm_dir, images)
    ids = list(out.prompt_token_ids)
    assert ids.count(IMAGE_PAD) == int(grid.prod()) // 4
    hf = hf_vlm_greedy(hf_vlm(vlm_dir), ids, pixel_values, grid, max_new_tokens=p.max_tokens)
    assert list(reference[0][0]) == hf


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_image_parts_equals_generate(vlm_dir: Path, reference: list[tuple], tmp_path: Path) -> None:
    """chat renders image parts as the placeholder; a data URL, a file under allowed_local_media_path and a PIL
    image give the same pixels, so the same bits as generate."""
    (tmp_path / "a.png").write_bytes(base64.b64decode(data_url(A).split(",", 1)[1]))
    llm = make_llm(vlm_dir, allowed_local_media_path=str(tmp_path))
    p = TARGETS[0][2]
    for part in (
        {"type": "image_url", "image_url": {"url": data_url(A)}},
        {"type": "image_url", "image_url": {"url": (tmp_path / "a.png").as_uri()}},
        {"type": "image", "image": A},
    ):
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "Describe this image."}]}]
        [out] = llm.chat(messages, p, use_tqdm=False)
        assert bits(out) == reference[0]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl_moe"])
def test_other_vlms_batch_and_chunk_invariance(tmp_path_factory: pytest.TempPathFactory, arch: str) -> None:
    """Qwen2.5-VL (window attention) and Qwen3-VL-MoE: two image targets alone, then chunked among others."""
    folder = save_tiny_vlm(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
    # Qwen2.5-VL: patch 14, merge 2, 28-pixel units, windows of 56 pixels (several per image).
    targets = [
        prompt_of(f"user: {PLACE}Describe.\nassistant:", [tiny_image(112, 84, 1)]),
        prompt_of(f"user: {PLACE}and{PLACE}?\nassistant:", [tiny_image(84, 56, 2), tiny_image(140, 112, 3)]),
    ]
    p = SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=2, ignore_eos=True)
    refs = [bits(make_llm(folder).generate(t, p, use_tqdm=False)[0]) for t in targets]
    rng = random.Random(0)
    prompts, params = others(rng, 6)
    llm = make_llm(folder, max_num_batched_tokens=10, max_num_seqs=8)
    outs = llm.generate(prompts[:3] + targets + prompts[3:], params[:3] + [p, p] + params[3:], use_tqdm=False)
    assert [bits(o) for o in outs[3:5]] == refs
    assert_nothing_held(llm)
