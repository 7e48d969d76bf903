"""Structured outputs and tool calls through a real ``lockstep serve``, driven by the official ``openai`` client:
``response_format``, vLLM's ``structured_outputs`` and ``guided_*``, ``tools`` with each ``tool_choice``, tool
messages in the history, streamed tool-call deltas, reasoning split off, and a 400 for each bad input."""

import concurrent.futures
import json
import re
from pathlib import Path
from typing import Literal

import openai
import pydantic
import pytest
from tiny_models import save_tiny_llama

from .conftest import Server, start_server, stop_server

# A Hermes/Qwen-style template for the character tokenizer: tools listed up front, calls as <tool_call> blocks,
# tool results with their call's id.
TOOLS_TEMPLATE = (
    "{% if tools %}tools: {% for t in tools %}{{ t | tojson }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}assistant: {% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}\n"
    "{% elif m.role == 'tool' %}tool {{ m.tool_call_id }}: {{ m.content }}\n"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}assistant:"
)
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "the forecast", "parameters": SCHEMA},
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
MESSAGES = [{"role": "user", "content": "weather in Oslo?"}]


def check_forecast(obj: object) -> None:
    assert isinstance(obj, dict) and set(obj) == {"city", "days", "unit"}, obj
    assert isinstance(obj["city"], str) and len(obj["city"]) <= 8
    assert isinstance(obj["days"], int) and 1 <= obj["days"] <= 14 and obj["unit"] in ("C", "F")


@pytest.fixture(scope="module")
def tools_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = save_tiny_llama(tmp_path_factory.mktemp("tools") / "tiny-tools", max_position_embeddings=2048)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


@pytest.fixture(scope="module")
def tools_server(tools_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / "server-tools.log"
    s = start_server(tools_model_dir, log, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    stop_server(s.proc)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.api_key or "none", max_retries=0, timeout=120)


def chat(server: Server, **kwargs):
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("max_tokens", 120)
    return client(server).chat.completions.create(model=server.model, **kwargs)


def stream_chat(server: Server, **kwargs) -> list:
    return list(chat(server, stream=True, **kwargs))


# -- structured outputs ----------------------------------------------------------------------------------------


def test_response_format_json_schema_parses_and_validates(tools_server: Server) -> None:
    for seed in (1, 2, 3):
        r = chat(
            tools_server,
            temperature=0.7,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}},
        )
        assert r.choices[0].finish_reason == "stop"
        check_forecast(json.loads(r.choices[0].message.content))


def test_openai_parse_with_a_pydantic_model(tools_server: Server) -> None:
    # The openai client's own structured-output helper: a strict json_schema from a pydantic model.
    class Forecast(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=8)
        unit: Literal["C", "F"]
        rain: bool

    r = client(tools_server).chat.completions.parse(
        model=tools_server.model, messages=MESSAGES, response_format=Forecast, max_tokens=120, temperature=0
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and parsed.unit in ("C", "F")


def test_json_object_and_the_stream_agrees(tools_server: Server) -> None:
    kwargs = dict(temperature=0.9, seed=5, max_tokens=200, response_format={"type": "json_object"})
    whole = chat(tools_server, **kwargs).choices[0]
    chunks = stream_chat(tools_server, **kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.message.content
    if whole.finish_reason == "stop":
        assert isinstance(json.loads(whole.message.content), dict)
    else:  # a random model may write a long object: what it wrote is a JSON object's beginning
        assert whole.message.content.lstrip().startswith("{")


def test_vllm_structured_outputs_and_guided_params(tools_server: Server) -> None:
    c = client(tools_server)
    m = tools_server.model
    r = c.completions.create(
        model=m, prompt="id: ", max_tokens=30, temperature=1.0, seed=3, n=3,
        extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{4}"}},
    )  # fmt: skip
    assert len(r.choices) == 3 and all(re.fullmatch(r"[A-Z]{2}-[0-9]{4}", ch.text) for ch in r.choices)
    colours = ["red", "green", "blue"]
    for extra in ({"structured_outputs": {"choice": colours}}, {"guided_choice": colours}):
        r = chat(tools_server, temperature=1.0, seed=9, extra_body=extra)
        assert r.choices[0].message.content in colours
    r = c.completions.create(model=m, prompt="n", max_tokens=20, temperature=0, extra_body={"guided_regex": "[0-9]+!"})
    assert re.fullmatch(r"[0-9]+!", r.choices[0].text)
    r = chat(tools_server, temperature=0, extra_body={"guided_json": SCHEMA})
    check_forecast(json.loads(r.choices[0].message.content))
    grammar = 'start: "go " DIR " " NUM\nDIR: "north" | "south"\nNUM: /[1-9]/'
    r = c.completions.create(model=m, prompt="x", max_tokens=20, temperature=0, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"go (north|south) [1-9]", r.choices[0].text)
    r = chat(
        tools_server, temperature=0, extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
    )
    assert " " not in r.choices[0].message.content.replace(json.loads(r.choices[0].message.content)["city"], "")


def test_constrained_output_is_the_same_alone_and_under_load(tools_server: Server) -> None:
    constrained = dict(temperature=0.8, seed=21, logprobs=True, top_logprobs=2, extra_body={"guided_json": SCHEMA})

    def key(r) -> tuple:
        lp = [(t.token, t.logprob) for t in r.choices[0].logprobs.content]
        return r.choices[0].message.content, tuple(lp)

    alone = key(chat(tools_server, **constrained))
    jobs = [constrained] * 3 + [dict(temperature=1.0, seed=s, max_tokens=60) for s in range(9)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda kw: chat(tools_server, **kw), jobs))
    assert [key(r) for r in results[:3]] == [alone] * 3
    check_forecast(json.loads(alone[0]))


# -- tools -----------------------------------------------------------------------------------------------------


def test_named_tool_choice_returns_valid_arguments(tools_server: Server) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(tools_server, tools=[WEATHER, CLOCK], tool_choice=named, temperature=0.5, seed=4)
    choice = r.choices[0]
    # A forced call ends with "stop", as OpenAI's does (and vLLM's since vllm-project/vllm#25054); "auto" and
    # "required" calls end with "tool_calls".
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    check_forecast(json.loads(call.function.arguments))
    # Streamed: the name once, then argument pieces that add up to the same arguments.
    chunks = stream_chat(tools_server, tools=[WEATHER, CLOCK], tool_choice=named, temperature=0.5, seed=4)
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert len(deltas) > 1 and deltas[0].function.name == "get_weather" and deltas[0].id
    assert all(d.index == 0 and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_named_tool_call_cut_off_is_still_a_call(tools_server: Server) -> None:
    # A non-strict schema and too few tokens: the partial arguments are the call's, whole or streamed (vLLM's).
    named = {"type": "function", "function": {"name": "get_weather"}}
    loose = {**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "object"}}}
    kw = dict(tools=[loose], tool_choice=named, temperature=0.9, seed=2, max_tokens=5)
    choice = chat(tools_server, **kw).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    chunks = stream_chat(tools_server, **kw)
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"


def test_required_tool_choice_returns_calls(tools_server: Server) -> None:
    r = chat(tools_server, tools=[WEATHER, CLOCK], tool_choice="required", temperature=0.6, seed=8, max_tokens=300)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            check_forecast(args)
        else:
            assert call.function.name == "get_time" and args == {}
    chunks = stream_chat(tools_server, tools=[WEATHER, CLOCK], tool_choice="required", temperature=0.6, seed=8,
                         max_tokens=300)  # fmt: skip
    streamed = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    want = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [(d.function.name, d.function.arguments) for d in streamed] == want
    assert [d.index for d in streamed] == list(range(len(want)))


def _tool_with_defs(name: str, options: list[str]) -> dict:
    """A tool whose parameters reach their options through a local ``$ref`` (pydantic writes schemas so)."""
    params = {
        "type": "object",
        "properties": {"options": {"$ref": "#/$defs/Options"}},
        "required": ["options"],
        "$defs": {
            "Options": {
                "type": "object",
                "properties": {"unit": {"enum": options}},
                "required": ["unit"],
                "additionalProperties": False,
            }
        },
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "parameters": params}}


def test_required_tool_choice_keeps_each_tools_local_defs(tools_server: Server) -> None:
    # Two tools with a "$defs" of the same name and different contents: each call follows its own tool's.
    tools = [_tool_with_defs("get_weather", ["C", "F"]), _tool_with_defs("get_depth", ["m", "ft"])]
    r = chat(tools_server, tools=tools, tool_choice="required", temperature=0.7, seed=3, max_tokens=300)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    units = {"get_weather": ("C", "F"), "get_depth": ("m", "ft")}
    for call in calls:
        assert set(json.loads(call.function.arguments)) == {"options"}
        assert json.loads(call.function.arguments)["options"]["unit"] in units[call.function.name]


HERMES_REPLY = (
    'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "unit": "C"}}</tool_call>'
)


def test_auto_tool_choice_parses_hermes_calls(tools_server: Server) -> None:
    # The random model is steered to write a Hermes call (a one-string choice): the parser finds it.
    kwargs = dict(tools=[WEATHER], temperature=0, extra_body={"guided_choice": [HERMES_REPLY]}, max_tokens=200)
    choice = chat(tools_server, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Oslo"
    chunks = stream_chat(tools_server, **kwargs)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert content.strip() == "Checking." and "<tool" not in content
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (0, "get_weather", call.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Without a call in the text, auto answers in plain content.
    plain = chat(tools_server, tools=[WEATHER], temperature=0, extra_body={"guided_choice": ["No need."]})
    assert plain.choices[0].message.content == "No need." and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


OTHER_FORMATS = {
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2, "unit": "C"}}; '
    '{"name": "get_time", "parameters": {}}',
    "mistral": 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "unit": "C"}}, '
    '{"name": "get_time", "arguments": {}}]',
}


@pytest.fixture(scope="module", params=list(OTHER_FORMATS))
def parser_server(request, tools_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("logs") / f"server-{request.param}.log"
    s = start_server(tools_model_dir, log, "--enable-auto-tool-choice", "--tool-call-parser", request.param)
    s.parser = request.param
    yield s
    stop_server(s.proc)


def test_llama3_json_and_mistral_parsers(parser_server: Server) -> None:
    reply = OTHER_FORMATS[parser_server.parser]
    kwargs = dict(tools=[WEATHER, CLOCK], temperature=0, extra_body={"guided_choice": [reply]}, max_tokens=300)
    choice = chat(parser_server, **kwargs).choices[0]
    want = [("get_weather", {"city": "Oslo", "days": 2, "unit": "C"}), ("get_time", {})]
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == ("Checking." if parser_server.parser == "mistral" else None)
    if parser_server.parser == "mistral":  # Mistral's templates take only ids of 9 letters and digits
        assert all(re.fullmatch("[A-Za-z0-9]{9}", c.id) for c in calls)
    chunks = stream_chat(parser_server, **kwargs)
    streamed = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in streamed] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(calls)
    ]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content.strip() == (choice.message.content or "") and "TOOL" not in content and "python" not in content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # A reply that is not a call stays content; the call's id round-trips through a tool message.
    plain = chat(parser_server, tools=[WEATHER], temperature=0, extra_body={"guided_choice": ["No {need}."]})
    assert plain.choices[0].message.content == "No {need}." and plain.choices[0].finish_reason == "stop"
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [calls[1].model_dump()]},
        {"role": "tool", "tool_call_id": calls[1].id, "content": "12:00"},
    ]
    r = chat(parser_server, messages=history, tools=[WEATHER, CLOCK], tool_choice="none", max_tokens=3)
    assert r.choices[0].message.content is not None and not r.choices[0].message.tool_calls
    import httpx

    # /tokenize renders the conversation as the chat route does: tools, the call and its result.
    body = {"model": parser_server.model, "messages": history, "tools": [WEATHER, CLOCK], "return_token_strs": True}
    rendered = httpx.post(parser_server.url + "/tokenize", json=body, timeout=60).json()
    text = "".join(rendered["token_strs"])
    assert f"tool {calls[1].id}: 12:00" in text and '"get_time"' in text and "<tool_call>" in text
    assert rendered["count"] == r.usage.prompt_tokens


def test_tool_round_trip_reaches_the_template(tools_server: Server, tools_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    named = {"type": "function", "function": {"name": "get_weather"}}
    first = chat(tools_server, tools=[WEATHER], tool_choice=named, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    r = chat(tools_server, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=5, temperature=0)
    assert r.choices[0].message.content is not None and not r.choices[0].message.tool_calls
    # The prompt the server templated holds the tools, the call and the result: its length is the local render's
    # (one token per character here).
    tok = AutoTokenizer.from_pretrained(tools_model_dir)
    local_history = [dict(m) for m in history]
    local_history[1] = {**local_history[1], "content": ""}
    local_history[1]["tool_calls"] = [
        {
            **call.model_dump(),
            "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
        }
    ]
    text = tok.apply_chat_template(local_history, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert f"tool {call.id}: sunny, 21 C" in text and '"get_weather"' in text and "<tool_call>" in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


# A model whose tokenizer writes <think> and </think> as one token each (added, not special, as Qwen3's are) and
# whose template opens the reasoning, or closes it at once with enable_thinking off (as Qwen3's does).
THINK_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>{% endif %}"
)


@pytest.fixture(scope="module")
def think_server(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    folder = save_tiny_llama(tmp_path_factory.mktemp("think") / "tiny-think", vocab_size=100)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINK_TEMPLATE
    tok.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    (folder / "chat_template.jinja").write_text(THINK_TEMPLATE)
    end_id = tok.convert_tokens_to_ids("</think>")
    assert tok.encode("a</think>b", add_special_tokens=False)[1] == end_id
    log = tmp_path_factory.mktemp("logs") / "server-think.log"
    s = start_server(folder, log, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser",
                     "qwen3")  # fmt: skip
    s.end_id = end_id
    yield s
    stop_server(s.proc)


def test_constraint_starts_after_the_reasoning(think_server: Server) -> None:
    # The prompt opens <think>; a bias makes the model close it at once; the choice then holds (vLLM's rule).
    end = {str(think_server.end_id): 100}
    kwargs = dict(temperature=0, logit_bias=end, extra_body={"guided_choice": ["Take a coat."]})
    r = chat(think_server, **kwargs)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content, r.choices[0].finish_reason) == ("", "Take a coat.", "stop")
    assert msg.model_extra["reasoning"] == ""  # vLLM's current name, beside the older one
    chunks = stream_chat(think_server, **kwargs)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == "Take a coat."
    # Reasoning is free: without the bias the model reasons (text no constraint would allow) until it closes the
    # reasoning itself, and only what follows keeps to the choice.
    free = chat(think_server, temperature=0, max_tokens=12, extra_body={"guided_choice": ["Take a coat."]})
    msg = free.choices[0].message
    assert msg.reasoning_content and not "Take a coat.".startswith(msg.reasoning_content)
    assert "Take a coat.".startswith(msg.content or "")
    chunks = stream_chat(think_server, temperature=0, max_tokens=12, extra_body={"guided_choice": ["Take a coat."]})
    for name in ("reasoning_content", "reasoning"):
        streamed = "".join(getattr(ch.choices[0].delta, name, None) or "" for ch in chunks if ch.choices)
        assert streamed == msg.reasoning_content == msg.model_extra["reasoning"]
    # With thinking off the template closes the reasoning itself: the constraint holds from the first token.
    no_thinking = {"guided_choice": ["Take a coat."], "chat_template_kwargs": {"enable_thinking": False}}
    off = chat(think_server, temperature=0, extra_body=no_thinking)
    assert (off.choices[0].message.reasoning_content, off.choices[0].message.content) == (None, "Take a coat.")
    # A forced call's arguments come after the reasoning too, and parse.
    named = {"type": "function", "function": {"name": "get_weather"}}
    call = chat(think_server, tools=[WEATHER], tool_choice=named, temperature=0, logit_bias=end).choices[0]
    assert call.message.reasoning_content == "" and call.finish_reason == "stop"
    check_forecast(json.loads(call.message.tool_calls[0].function.arguments))


# -- bad input -------------------------------------------------------------------------------------------------


def _error(server: Server, path: str, body: dict) -> dict:
    import httpx

    r = httpx.post(server.url + path, json={"model": server.model, **body}, headers=server.headers, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
         "response_format", "frob"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", ""),
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar", "nowhere"),
        ({"guided_choice": []}, "guided_choice", "choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format", "only one"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "nope"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex", "forced tool call"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", ""),
    ],
)  # fmt: skip
def test_bad_constraints_and_tools_are_400(tools_server: Server, body: dict, param: str, words: str) -> None:
    err = _error(tools_server, "/v1/chat/completions", {"messages": MESSAGES, **body})
    assert err["param"] == param and words in err["message"], err


def test_auto_tool_choice_needs_the_server_flags(server: Server) -> None:
    # The default server has no tool parser: tools (auto by default) are refused, as vLLM does; the other choices
    # need none.
    err = _error(server, "/v1/chat/completions", {"messages": MESSAGES, "tools": [WEATHER]})
    assert "--enable-auto-tool-choice" in err["message"] and err["param"] == "tool_choice"
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(server, tools=[WEATHER], tool_choice=named, temperature=0)
    check_forecast(json.loads(r.choices[0].message.tool_calls[0].function.arguments))
    err = _error(server, "/v1/completions", {"prompt": "x", "guided_json": {"type": "object", "properties": 5}})
    assert err["param"] == "guided_json"


def test_embedded_model_fills_a_schema(embedded_server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["country", "capital"],
    }
    r = client(embedded_server).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        max_tokens=40,
        temperature=0,
    )
    answer = json.loads(r.choices[0].message.content)
    assert set(answer) == {"country", "capital"} and "Paris" in answer["capital"]
