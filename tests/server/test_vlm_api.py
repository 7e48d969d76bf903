"""Images through the OpenAI server (a real ``lockstep serve`` of a tiny random Qwen3-VL, driven by the official
``openai`` client): chat completions with ``image_url`` parts give the offline ``LLM``'s bits, alone or among
concurrent image and text requests; ``/tokenize`` counts the image tokens; bad images, too many images, remote URLs
(nothing reaches the network by default), a placeholder without an image and images for a text-only model are 400s
that name the problem, and leave nothing behind."""

import asyncio
import base64
import io
from pathlib import Path

import httpx
import openai
import pytest
from tiny_vlm import save_tiny_vlm, tiny_image

from lockstep.llm import LLM
from lockstep.sampling_params import SamplingParams

from .conftest import Server, start_server, stop_server

PIXEL_CAP = 40_000


def png_url(image, cut: int = 0) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    data = buf.getvalue()
    return "data:image/png;base64," + base64.b64encode(data[: len(data) - cut]).decode()


def image_message(*urls: str, text: str = "Describe this image.") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vlm(tmp_path_factory.mktemp("server-vlm") / "tiny-vl", "qwen3_vl")


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    tiny_image(96, 64, 1).save(folder / "a.png")
    return folder


@pytest.fixture(scope="module")
def vlm_server(vlm_dir: Path, media_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / "server-vlm.log"
    args = ["--num-kv-blocks", "512", "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", str(PIXEL_CAP)]
    s = start_server(vlm_dir, log, *args, "--allowed-local-media-path", str(media_dir))
    yield s
    stop_server(s.proc)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.api_key or "none", max_retries=0, timeout=120)


def chat(server: Server, messages: list[dict], **kwargs):
    kwargs = dict(max_tokens=8, temperature=0, logprobs=True, top_logprobs=2) | kwargs
    return client(server).chat.completions.create(model=server.model, messages=messages, **kwargs)


def answer(r) -> tuple:
    choice = r.choices[0]
    return choice.message.content, tuple(t.logprob for t in choice.logprobs.content)


def test_image_chat_equals_the_offline_llm(vlm_server: Server, vlm_dir: Path) -> None:
    image = tiny_image(96, 64, 1)
    r = chat(vlm_server, image_message(png_url(image)), extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    llm = LLM(str(vlm_dir), num_kv_blocks=512)
    parts = [{"type": "image", "image": image}, {"type": "text", "text": "Describe this image."}]
    p = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    [offline] = llm.chat([{"role": "user", "content": parts}], p, use_tqdm=False)
    assert r.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert answer(r) == (offline.outputs[0].text, tuple(offline.outputs[0].token_logprobs))
    stream = chat(vlm_server, image_message(png_url(image)), stream=True, extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == offline.outputs[0].text
    streamed = tuple(t.logprob for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content)
    assert streamed == tuple(offline.outputs[0].token_logprobs)


def test_same_image_alone_and_among_concurrent_requests(vlm_server: Server, media_dir: Path) -> None:
    target = image_message((media_dir / "a.png").as_uri())  # a local file under --allowed-local-media-path
    alone = answer(chat(vlm_server, target, temperature=0.8, seed=5))
    assert answer(chat(vlm_server, image_message(png_url(tiny_image(96, 64, 1))), temperature=0.8, seed=5)) == alone

    async def load() -> list:
        c = openai.AsyncOpenAI(base_url=vlm_server.base_url, api_key="none", max_retries=0, timeout=300)
        calls = []
        for i in range(10):
            if i % 3 == 0:
                messages = [{"role": "user", "content": f"just text {i}"}]
            else:
                messages = image_message(*[png_url(tiny_image(32 * (1 + i % 4), 64, i))] * (1 + i % 2), text=f"q{i}")
            calls.append(c.chat.completions.create(model=vlm_server.model, messages=messages, max_tokens=1 + i % 7))
        for _ in range(3):
            calls.append(
                c.chat.completions.create(
                    model=vlm_server.model, messages=target, max_tokens=8, temperature=0.8, seed=5, logprobs=True,
                    top_logprobs=2,
                )
            )  # fmt: skip
        return await asyncio.gather(*calls)

    outs = asyncio.run(load())
    assert [answer(r) for r in outs[-3:]] == [alone] * 3


def test_mm_processor_kwargs_per_request(vlm_server: Server) -> None:
    """vLLM's per-request min/max pixels: a smaller max_pixels makes fewer image tokens; more than the server's
    own maximum is a 400."""
    messages = image_message(png_url(tiny_image(160, 128, 4)))  # 20 image tokens at the server's sizes
    full = chat(vlm_server, messages, max_tokens=1).usage.prompt_tokens
    small = chat(vlm_server, messages, max_tokens=1, extra_body={"mm_processor_kwargs": {"max_pixels": 4096}})
    assert full - small.usage.prompt_tokens == 20 - 2
    for kwargs, words in [({"max_pixels": 1 << 30}, "the server's max_pixels"), ({"fps": 2}, "takes min_pixels")]:
        with pytest.raises(openai.BadRequestError) as e:
            chat(vlm_server, messages, extra_body={"mm_processor_kwargs": kwargs})
        assert words in e.value.message and e.value.body["param"] == "mm_processor_kwargs"


def test_tokenize_counts_the_image_tokens(vlm_server: Server) -> None:
    messages = image_message(png_url(tiny_image(160, 128, 4)))  # 5 x 4 = 20 image tokens
    r = chat(vlm_server, messages, max_tokens=1)
    body = {"model": vlm_server.model, "messages": messages}
    tokens = httpx.post(vlm_server.url + "/tokenize", json=body, timeout=60).json()
    assert tokens["count"] == r.usage.prompt_tokens
    assert tokens["tokens"].count(98) == 20  # <|image_pad|>


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        (image_message("https://example.com/cat.png"), "--allowed-media-domains"),
        (image_message("data:image/png;base64,bm90IGFuIGltYWdl"), "could not be read as an image"),
        (image_message(png_url(tiny_image(64, 64, 2), cut=300)), "corrupt or truncated"),
        (image_message(png_url(tiny_image(256, 200, 3))), f"51200 pixels; at most {PIXEL_CAP}"),
        (image_message(*[png_url(tiny_image(32, 32))] * 3), "at most 2 per prompt (--limit-mm-per-prompt)"),
        (image_message("file:///etc/passwd"), "outside the allowed folder"),
        ([{"role": "user", "content": "<|image_pad|> where is it?"}], "placeholder"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "unsupported type"),
    ],
)
def test_bad_images_are_400s_naming_the_problem(vlm_server: Server, messages: list, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(vlm_server, messages)
    assert words in e.value.message
    assert e.value.body["param"] == "messages"


def test_nothing_leaks_after_bad_requests(vlm_server: Server) -> None:
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            chat(vlm_server, image_message(png_url(tiny_image(64, 64, 2), cut=300)))
    metrics = vlm_server.metrics()
    assert metrics["lockstep_num_requests_running"] == 0 and metrics["lockstep_num_requests_waiting"] == 0
    assert answer(chat(vlm_server, image_message(png_url(tiny_image(96, 64, 1))), max_tokens=2))[0] is not None


def test_images_for_a_text_only_model(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, image_message(png_url(tiny_image(32, 32))))
    assert "text-only" in e.value.message


def test_image_audit_of_the_server_gives_one_completion(vlm_server: Server, media_dir: Path) -> None:
    """``lockstep audit --image``'s experiment on the server: the same image and question, alone and 8 at once
    among image and text fillers: one completion, the same logprob bits."""
    from lockstep.audit.runner import AuditConfig, audit_endpoint

    cfg = AuditConfig(
        prompt="Describe this image.", n=8, concurrency=(1, 8), max_tokens=6, temperature=0.8, seed=3, filler=6,
        image=str(media_dir / "a.png"),
    )  # fmt: skip
    report = asyncio.run(audit_endpoint(vlm_server.base_url, None, cfg, progress=False))
    overall = report["overall"]
    assert (overall["requests"], overall["errors"], overall["unique_completions"]) == (16, 0, 1)
    assert overall["logprobs"]["bitwise_identical"]
