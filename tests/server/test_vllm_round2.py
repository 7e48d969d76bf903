"""vLLM's server surface, round two (issue 28), against real servers with the ``openai`` client: allowed_token_ids
and bad_words, chat's echo / add_generation_prompt / continue_final_message and custom roles, logprobs -1 under
--max-logprobs, cached_tokens and per-request metrics, and the extra routes and metric names."""

from tiny_models import TINY_CHARS

from .conftest import Server
from .test_openai_api import _assert_error, _post, client


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
