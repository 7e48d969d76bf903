"""vLLM's server surface, round two (issue 28), against real servers with the ``openai`` client: allowed_token_ids
and bad_words, chat's echo / add_generation_prompt / continue_final_message and custom roles, logprobs -1 under
--max-logprobs, cached_tokens and per-request metrics, and the extra routes and metric names."""

import shutil
import time
from pathlib import Path

import httpx
import pytest
from tiny_models import TINY_CHARS, TINY_VOCAB

from .conftest import Server, start_server, stop_server
from .test_openai_api import _assert_error, _post, client

ROOT_PATH = "/llm"
# The char tokenizer's template, but with the generation prompt only when asked for (the shared one always adds it).
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
VLLM_FLAGS = (
    "--root-path", ROOT_PATH, "--max-logprobs", "-1", "--enable-prompt-tokens-details",
    "--enable-force-include-usage", "--enable-tokenizer-info-endpoint", "--dev-mode", "--enable-server-load-tracking",
    "--enable-per-request-metrics",
)  # fmt: skip


@pytest.fixture(scope="module")
def vllm_server(tiny_server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One server for every vLLM option tested here (VLLM_FLAGS), on the tiny model with TEMPLATE."""
    folder = tmp_path_factory.mktemp("vllm2") / "tiny-vllm"
    shutil.copytree(tiny_server_model_dir, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)  # where transformers keeps the template
    s = start_server(folder, tmp_path_factory.mktemp("logs") / "vllm2.log", *VLLM_FLAGS)
    yield s
    stop_server(s.proc)


def ids_of(text: str) -> list[int]:
    return [TINY_CHARS.index(c) for c in text]


def test_allowed_token_ids_and_bad_words(server: Server) -> None:
    c = client(server)
    kw = dict(model=server.model, prompt="hello", max_tokens=8, temperature=0)
    base = c.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) == 8 and base[0] != base[1]
    allowed = ids_of("xyz")
    assert not set(base) <= set("xyz")
    r = c.completions.create(
        **kw, extra_body={"ignore_eos": True, "allowed_token_ids": allowed, "return_token_ids": True}
    )
    assert set(r.choices[0].token_ids) <= set(allowed) and set(r.choices[0].text) <= set("xyz")
    # bad_words: the word's first token may come, never followed by the rest; streamed the same.
    extra = {"ignore_eos": True, "bad_words": [base[:2]]}
    banned = c.completions.create(**kw, extra_body=extra).choices[0].text
    assert banned[0] == base[0] and banned[1] != base[1] and base[:2] not in banned
    chunks = c.completions.create(**kw, extra_body=extra, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == banned
    # Chat takes them too.
    messages = [{"role": "user", "content": "hi"}]
    chat = dict(model=server.model, messages=messages, max_tokens=6, temperature=0)
    reply = c.chat.completions.create(**chat, extra_body={"ignore_eos": True}).choices[0].message.content
    word = next(ch for ch in reply if ch.strip())
    other = c.chat.completions.create(**chat, extra_body={"ignore_eos": True, "bad_words": [word]})
    assert word not in other.choices[0].message.content
    # Refused as vLLM refuses them, naming the parameter.
    comp = {"model": server.model, "prompt": "hi", "max_tokens": 2}
    _assert_error(_post(server, "/v1/completions", comp | {"allowed_token_ids": [3, 5000]}), 400, "5000")
    _assert_error(_post(server, "/v1/completions", comp | {"allowed_token_ids": []}), 400, "allowed_token_ids")
    err = _assert_error(_post(server, "/v1/completions", comp | {"bad_words": [" "]}), 400, "at least one token")
    assert err["param"] == "bad_words"
    err = _assert_error(_post(server, "/v1/completions", comp | {"bad_words": ["a"] * 129}), 400, "bad_words")


def test_chat_echo_generation_prompt_continue_final_message_and_custom_roles(vllm_server: Server) -> None:
    server = vllm_server
    c = client(server)
    kw = dict(model=server.model, max_tokens=5, temperature=0)
    user = [{"role": "user", "content": "hi"}]
    # No generation prompt: the template's text stops after the messages; the reply takes the final message's role.
    r = c.chat.completions.create(messages=user, **kw, extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == len("user: hi\n") and r.choices[0].message.role == "user"
    # Continue the final message: the prompt ends inside it (its text, without the template's closing newline).
    partial = user + [{"role": "assistant", "content": "The ans"}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    r = c.chat.completions.create(messages=partial, **kw, extra_body=cont)
    assert r.usage.prompt_tokens == len("user: hi\nassistant: The ans") and r.choices[0].message.role == "assistant"
    tokenized = _post(server, "/tokenize", {"messages": partial} | cont).json()
    assert tokenized["count"] == r.usage.prompt_tokens
    # echo: the continued message's text first, then the reply; streamed the same (the echo in a chunk of its own).
    echoed = c.chat.completions.create(messages=partial, **kw, extra_body=cont | {"echo": True})
    assert echoed.choices[0].message.content == "The ans" + r.choices[0].message.content
    chunks = list(c.chat.completions.create(messages=partial, **kw, stream=True, extra_body=cont | {"echo": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[1].choices[0].delta.content == "The ans"
    *deltas, usage = chunks  # --enable-force-include-usage: the usage chunk without stream_options
    assert not usage.choices and usage.usage.completion_tokens == 5
    assert "".join(ch.choices[0].delta.content or "" for ch in deltas) == echoed.choices[0].message.content
    # With a generation prompt the reply is a new assistant message: nothing of the user's is echoed (vLLM's rule).
    plain = c.chat.completions.create(messages=user, **kw).choices[0].message.content
    assert c.chat.completions.create(messages=user, **kw, extra_body={"echo": True}).choices[0].message.content == plain
    # A role the template takes is the template's business (vLLM's custom roles).
    narrator = [{"role": "narrator", "content": "x"}]
    assert c.chat.completions.create(messages=narrator, **kw).usage.prompt_tokens == len("narrator: x\nassistant:")
    both = {"model": server.model, "messages": partial, "continue_final_message": True}
    _assert_error(_post(server, "/v1/chat/completions", both), 400, "continue_final_message", "add_generation_prompt")
    _assert_error(_post(server, "/v1/chat/completions", {**both, "messages": [{"role": "", "content": "x"}]}), 400)


def test_logprobs_are_capped_at_max_logprobs_default_20(server: Server) -> None:
    comp = {"model": server.model, "prompt": "hi", "max_tokens": 1}
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert (
        len(
            _post(server, "/v1/completions", comp | {"logprobs": 20}).json()["choices"][0]["logprobs"]["top_logprobs"][
                0
            ]
        )
        >= 20
    )
    for path, body, name, n in (
        ("/v1/completions", comp | {"logprobs": 21}, "logprobs", 21),
        ("/v1/completions", comp | {"logprobs": -1}, "logprobs", 97),
        ("/v1/completions", comp | {"prompt_logprobs": -1}, "prompt_logprobs", 97),
        ("/v1/chat/completions", chat | {"logprobs": True, "top_logprobs": -1}, "top_logprobs", 97),
    ):
        err = _assert_error(_post(server, path, body), 400, f"Requested {name} of {n}", "max allowed: 20")
        assert err["param"] == name
    _assert_error(_post(server, "/v1/completions", comp | {"logprobs": -2}), 400, "logprobs")


def test_logprobs_minus_one_is_the_whole_vocabulary_under_max_logprobs_minus_one(vllm_server: Server) -> None:
    c = client(vllm_server)
    m = vllm_server.model
    r = c.completions.create(
        model=m, prompt="hi", max_tokens=2, temperature=0, logprobs=-1, extra_body={"prompt_logprobs": -1}
    )
    top = r.choices[0].logprobs.top_logprobs
    assert [len(t) for t in top] == [TINY_VOCAB, TINY_VOCAB]  # every token of the vocabulary, named by its text
    assert r.choices[0].prompt_logprobs[0] is None and len(r.choices[0].prompt_logprobs[1]) == TINY_VOCAB
    chat = c.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=1, logprobs=True, top_logprobs=-1
    )
    [step] = chat.choices[0].logprobs.content
    assert len(step.top_logprobs) == TINY_VOCAB and step.top_logprobs[0].logprob >= step.top_logprobs[-1].logprob


def test_cached_tokens_and_reset_prefix_cache(vllm_server: Server, server: Server) -> None:
    c = client(vllm_server)
    prompt = "a prompt long enough for three full blocks of 16!"  # 49 tokens: the first 48 can be hits
    assert len(prompt) == 49
    kw = dict(model=vllm_server.model, prompt=prompt, max_tokens=2, temperature=0)
    details = [c.completions.create(**kw).usage.prompt_tokens_details.cached_tokens for _ in range(2)]
    assert details == [0, 48]
    chat = dict(model=vllm_server.model, messages=[{"role": "user", "content": prompt}], max_tokens=1)
    assert c.chat.completions.create(**chat).usage.prompt_tokens_details.cached_tokens == 0
    again = c.chat.completions.create(**chat).usage  # "user: ...\nassistant:", 66 tokens: 4 full blocks
    assert again.prompt_tokens == 66 and again.prompt_tokens_details.cached_tokens == 64
    # Streamed, in the usage chunk.
    *_, last = c.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    assert last.usage.prompt_tokens_details.cached_tokens == 48
    # Without --enable-prompt-tokens-details the field is null, as vLLM sends it.
    other = client(server).completions.create(model=server.model, prompt=prompt, max_tokens=1)
    assert other.usage.prompt_tokens_details is None

    # SGLang's POST /flush_cache (and vLLM's /reset_prefix_cache under --dev-mode), bodiless as curl sends them: the
    # next identical prompt hits nothing.
    for method, route in (("POST", "/flush_cache"), ("POST", "/reset_prefix_cache")):
        assert c.completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 48
        r = httpx.request(method, vllm_server.url + route, timeout=30)
        assert r.status_code == 200, r.text
        assert c.completions.create(**kw).usage.prompt_tokens_details.cached_tokens == 0
    # While a request runs its blocks are in use: not flushed, and the answer says so (409, not a silent 200).
    long = c.completions.create(**kw | {"max_tokens": 400}, stream=True, extra_body={"ignore_eos": True})
    with long:
        next(iter(long))
        r = httpx.post(vllm_server.url + "/flush_cache", timeout=30)
        assert r.status_code == 409 and "running" in r.json()["error"]["message"]
        assert httpx.post(vllm_server.url + "/reset_prefix_cache", timeout=30).json() == {"success": False}
    assert httpx.get(vllm_server.url + "/flush_cache", timeout=30).status_code == 405  # no cross-site GET
    bad = httpx.post(vllm_server.url + "/flush_cache", content=b"x", headers={"content-type": "text/plain"}, timeout=30)
    assert bad.status_code == 415  # a body must still be JSON


def test_root_path_tokenizer_info_and_invocations(
    vllm_server: Server, server: Server, tiny_server_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    url = vllm_server.url
    # --root-path: the paths under the prefix are the server's paths; without it, too (a proxy that strips it).
    for prefix in (ROOT_PATH, ""):
        assert httpx.get(url + prefix + "/health", timeout=10).status_code == 200
        assert httpx.get(url + prefix + "/v1/models", timeout=10).json()["data"][0]["id"] == vllm_server.model
    prefixed = client(vllm_server).with_options(base_url=url + ROOT_PATH + "/v1")
    assert prefixed.completions.create(model=vllm_server.model, prompt="hi", max_tokens=1).usage.prompt_tokens == 2
    assert httpx.get(url + "/llmx/v1/models", timeout=10).status_code == 404

    info = httpx.get(url + "/tokenizer_info", timeout=10).json()
    tokenizer_class = type(AutoTokenizer.from_pretrained(tiny_server_model_dir)).__name__
    assert info["tokenizer_class"] == tokenizer_class and info["chat_template"] == TEMPLATE
    assert info["eos_token"] == "</s>" and "tokenizer_file" not in info
    assert httpx.get(server.url + "/tokenizer_info", headers=server.headers, timeout=10).status_code == 404  # off

    # SageMaker's /invocations: dispatched on the body's shape, under the API key like every other route.
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = _post(server, "/invocations", chat)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    r = _post(server, "/invocations", {"model": server.model, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    _assert_error(_post(server, "/invocations", {"model": server.model}), 400, "messages", "prompt")
    _assert_error(_post(server, "/invocations", {"model": server.model, "prompt": 5}), 400, "prompt")
    assert httpx.post(server.url + "/invocations", json=chat, timeout=10).status_code == 401


def test_vllm_metric_names_beside_locksteps(server: Server) -> None:
    client(server).completions.create(model=server.model, prompt="hello", max_tokens=3, extra_body={"ignore_eos": True})
    m = server.metrics()
    label = f'{{model_name="{server.model}"}}'
    assert m[f"vllm:prompt_tokens_total{label}"] == m["lockstep_prompt_tokens_total"] > 0
    assert m[f"vllm:generation_tokens_total{label}"] == m["lockstep_generation_tokens_total"] > 0
    assert m[f"vllm:num_requests_running{label}"] == m["lockstep_num_requests_running"]
    assert m[f"vllm:num_requests_waiting{label}"] == m["lockstep_num_requests_waiting"]
    usage = m["lockstep_kv_blocks_used"] / m["lockstep_kv_blocks_total"]
    assert m[f"vllm:kv_cache_usage_perc{label}"] == m[f"vllm:gpu_cache_usage_perc{label}"] == usage
    assert m[f'vllm:request_success_total{{model_name="{server.model}",finished_reason="length"}}'] >= 1
    # The 3 tokens of the call above are 2 gaps; other tests' calls add theirs.
    assert m["lockstep_inter_token_latency_seconds_count"] >= 2
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "inter_token_latency_seconds"):
        lock = "request_latency_seconds" if name.startswith("e2e") else name
        assert m[f"vllm:{name}_count{label}"] == m[f"lockstep_{lock}_count"] > 0
        inf = f'vllm:{name}_bucket{{model_name="{server.model}",le="+Inf"}}'
        assert m[inf] == m[f"vllm:{name}_count{label}"]


def test_stop_reason_names_the_stop_string_or_token(server: Server) -> None:
    c = client(server)
    kw = dict(model=server.model, prompt="hello", max_tokens=6, temperature=0)
    text = c.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    r = c.completions.create(**kw, stop=[text[2:4]])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == text[2:4]
    *_, last = c.completions.create(**kw, stop=[text[2:4]], stream=True)
    assert last.choices[0].finish_reason == "stop" and last.choices[0].stop_reason == text[2:4]
    tid = TINY_CHARS.index(text[1])
    r = c.completions.create(**kw, extra_body={"stop_token_ids": [tid], "ignore_eos": True})
    assert r.choices[0].stop_reason == tid
    assert c.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].stop_reason is None  # length
    chat = c.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stop=["e"]
    )
    assert chat.choices[0].stop_reason == ("e" if chat.choices[0].finish_reason == "stop" else None)


def test_use_beam_search_gives_the_offline_beams(server: Server, tiny_server_model_dir: Path) -> None:
    from lockstep.llm import LLM
    from lockstep.sampling_params import BeamSearchParams

    c = client(server)
    extra = {"use_beam_search": True, "ignore_eos": True, "return_token_ids": True}
    r = c.completions.create(model=server.model, prompt=["hello", "beam"], n=3, max_tokens=4, extra_body=extra)
    assert [ch.index for ch in r.choices] == list(range(6))
    [ref_hello, ref_beam] = LLM(str(tiny_server_model_dir)).beam_search(
        [ids_of("hello"), ids_of("beam")], BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)
    )
    for ch, seq in zip(r.choices, ref_hello.sequences + ref_beam.sequences, strict=True):
        prompt = ids_of("hello" if ch.index < 3 else "beam")
        assert ch.token_ids == seq.tokens[len(prompt) :] and ch.text == "".join(TINY_CHARS[t] for t in ch.token_ids)
        assert ch.finish_reason == "length"
    assert len({tuple(ch.token_ids) for ch in r.choices[:3]}) == 3 and r.usage.completion_tokens == 24
    chat = c.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3, extra_body=extra
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content
    comp = {"model": server.model, "prompt": "hi", "max_tokens": 2, "use_beam_search": True}
    for extra_field, name in (
        ({"stream": True}, "stream"),
        ({"logprobs": 1}, "logprobs"),
        ({"temperature": 0.7}, "temperature"),
        ({"stop": ["x"]}, "stop"),
        ({"n": 11}, "n"),
    ):
        err = _assert_error(_post(server, "/v1/completions", comp | extra_field), 400, name)
        assert err["param"] == name


def _load(server: Server) -> int:
    return httpx.get(server.url + "/load", headers=server.headers, timeout=10).json()["server_load"]


def _load_settles_at(server: Server, want: int) -> None:
    """The count is given back once the response is written, which may be just after the client has read it."""
    for _ in range(200):
        if _load(server) == want:
            return
        time.sleep(0.05)
    assert _load(server) == want


def test_load_counts_generation_calls_in_flight(vllm_server: Server, server: Server) -> None:
    c = client(vllm_server)
    kw = dict(model=vllm_server.model, prompt="hi", max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    _load_settles_at(vllm_server, 0)
    with c.completions.create(**kw) as first:
        next(iter(first))
        assert _load(vllm_server) == 1
        chat = c.chat.completions.create(
            model=vllm_server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=400, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        with chat:
            next(iter(chat))
            assert _load(vllm_server) == 2
        _load_settles_at(vllm_server, 1)  # the client left: its count is given back
    _load_settles_at(vllm_server, 0)
    # A call that fails (a 400 from the parser) or one that is answered in one body leaves nothing counted.
    _assert_error(_post(vllm_server, "/v1/completions", {"model": vllm_server.model, "prompt": 5}), 400, "prompt")
    c.completions.create(model=vllm_server.model, prompt="hi", max_tokens=2)
    _load_settles_at(vllm_server, 0)
    # Without --enable-server-load-tracking /load is served and says 0, as vLLM's does.
    with client(server).completions.create(**kw | {"model": server.model}) as stream:
        next(iter(stream))
        assert _load(server) == 0


def test_iteration_tokens_histogram(vllm_server: Server) -> None:
    label = f'model_name="{vllm_server.model}"'
    before = vllm_server.metrics()
    r = client(vllm_server).completions.create(
        model=vllm_server.model, prompt="hello", max_tokens=4, extra_body={"ignore_eos": True}
    )
    after = vllm_server.metrics()

    def delta(name: str) -> float:
        return after[name] - before[name]

    # One prefill step of the prompt, then one decode step per token after the first.
    assert delta(f"vllm:iteration_tokens_total_count{{{label}}}") == 4 == delta("lockstep_iteration_tokens_count")
    assert delta(f"vllm:iteration_tokens_total_sum{{{label}}}") == r.usage.prompt_tokens + 3
    assert delta(f'vllm:iteration_tokens_total_bucket{{{label},le="1"}}') == 3  # the decode steps
    assert delta(f'vllm:iteration_tokens_total_bucket{{{label},le="8"}}') == 4  # and the prefill of 5 or 6
    assert (
        after[f'vllm:iteration_tokens_total_bucket{{{label},le="+Inf"}}']
        == after[f"vllm:iteration_tokens_total_count{{{label}}}"]
    )


def _check_timings(m: dict, num_tokens: int) -> None:
    """vLLM's per-request metrics, consistent with each other (their values are timings: no more is checked)."""
    assert set(m) == {
        "time_to_first_token_ms",
        "generation_time_ms",
        "queue_time_ms",
        "mean_itl_ms",
        "tokens_per_second",
    }
    assert all(isinstance(v, float) and v >= 0 for v in m.values()), m
    assert m["mean_itl_ms"] == pytest.approx(m["generation_time_ms"] / (num_tokens - 1))
    inference_s = (m["time_to_first_token_ms"] + m["generation_time_ms"]) / 1000  # first scheduling to last token
    assert m["tokens_per_second"] == pytest.approx(num_tokens / inference_s)


def test_per_request_metrics(vllm_server: Server, server: Server) -> None:
    c = client(vllm_server)
    kw = dict(model=vllm_server.model, max_tokens=5, extra_body={"ignore_eos": True})
    r = c.completions.create(prompt="hello", **kw)
    _check_timings(r.model_extra["metrics"], 5)
    chat = c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)
    _check_timings(chat.model_extra["metrics"], 5)
    # Streamed: in the usage chunk alone.
    chunks = list(c.completions.create(prompt="hello", stream=True, stream_options={"include_usage": True}, **kw))
    assert all("metrics" not in (ch.model_extra or {}) for ch in chunks[:-1])
    _check_timings(chunks[-1].model_extra["metrics"], 5)
    # More than one choice or prompt: null, as vLLM's (whose figures are one request's).
    assert c.completions.create(prompt="hello", n=2, **kw).model_extra["metrics"] is None
    assert c.completions.create(prompt=["a", "b"], **kw).model_extra["metrics"] is None
    # Without --enable-per-request-metrics: null, and no figures in a stream's usage chunk.
    other = client(server)
    assert other.completions.create(model=server.model, prompt="hi", max_tokens=2).model_extra["metrics"] is None
    *_, last = other.completions.create(
        model=server.model, prompt="hi", max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    assert last.usage is not None and "metrics" not in (last.model_extra or {})


def test_chat_completions_batch(vllm_server: Server) -> None:
    server = vllm_server
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "a longer question"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}],
    ]
    kw = {"max_tokens": 6, "logprobs": True, "top_logprobs": 2, "return_token_ids": True, "ignore_eos": True}
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        body = {"model": server.model, "messages": conversations, **kw, **sampling}
        # Through the openai client's own request method, as a vLLM user's code calls the route.
        batch = client(server).post("/chat/completions/batch", cast_to=object, body=body)
        assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")
        assert [ch["index"] for ch in batch["choices"]] == [0, 1, 2]
        singles = [_post(server, "/v1/chat/completions", body | {"messages": m}).json() for m in conversations]
        for choice, single in zip(batch["choices"], singles, strict=True):
            # The same bits as the call alone: text, token ids, logprobs, finish.
            assert choice == single["choices"][0] | {"index": choice["index"]}
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert batch["usage"][key] == sum(s["usage"][key] for s in singles)
        assert batch["usage"]["completion_tokens"] == 18
        assert batch["prompt_logprobs"] is None and batch["prompt_token_ids"] is None and batch["metrics"] is None
    # The conversations differ, and so do their answers (the comparison above can see a difference).
    assert len({tuple(ch["token_ids"]) for ch in batch["choices"]}) > 1
    # Refused as vLLM refuses them; one bad conversation fails the batch.
    base = {"model": server.model, "messages": conversations, "max_tokens": 2}
    for extra, param in (
        ({"stream": True}, "stream"),
        ({"n": 2}, "n"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"messages": conversations[0]}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [[{"role": "user", "content": "x"}]] * 129}, "messages"),
    ):
        err = _assert_error(_post(server, "/v1/chat/completions/batch", base | extra), 400)
        assert err["param"] == param, err
    bad = base | {"messages": [conversations[0], [{"role": "", "content": "x"}]]}
    _assert_error(_post(server, "/v1/chat/completions/batch", bad), 400)
    _load_settles_at(server, 0)  # nothing left counted (--enable-server-load-tracking)
