"""vLLM's server surface beyond the OpenAI routes, against a real server: ``/tokenize`` and ``/detokenize``."""

import httpx

from tiny_models import TINY_CHARS, TINY_EOS

from .conftest import Server
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
