"""Tool-call schemas and parsers: the Hermes/Qwen ``<tool_call>``, Llama 3 JSON and Mistral ``[TOOL_CALLS]``
formats whole and streamed in any pieces, the "required" array, Qwen3's ``<think>`` split."""

import json
import random

import pytest

from lockstep.structured.tools import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedCall,
    ReasoningStream,
    named_tool_schema,
    parse_required_calls,
    required_tools_schema,
    split_reasoning,
)

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TIME = {"name": "get_time"}

HERMES_CASES = {
    "one call": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [ParsedCall("get_weather", '{"city": "Paris"}')],
    ),
    "text then two calls": (
        'Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"x": [1, 2], "s": "é<"}}</tool_call>',
        "Let me check.",
        [ParsedCall("a", "{}"), ParsedCall("b", '{"x": [1, 2], "s": "é<"}')],
    ),
    "no call": ("Just an answer with <tool and tags > in it.", "Just an answer with <tool and tags > in it.", []),
    "bad JSON stays content": (
        "<tool_call>{not json}</tool_call> ok",
        "<tool_call>{not json}</tool_call> ok",
        [],
    ),
    "left open at the end": (
        'Sure <tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n',
        "Sure",
        [ParsedCall("get_time", '{"tz": "UTC"}')],
    ),
    "arguments as a string": (
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        None,
        [ParsedCall("f", '{"a": 1}')],
    ),
}


@pytest.mark.parametrize("case", list(HERMES_CASES))
def test_hermes_parse(case: str) -> None:
    text, content, calls = HERMES_CASES[case]
    assert HermesToolParser().parse(text) == (content, calls)


@pytest.mark.parametrize("case", list(HERMES_CASES))
@pytest.mark.parametrize("seed", range(6))
def test_hermes_stream_in_any_pieces_matches_the_whole(case: str, seed: int) -> None:
    text, content, calls = HERMES_CASES[case]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = HermesToolParser().stream()
    got_content, got_calls = "", []
    for k, piece in enumerate(pieces):
        c, new = stream.feed(piece, final=k == len(pieces) - 1)
        assert "<tool_call>" not in c or not calls  # a call's tag never leaks into the content
        got_content += c
        got_calls += new
    assert got_calls == calls
    assert (got_content.strip() or None if calls else got_content) == content


LLAMA3_CASES = {
    "one call": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [ParsedCall("get_weather", '{"city": "Paris"}')],
    ),
    "python tag, two calls": (
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1, "}"]}}',
        None,
        [ParsedCall("a", "{}"), ParsedCall("b", '{"x": [1, "}"]}')],
    ),
    "plain answer": ("It is sunny {or so}.", "It is sunny {or so}.", []),
    "leading whitespace": ('\n {"name": "t", "parameters": {"z": "é"}}\n', None, [ParsedCall("t", '{"z": "é"}')]),
    "not a call object": ('{"answer": 4}', '{"answer": 4}', []),
    "cut off": ('{"name": "a", "parameters": {"x": 1', '{"name": "a", "parameters": {"x": 1', []),
    "call then text": ('{"name": "a", "parameters": {}} and then words', "and then words", [ParsedCall("a", "{}")]),
}

MISTRAL_CASES = {
    "array": (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "t", "arguments": {}}]',
        None,
        [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("t", "{}")],
    ),
    "content first": (
        'Let me look. [TOOL_CALLS][{"name": "a", "arguments": {"q": "[x]"}}]',
        "Let me look.",
        [ParsedCall("a", '{"q": "[x]"}')],
    ),
    "newer form": (
        '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}[TOOL_CALLS]a{}',
        None,
        [ParsedCall("get_time", '{"tz": "UTC"}'), ParsedCall("a", "{}")],
    ),
    "no call": ("Plain [TOOL and [brackets].", "Plain [TOOL and [brackets].", []),
    "bad block stays content": ("[TOOL_CALLS] [1, 2] ok", "[TOOL_CALLS] [1, 2] ok", []),
    "cut off": ('[TOOL_CALLS] [{"name": "a", "argu', '[TOOL_CALLS] [{"name": "a", "argu', []),
    # The tag is a special token that skip_special_tokens drops: a bare array of calls at the start still counts.
    "tag skipped": (' [{"name": "a", "arguments": {"k": 1}}]', None, [ParsedCall("a", '{"k": 1}')]),
    "bare array not calls": ("[{}] is empty", "[{}] is empty", []),
    "bare list of words": ("[1] see note", "[1] see note", []),
}

PARSERS = {"hermes": (HermesToolParser, HERMES_CASES), "llama3_json": (Llama3JsonToolParser, LLAMA3_CASES),
           "mistral": (MistralToolParser, MISTRAL_CASES)}  # fmt: skip
ALL_CASES = [(name, case) for name, (_, cases) in PARSERS.items() for case in cases]


@pytest.mark.parametrize("parser, case", ALL_CASES)
def test_parse(parser: str, case: str) -> None:
    cls, cases = PARSERS[parser]
    text, content, calls = cases[case]
    assert cls().parse(text) == (content, calls)


@pytest.mark.parametrize("parser, case", ALL_CASES)
@pytest.mark.parametrize("seed", range(6))
def test_stream_in_any_pieces_matches_the_whole(parser: str, case: str, seed: int) -> None:
    cls, cases = PARSERS[parser]
    text, content, calls = cases[case]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = cls().stream()
    got_content, got_calls = "", []
    for k, piece in enumerate(pieces):
        c, new = stream.feed(piece, final=k == len(pieces) - 1)
        got_content += c
        got_calls += new
    assert got_calls == calls
    assert (got_content.strip() or None if calls else got_content) == content


def test_llama3_and_mistral_streams_send_calls_as_they_close() -> None:
    stream = Llama3JsonToolParser().stream()
    assert stream.feed("<|python") == ("", [])  # could be the tag
    assert stream.feed('_tag|>{"name": "a", "parameters": {}}; {"name"') == ("", [ParsedCall("a", "{}")])
    assert stream.feed(': "b", "parameters": {}}', final=True) == ("", [ParsedCall("b", "{}")])
    stream = MistralToolParser().stream()
    assert stream.feed("Hi [TOOL") == ("Hi ", [])
    assert stream.feed('_CALLS][{"name": "a", "arguments": {}}') == ("", [])  # the array is still open
    assert stream.feed("]", final=True) == ("", [ParsedCall("a", "{}")])


def test_hermes_stream_sends_content_before_the_call_closes() -> None:
    stream = HermesToolParser().stream()
    assert stream.feed("Hello <tool") == ("Hello ", [])  # "<tool" could be a tag: held back
    assert stream.feed('_call>{"name": "f", "arguments": {}') == ("", [])
    assert stream.feed("}</tool_call> bye") == (" bye", [ParsedCall("f", "{}")])
    assert stream.feed(" <b", final=True) == (" <b", [])


def test_required_schema_and_parse() -> None:
    schema = required_tools_schema([WEATHER, TIME], parallel=False)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "maxItems" not in required_tools_schema([WEATHER])
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}])
    assert parse_required_calls(text) == [ParsedCall("get_weather", '{"city": "Oslo"}'), ParsedCall("get_time", "{}")]
    assert parse_required_calls('[{"name": "get_weather", "param') is None
    assert named_tool_schema(WEATHER) == WEATHER["parameters"] and named_tool_schema(TIME)["type"] == "object"


REASONING_CASES = [
    ("<think>\nstep 1\nstep 2\n</think>\n\nThe answer is 4.", False, ("\nstep 1\nstep 2\n", "The answer is 4.")),
    ("The answer is 4.", False, (None, "The answer is 4.")),
    ("<think>cut off mid-thought", False, ("cut off mid-thought", "")),
    ("I reasoned</think>\n\nDone", True, ("I reasoned", "Done")),
    ("no tags at all </ but a stray", False, (None, "no tags at all </ but a stray")),
    ("  <think>a</think>b", False, ("a", "b")),
]


@pytest.mark.parametrize("text, opened, want", REASONING_CASES)
def test_reasoning_split_whole_and_streamed(text: str, opened: bool, want: tuple) -> None:
    assert split_reasoning(text, opened) == want
    for seed in range(8):
        rng = random.Random(seed)
        stream, reasoning, content, pos = ReasoningStream(opened), "", "", 0
        while pos < len(text):
            step = rng.randrange(1, 5)
            r, c = stream.feed(text[pos : pos + step], final=pos + step >= len(text))
            reasoning, content, pos = reasoning + r, content + c, pos + step
        assert (reasoning if stream.reasoned else None, content) == want
