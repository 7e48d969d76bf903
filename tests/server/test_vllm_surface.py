"""vLLM's server surface beyond the OpenAI routes, against a real server: ``/tokenize`` and ``/detokenize``,
``prompt_logprobs`` and ``truncate_prompt_tokens``."""

import asyncio
import json
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from tiny_models import TINY_CHARS, TINY_EOS

from .conftest import Server, start_server, stop_server
from .test_openai_api import _assert_error, _post, client


def test_tokenize_and_detokenize(server: Server) -> None:
    r = _post(server, "/tokenize", {"model": server.model, "prompt": "hello", "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = [TINY_CHARS.index(c) for c in "hello"]
    assert r.json() == {"count": 5, "max_model_len": 1024, "tokens": ids, "token_strs": list("hello")}
    # What /tokenize says is what a completion's prompt costs.
    usage = client(server).completions.create(model=server.model, prompt="hello", max_tokens=1).usage
    assert usage.prompt_tokens == 5

    # Messages go through the chat template as chat completions render them; the model may be left out.
    messages = [{"role": "user", "content": "hi"}]
    r = _post(server, "/tokenize", {"messages": messages}).json()
    assert r["count"] == len("user: hi\nassistant:") and r["token_strs"] is None  # one token a character
    assert r["tokens"][:8] == [TINY_CHARS.index(c) for c in "user: hi"]
    chat = client(server).chat.completions.create(model=server.model, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == r["count"]

    r = _post(server, "/detokenize", {"model": server.model, "tokens": ids + [TINY_EOS]})
    assert r.status_code == 200 and r.json() == {"prompt": "hello</s>"}  # special tokens kept, as vLLM does

    tok = "/tokenize"
    _assert_error(_post(server, tok, {}), 400, "prompt or messages")
    _assert_error(_post(server, tok, {"prompt": "a", "messages": messages}), 400, "prompt or messages")
    _assert_error(_post(server, tok, {"prompt": 5}), 400, "prompt")
    _assert_error(_post(server, tok, {"prompt": "a", "model": "gpt-9"}), 404, "gpt-9")
    _assert_error(_post(server, tok, {"messages": messages, "continue_final_message": True}), 400, "both")
    _assert_error(_post(server, tok, {"messages": messages, "chat_template": "{{ x }}"}), 400, "chat_template")
    _assert_error(_post(server, tok, {"prompt": "x" * 100_000}), 400, "100000 characters")
    _assert_error(_post(server, "/detokenize", {"tokens": [5, 500]}), 400, "500")
    _assert_error(_post(server, "/detokenize", {"tokens": ["a"]}), 400, "tokens")
    assert httpx.post(server.url + tok, json={"prompt": "a"}).status_code == 401  # the key guards them too


VOCAB = {c: i for i, c in enumerate(TINY_CHARS)} | {"<unk>": TINY_EOS - 1, "</s>": TINY_EOS}


def loglikelihood_body(server: Server, prompts: list[list[int]], max_tokens: int = 0) -> dict:
    """What lm-evaluation-harness's local-completions sends for loglikelihood (it asks for max_tokens 1 and drops the
    last entry; 0 returns the prompt alone)."""
    return {"model": server.model, "prompt": prompts, "echo": True, "max_tokens": max_tokens, "logprobs": 1,
            "temperature": 0, "seed": 1234}  # fmt: skip


def test_echo_loglikelihood_is_the_decode_logprobs_bitwise(server: Server) -> None:
    c = client(server)
    context = [VOCAB[ch] for ch in "The river runs"]
    gen = c.completions.create(
        model=server.model, prompt=context, max_tokens=10, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    cont_lps = gen.choices[0].logprobs.token_logprobs
    continuation = [VOCAB[t] for t in gen.choices[0].logprobs.tokens]
    assert len(continuation) == 10

    r = c.completions.create(**loglikelihood_body(server, [context + continuation]))
    [choice] = r.choices
    lp = choice.logprobs
    assert choice.text == "The river runs" + gen.choices[0].text and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == 24 and r.usage.completion_tokens == 0  # the prompt alone
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 24
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[:3] == [0, 1, 2]
    # The engine's guarantee, through the API: a prompt token's logprob has the bits a decode step gave it.
    assert lp.token_logprobs[len(context) :] == cont_lps
    assert sum(lp.token_logprobs[len(context) :]) == sum(cont_lps)  # lm-eval's loglikelihood of the continuation
    # Negative control: after another context the same continuation scores other bits.
    other = c.completions.create(**loglikelihood_body(server, [[VOCAB["A"]] + context[1:] + continuation]))
    assert other.choices[0].logprobs.token_logprobs[len(context) :] != cont_lps
    # Greedy continuation: each token is the top-1 at its position (lm-eval's is_greedy).
    for tok, x, top in zip(lp.tokens[len(context) :], cont_lps, lp.top_logprobs[len(context) :], strict=True):
        assert top == {tok: x}

    # Echo with generation: the prompt first, then what a call without echo generates.
    plain = c.completions.create(model=server.model, prompt="hello", max_tokens=5, temperature=0, logprobs=2)
    echoed = c.completions.create(model=server.model, prompt="hello", max_tokens=5, temperature=0, logprobs=2,
                                  echo=True)  # fmt: skip
    assert echoed.choices[0].text == "hello" + plain.choices[0].text
    assert echoed.choices[0].logprobs.tokens == list("hello") + plain.choices[0].logprobs.tokens
    assert echoed.choices[0].logprobs.token_logprobs[5:] == plain.choices[0].logprobs.token_logprobs
    assert echoed.choices[0].logprobs.text_offset[5:] == [5 + o for o in plain.choices[0].logprobs.text_offset]
    assert echoed.usage.completion_tokens == 5
    no_lp = c.completions.create(model=server.model, prompt="hello", max_tokens=5, temperature=0, echo=True)
    assert no_lp.choices[0].text == echoed.choices[0].text and no_lp.choices[0].logprobs is None

    # Streamed, the first chunk of each choice carries the prompt; the chunks add up to the reply.
    chunks = list(c.completions.create(model=server.model, prompt="hello", max_tokens=5, temperature=0, logprobs=2,
                                       echo=True, n=2, stream=True))  # fmt: skip
    for i in range(2):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].text.startswith("hello")
        assert "".join(ch.text for ch in mine) == echoed.choices[0].text
        assert [x for ch in mine for x in ch.logprobs.token_logprobs] == echoed.choices[0].logprobs.token_logprobs
        assert [x for ch in mine for x in ch.logprobs.text_offset] == echoed.choices[0].logprobs.text_offset

    ok = {"model": server.model, "prompt": "hi"}
    _assert_error(_post(server, "/v1/completions", ok | {"max_tokens": 0}), 400, "echo")
    # Found by the fuzzer: a token id outside the vocabulary reached the echo's decode first (500).
    for bad in ([-1], [3, 10**6]):
        _assert_error(_post(server, "/v1/completions", ok | {"prompt": bad, "echo": True}), 400, "not a token id")
    _assert_error(_post(server, "/v1/chat/completions", {"model": server.model, "max_tokens": 0,
                  "messages": [{"role": "user", "content": "hi"}]}), 400, "max_tokens")  # fmt: skip


def test_echo_logprobs_are_the_same_bits_at_any_concurrency(server: Server) -> None:
    # lm-eval's loglikelihood requests, a batch of prompts per call, alone and among other calls in flight.
    prompts = [[VOCAB[ch] for ch in text] for text in ("a b c d e", "Question: 2+2? Answer: 4", "xyz" * 20)]
    body = loglikelihood_body(server, prompts, max_tokens=1)
    alone = _post(server, "/v1/completions", body).json()["choices"]
    assert [len(ch["logprobs"]["token_logprobs"]) for ch in alone] == [len(p) + 1 for p in prompts]

    async def crowd() -> list[dict]:
        headers = {"content-type": "application/json", **server.headers}
        async with httpx.AsyncClient(timeout=120, headers=headers) as h:
            others = [
                {
                    "model": server.model,
                    "prompt": f"other {i} " * (i + 1),
                    "max_tokens": 12,
                    "temperature": 0.7,
                    "seed": i,
                    "echo": i % 2 == 0,
                    "logprobs": i % 3,
                }  # fmt: skip
                for i in range(8)
            ]
            calls = [h.post(server.url + "/v1/completions", json=b) for b in [*others[:4], body, *others[4:], body]]
            return [r.json() for r in await asyncio.gather(*calls)]

    answers = asyncio.run(crowd())
    assert "error" not in answers[4] and "error" not in answers[-1], answers[4]
    assert answers[4]["choices"] == alone and answers[-1]["choices"] == alone


def test_completion_top_logprobs_hold_the_sampled_and_prompt_token(server: Server) -> None:
    # vLLM's legacy logprobs: the top N and the chosen token wherever it ranked; logprobs 0 is that token alone.
    c = client(server)
    kw = dict(model=server.model, prompt="the cat sat", max_tokens=12, temperature=2.0, seed=9)
    alone = c.completions.create(**kw, logprobs=0).choices[0].logprobs
    assert [list(top.items()) for top in alone.top_logprobs] == [
        [(t, x)] for t, x in zip(alone.tokens, alone.token_logprobs, strict=True)
    ]
    one = c.completions.create(**kw, logprobs=1).choices[0].logprobs
    assert one.tokens == alone.tokens
    assert all(top[t] == x for t, x, top in zip(one.tokens, one.token_logprobs, one.top_logprobs, strict=True))
    assert any(len(top) == 2 for top in one.top_logprobs)  # a sampled token off the top 1: both listed
    assert all(len(top) in (1, 2) for top in one.top_logprobs)
    echo = c.completions.create(model=server.model, prompt="the cat sat", max_tokens=0, echo=True, logprobs=0)
    lp = echo.choices[0].logprobs
    assert lp.top_logprobs[0] is None
    assert all(
        top == {t: x} for t, x, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True)
    )


def test_vllm_sampling_extensions(server: Server) -> None:
    c = client(server)
    p_id = VOCAB["p"]
    base = dict(model=server.model, prompt="hello", max_tokens=8, temperature=0)

    def ask(stream: bool = False, **extra) -> tuple[str, str | None]:
        if stream:
            chunks = [ch for ch in c.completions.create(**base, stream=True, extra_body=extra) if ch.choices]
            return "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason
        r = c.completions.create(**base, extra_body=extra)
        return r.choices[0].text, r.choices[0].finish_reason

    forced_p = {"logit_bias": {str(p_id): 100}}
    assert ask(**forced_p) == ("pppppppp", "length")
    assert ask(**forced_p, stop_token_ids=[p_id]) == ("p", "stop")  # kept: not a special token (vLLM)
    assert ask(**forced_p, stop=["ppp"]) == ("", "stop")
    assert ask(**forced_p, stop=["ppp"], include_stop_str_in_output=True) == ("ppp", "stop")
    assert ask(True, **forced_p, stop=["ppp"], include_stop_str_in_output=True) == ("ppp", "stop")
    # EOS forced, held off for min_tokens; kept in the text when special tokens are not skipped, streamed or not.
    forced_eos = {"logit_bias": {str(p_id): 50, str(TINY_EOS): 100}, "min_tokens": 3}
    assert ask(**forced_eos) == ("ppp", "stop")
    kept = ask(**forced_eos, skip_special_tokens=False)
    assert kept == ("ppp </s>", "stop") and ask(True, **forced_eos, skip_special_tokens=False) == kept
    assert ask(**forced_eos, skip_special_tokens=False, spaces_between_special_tokens=False) == ("ppp</s>", "stop")
    _assert_error(_post(server, "/v1/completions", {**base, "min_tokens": 9}), 400, "min_tokens")
    _assert_error(_post(server, "/v1/completions", {**base, "stop_token_ids": [-1]}), 400, "stop_token_ids")


def test_max_completion_tokens_and_parameters_lockstep_cannot_honour(server: Server) -> None:
    c = client(server)
    messages = [{"role": "user", "content": "hi"}]
    kw = dict(model=server.model, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    assert c.chat.completions.create(**kw, max_completion_tokens=3).usage.completion_tokens == 3
    assert c.chat.completions.create(**kw, max_tokens=4, max_completion_tokens=4).usage.completion_tokens == 4
    chat = {"model": server.model, "messages": messages, "max_tokens": 2}
    err = _assert_error(_post(server, "/v1/chat/completions", chat | {"max_completion_tokens": 3}), 400, "differ")
    assert err["param"] == "max_completion_tokens"

    # Set to what changes nothing, or unknown: answered. Set to anything else: a 400 naming it, never ignored.
    comp = {"model": server.model, "prompt": "hi", "max_tokens": 2}
    harmless = {"use_beam_search": False, "response_format": {"type": "text"}, "store": True, "length_penalty": 1}
    assert _post(server, "/v1/completions", comp | harmless).status_code == 200
    assert _post(server, "/v1/chat/completions", chat | harmless | {"add_generation_prompt": True}).status_code == 200
    for path, body, name in (
        ("/v1/completions", comp | {"logits_processors": ["my.Processor"]}, "logits_processors"),
        ("/v1/completions", comp | {"logprobs": 1, "logprob_token_ids": [5]}, "logprob_token_ids"),
        ("/v1/chat/completions", chat | {"logprobs": True, "logprob_token_ids": [5]}, "logprob_token_ids"),
        ("/v1/completions", comp | {"add_special_tokens": False}, "add_special_tokens"),
        ("/v1/chat/completions", chat | {"add_special_tokens": True}, "add_special_tokens"),
        ("/v1/chat/completions", chat | {"modalities": ["text", "audio"]}, "modalities"),
    ):
        err = _assert_error(_post(server, path, body), 400, name)
        assert err["param"] == name, err


def test_stream_options_need_stream_and_continuous_usage_counts_each_chunk(server: Server) -> None:
    c = client(server)
    comp = {"model": server.model, "prompt": "hello", "max_tokens": 6, "ignore_eos": True}
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True}
    for path, body in (("/v1/completions", comp), ("/v1/chat/completions", chat)):
        # As vLLM: stream_options without stream is a 400; null (or left out) is not.
        err = _assert_error(_post(server, path, body | {"stream_options": {"include_usage": True}}), 400, "stream")
        assert err["param"] == "stream_options"
        assert _post(server, path, body | {"stream_options": None}).status_code == 200

    # vLLM's continuous_usage_stats (guidellm sends it): every chunk carries its choice's usage so far.
    options = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model=server.model, max_tokens=6, stream=True, extra_body={"ignore_eos": True})
    chunks = list(c.completions.create(prompt="hello", n=2, logprobs=0, seed=5, stream_options=options, **kw))
    *deltas, last = chunks
    seen = {0: 0, 1: 0}
    for ch in deltas:
        [choice] = ch.choices
        seen[choice.index] += len(choice.logprobs.tokens)  # a chunk per step: its tokens' logprobs
        assert (ch.usage.prompt_tokens, ch.usage.completion_tokens) == (5, seen[choice.index])
        assert ch.usage.total_tokens == 5 + seen[choice.index]
    assert seen == {0: 6, 1: 6} and not last.choices and last.usage.completion_tokens == 12
    messages = chat["messages"]
    chat_chunks = list(c.chat.completions.create(messages=messages, logprobs=True, stream_options=options, **kw))
    prompt = chat_chunks[-1].usage.prompt_tokens
    assert chat_chunks[0].usage.completion_tokens == 0 and chat_chunks[0].usage.prompt_tokens == prompt  # the role
    counted = 0
    for ch in chat_chunks[1:-1]:
        counted += len(ch.choices[0].logprobs.content)
        assert (ch.usage.prompt_tokens, ch.usage.completion_tokens) == (prompt, counted)
    assert counted == 6 == chat_chunks[-1].usage.completion_tokens
    # Without include_usage it is off, as in vLLM.
    plain = list(c.completions.create(prompt="hello", stream_options={"continuous_usage_stats": True}, **kw))
    assert all(ch.usage is None for ch in plain)


@pytest.fixture(scope="module")
def generation_config_server(tiny_server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny model with sampling defaults in its generation_config.json: greedy, 6 new tokens (and vLLM's
    --return-tokens-as-token-ids, which no other test here reads)."""
    folder = tmp_path_factory.mktemp("genconf") / "tiny-genconf"
    shutil.copytree(tiny_server_model_dir, folder)
    file = folder / "generation_config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | {"temperature": 0.0, "max_new_tokens": 6}))
    log = tmp_path_factory.mktemp("logs") / "genconf.log"
    s = start_server(folder, log, "--log-level", "info", "--no-access-log", "--return-tokens-as-token-ids")
    yield s
    stop_server(s.proc)


def test_the_server_takes_the_model_generation_config_defaults(generation_config_server: Server) -> None:
    s = generation_config_server
    c = client(s)
    kw = dict(model=s.model, extra_body={"ignore_eos": True})
    left_out = c.completions.create(prompt="hello", **kw)
    assert left_out.usage.completion_tokens == 6  # max_new_tokens, not OpenAI's 16
    greedy = c.completions.create(prompt="hello", max_tokens=6, temperature=0, **kw)
    assert left_out.choices[0].text == greedy.choices[0].text  # temperature 0 from the file, not 1
    nulls = _post(s, "/v1/completions", {"model": s.model, "prompt": "hello", "temperature": None, "top_p": None,
                                         "max_tokens": 6, "ignore_eos": True})  # fmt: skip
    assert nulls.json()["choices"][0]["text"] == greedy.choices[0].text  # null is "left out"
    assert c.completions.create(prompt="hello", max_tokens=3, **kw).usage.completion_tokens == 3
    messages = [{"role": "user", "content": "hi"}]
    assert c.chat.completions.create(messages=messages, **kw).usage.completion_tokens == 6
    assert c.chat.completions.create(messages=messages, max_tokens=2, **kw).usage.completion_tokens == 2
    # Explicit values win: a seeded temperature-1 request is not the greedy one.
    sampled = [c.completions.create(prompt="hello", temperature=1.0, seed=i, **kw).choices[0].text for i in range(4)]
    assert any(t != greedy.choices[0].text for t in sampled)
    assert "POST /v1/completions" not in s.log.read_text()  # --no-access-log
    lp = c.completions.create(prompt="hello", max_tokens=3, logprobs=0, **kw).choices[0].logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens)  # --return-tokens-as-token-ids


def _settled(log, quiet: float = 0.3, limit: float = 10.0) -> str:
    """The log's text once it has stopped growing for ``quiet`` seconds."""
    text, deadline = log.read_text(), time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = log.read_text()
        if now == text:
            break
        text = now
    return text


def test_one_access_log_line_per_request_and_never_a_prompt(guarded_server: Server) -> None:
    s = guarded_server  # --log-level info: the access log is on by default
    before = _settled(s.log)  # earlier calls' lines (the fixture's start-up polls) may still be on their way
    secret = "my secret prompt"
    r = _post(s, "/v1/completions", {"model": s.model, "prompt": secret, "max_tokens": 3, "ignore_eos": True},
              {"Authorization": "Bearer env-key"})  # fmt: skip
    assert r.status_code == 200, r.text
    assert httpx.get(s.url + "/health?probe=" + secret.replace(" ", "+")).status_code == 200
    _post(s, "/v1/completions", {"model": s.model}, {"Authorization": "Bearer env-key"})  # a 400
    time.sleep(0.2)
    new = s.log.read_text()[len(before) :]
    lines = [line for line in new.splitlines() if " ms" in line]
    assert len(lines) == 3, new
    call, health, bad = lines
    assert "POST /v1/completions 200 " in call and f"id={r.json()['id']}" in call
    assert "prompt_tokens=16 completion_tokens=3" in call
    assert "GET /health 200 " in health and "POST /v1/completions 400 " in bad
    assert secret not in new and "probe" not in new


def test_prompt_logprobs_in_vllms_shape(server: Server) -> None:
    c = client(server)
    prompt = "the cat sat"
    ids = [TINY_CHARS.index(ch) for ch in prompt]
    r = c.completions.create(
        model=server.model, prompt=prompt, max_tokens=2, temperature=0, n=2, extra_body={"prompt_logprobs": 2}
    )
    for choice in r.choices:
        plp = choice.model_extra["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for t, entry in zip(ids[1:], plp[1:], strict=True):
            # The top 2 ranks and the prompt token itself (keys are token ids, as JSON writes them).
            ranks = sorted(v["rank"] for v in entry.values())
            assert ranks[:2] == [1, 2] and str(t) in entry and len(entry) in (2, 3)
            assert entry[str(t)]["decoded_token"] == TINY_CHARS[t] and entry[str(t)]["logprob"] <= 0
            best = min(entry.values(), key=lambda v: v["rank"])
            assert all(best["logprob"] >= v["logprob"] for v in entry.values())
    # The same numbers as echo's legacy logprobs (one computation), and the same when the prompt is one of three.
    echo = c.completions.create(model=server.model, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert echo.choices[0].logprobs.token_logprobs[1:] == [
        e[str(t)]["logprob"] for t, e in zip(ids[1:], plp[1:], strict=True)
    ]
    batch = c.completions.create(
        model=server.model, prompt=["a b", prompt, "zz top"], max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    assert batch.choices[1].model_extra["prompt_logprobs"] == plp
    plain = c.completions.create(model=server.model, prompt=prompt, max_tokens=1)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None  # null when not asked for, as vLLM sends it

    # Chat: once, at the top of the reply (vLLM's place), over the templated prompt; 0 means the token's own only.
    messages = [{"role": "user", "content": "hi"}]
    chat = c.chat.completions.create(
        model=server.model, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    plp = chat.model_extra["prompt_logprobs"]
    prompt_ids = _post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert len(plp) == chat.usage.prompt_tokens == len(prompt_ids) and plp[0] is None
    assert all(list(e) == [str(t)] for t, e in zip(prompt_ids[1:], plp[1:], strict=True))

    comp = {"model": server.model, "prompt": "hi", "max_tokens": 2}
    err = _assert_error(_post(server, "/v1/completions", comp | {"prompt_logprobs": 1, "stream": True}), 400, "stream")
    assert err["param"] == "prompt_logprobs"
    _assert_error(_post(server, "/v1/completions", comp | {"prompt_logprobs": 21}), 400, "prompt_logprobs")
    _assert_error(_post(server, "/v1/completions", comp | {"prompt_logprobs": -1}), 400, "prompt_logprobs")


def test_return_token_ids_and_the_fields_vllm_sends_as_null(server: Server) -> None:
    c = client(server)
    ids = [VOCAB[ch] for ch in "hello"]
    kw = dict(model=server.model, max_tokens=6, temperature=0.8, seed=3)
    body = {"return_token_ids": True, "ignore_eos": True}
    r = c.completions.create(prompt="hello", n=2, logprobs=0, extra_body=body, **kw)
    for choice in r.choices:
        assert choice.model_extra["prompt_token_ids"] == ids
        assert choice.model_extra["token_ids"] == [VOCAB[t] for t in choice.logprobs.tokens] and len(ids) == 5
    # Streamed: the prompt's ids in each choice's first chunk, then each chunk's new ids, adding up to the same.
    chunks = [ch for ch in c.completions.create(prompt="hello", n=2, stream=True, extra_body=body, **kw) if ch.choices]
    for i, choice in enumerate(r.choices):
        mine = [ch.choices[0].model_extra for ch in chunks if ch.choices[0].index == i]
        assert mine[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in m for m in mine[1:])
        assert [t for m in mine for t in m["token_ids"]] == choice.model_extra["token_ids"]

    messages = [{"role": "user", "content": "hi"}]
    prompt_ids = _post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    chat = c.chat.completions.create(messages=messages, extra_body=body, **kw)
    assert chat.model_extra["prompt_token_ids"] == prompt_ids
    out_ids = chat.choices[0].model_extra["token_ids"]
    assert len(out_ids) == chat.usage.completion_tokens == 6
    streamed = list(c.chat.completions.create(messages=messages, stream=True, extra_body=body, **kw))
    assert streamed[0].model_extra["prompt_token_ids"] == prompt_ids
    assert [t for ch in streamed[1:] for t in ch.choices[0].model_extra["token_ids"]] == out_ids

    # Not asked for: null, in the places vLLM sends them (code reading them gets None, not an AttributeError).
    comp = _post(server, "/v1/completions", {"model": server.model, "prompt": "hi", "max_tokens": 2}).json()
    assert {k: comp["choices"][0][k] for k in ("prompt_logprobs", "prompt_token_ids", "token_ids")} == dict.fromkeys(
        ("prompt_logprobs", "prompt_token_ids", "token_ids")
    )
    reply = _post(server, "/v1/chat/completions", {"model": server.model, "messages": messages, "max_tokens": 2}).json()
    assert reply["prompt_logprobs"] is None and reply["prompt_token_ids"] is None
    assert reply["choices"][0]["token_ids"] is None
    bad = {"model": server.model, "prompt": "hi", "return_token_ids": "yes"}
    _assert_error(_post(server, "/v1/completions", bad), 400, "return_token_ids")


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(server: Server) -> None:
    c = client(server)
    body = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    kw = dict(model=server.model, max_tokens=5, temperature=1.5, seed=4, extra_body=body)
    r = c.completions.create(prompt="hey", logprobs=1, echo=True, **kw).choices[0]
    ids = r.model_extra["prompt_token_ids"] + r.model_extra["token_ids"]
    assert r.logprobs.tokens == [f"token_id:{t}" for t in ids] and r.text.startswith("hey")  # the text is text
    assert all(f"token_id:{t}" in top for t, top in zip(ids[3:], r.logprobs.top_logprobs[3:], strict=True))
    assert all(re.fullmatch(r"token_id:\d+", k) for top in r.logprobs.top_logprobs[1:] for k in top)
    messages = [{"role": "user", "content": "hi"}]
    chat = c.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **kw).choices[0]
    names = [f"token_id:{t}" for t in chat.model_extra["token_ids"]]
    assert [e.token for e in chat.logprobs.content] == names
    assert all(e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 2 for e in chat.logprobs.content)
    assert all(x.token.startswith("token_id:") for e in chat.logprobs.content for x in e.top_logprobs)


def test_truncate_prompt_tokens_keeps_the_last_tokens(server: Server) -> None:
    c = client(server)
    kw = dict(model=server.model, max_tokens=3, temperature=0)
    cut = c.completions.create(prompt="hello world", echo=True, extra_body={"truncate_prompt_tokens": 4}, **kw)
    short = c.completions.create(prompt="orld", echo=True, **kw)
    assert cut.usage.prompt_tokens == 4 and cut.choices[0].text == short.choices[0].text
    assert cut.choices[0].text.startswith("orld")
    right = c.completions.create(
        prompt="hello world", echo=True, extra_body={"truncate_prompt_tokens": 4, "truncation_side": "right"}, **kw
    )
    head = c.completions.create(prompt="hell", echo=True, **kw)
    assert right.usage.prompt_tokens == 4 and right.choices[0].text == head.choices[0].text
    assert right.choices[0].text.startswith("hell")
    # -1: as many as leave room to generate; a prompt longer than the context then fits.
    long = c.completions.create(prompt="ab" * 700, extra_body={"truncate_prompt_tokens": -1}, **kw | {"max_tokens": 1})
    assert long.usage.prompt_tokens == 1023
    messages = [{"role": "user", "content": "a long question"}]
    chat = c.chat.completions.create(messages=messages, extra_body={"truncate_prompt_tokens": 5}, **kw)
    assert chat.usage.prompt_tokens == 5
    comp = {"model": server.model, "prompt": "hi", "max_tokens": 2}
    _assert_error(_post(server, "/v1/completions", comp | {"truncate_prompt_tokens": 0}), 400, "truncate_prompt_tokens")
    _assert_error(_post(server, "/v1/completions", comp | {"truncation_side": "middle"}), 400, "truncation_side")
