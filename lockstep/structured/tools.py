"""Tool calls as text: the JSON schemas that force a call, and the parsers that find calls in a model's output.

- ``named_tool_schema`` / ``required_tools_schema``: what ``tool_choice`` = a named function or "required" makes
  the output follow (vLLM's shapes): the function's parameters as one JSON object, or a non-empty JSON array of
  ``{"name": ..., "parameters": {...}}``.
- ``HermesToolParser``: the Hermes / Qwen format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  anywhere in the text (vLLM's ``--tool-call-parser hermes``). ``parse`` splits a whole output; ``HermesStream``
  does it piece by piece as text streams in, holding back what could still become a tag.
- ``Llama3JsonToolParser``: Llama 3.x's JSON calls (vLLM's ``llama3_json``): an output that is, after an optional
  ``<|python_tag|>``, one or more ``{"name": ..., "parameters": {...}}`` objects separated by ``;``.
- ``MistralToolParser``: Mistral's ``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}`` (or, as
  newer Mistral tokenizers write it, ``[TOOL_CALLS]name[ARGS]{...}``), after any content (vLLM's ``mistral``).
- ``split_reasoning`` / ``ReasoningStream``: Qwen3's ``<think>...</think>`` (vLLM's ``--reasoning-parser qwen3``).

A parsed call is a ``ParsedCall(name, arguments)``, ``arguments`` a JSON text, as the OpenAI API returns it.
"""

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

TOOL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("qwen3",)


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # JSON text of an object


def _parameters(function: dict) -> dict:
    params = function.get("parameters")
    return params if params else {"type": "object", "properties": {}}


def named_tool_schema(function: dict) -> dict:
    """The output of a forced call of ``function`` (an OpenAI function definition): its arguments object."""
    return _parameters(function)


def _rebased(schema: object, base: str) -> object:
    """``schema`` (a copy) with its local references (``"$ref": "#/..."``) pointing at the same places once it sits
    at the JSON pointer ``base`` of a larger schema; iterative, so any depth is safe."""
    todo: list[tuple[object, dict | list]] = []

    def copy(value: object) -> object:
        if isinstance(value, (dict, list)):
            out: dict | list = {} if isinstance(value, dict) else [None] * len(value)
            todo.append((value, out))
            return out
        return value

    root = copy(schema)
    while todo:
        src, dst = todo.pop()
        items = src.items() if isinstance(src, dict) else enumerate(src)
        for k, v in items:
            if k == "$ref" and isinstance(src, dict) and isinstance(v, str) and (v == "#" or v.startswith("#/")):
                dst[k] = "#" + base + v[1:]
            else:
                dst[k] = copy(v)
    return root


def required_tools_schema(functions: list[dict], parallel: bool = True) -> dict:
    """The output of ``tool_choice="required"``: a JSON array of calls, each ``{"name", "parameters"}`` of one of
    ``functions`` (at most one call without ``parallel``). Each function's parameters keep their local references
    (``#/$defs/...``): rebased onto where they sit in the array's schema, so two tools' ``$defs`` never clash."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [f["name"]]},
                "parameters": _rebased(_parameters(f), f"/items/anyOf/{i}/properties/parameters"),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, f in enumerate(functions)
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_required_calls(text: str) -> list[ParsedCall] | None:
    """The calls of a "required" output; None when it is not a complete array of calls (a cut-off output)."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
        return None
    return [ParsedCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in calls]


def _parse_call(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        return ParsedCall(obj["name"], arguments)
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass(frozen=True)
class HermesToolParser:
    """``<tool_call>{json}</tool_call>`` blocks; a last block left open at the end of the output counts too (a
    model may stop right after the JSON). A block whose JSON does not parse stays in the content."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """``(content, calls)``: the text outside the calls (None if only whitespace) and the calls in order."""
        content, calls, pos = [], [], 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                content.append(text[pos:])
                break
            j = text.find(self.end, i + len(self.start))
            body_end = j if j >= 0 else len(text)
            call = _parse_call(text[i + len(self.start) : body_end].strip())
            block_end = body_end + len(self.end) if j >= 0 else len(text)
            content.append(text[pos:i] if call is not None else text[pos:block_end])
            if call is not None:
                calls.append(call)
            pos = block_end
            if j < 0:
                break
        joined = "".join(content)
        if calls:
            joined = joined.strip()
        return (joined or None) if calls else joined, calls

    def stream(self) -> "HermesStream":
        return HermesStream(self)


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesStream:
    """A streamed output, piece by piece: ``feed`` returns the content that can be sent now and the calls that
    just closed. Text that could begin ``<tool_call>`` waits for the next piece; a call is sent whole once its
    closing tag (or the end of the output) arrives."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self.pending = ""  # held back content, or the body of an open call
        self.in_call = False
        self.num_calls = 0

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[ParsedCall]]:
        self.pending += piece
        content, calls = [], []
        p = self.parser
        while True:
            if not self.in_call:
                i = self.pending.find(p.start)
                if i < 0:
                    keep = 0 if final else _held_back(self.pending, p.start)
                    content.append(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                content.append(self.pending[:i])
                self.pending, self.in_call = self.pending[i + len(p.start) :], True
            j = self.pending.find(p.end)
            if j < 0 and not final:
                break
            body = self.pending[:j] if j >= 0 else self.pending
            call = _parse_call(body.strip())
            if call is not None:
                calls.append(call)
            else:  # not a call after all: the block is content
                content.append(p.start + body + (p.end if j >= 0 else ""))
            self.pending = self.pending[j + len(p.end) :] if j >= 0 else ""
            self.in_call = False
            if j < 0:
                break
        self.num_calls += len(calls)
        return "".join(content), calls


def _skip_separators(text: str, separators: str) -> str:
    return text.lstrip(" \t\r\n" + separators)


def _whole(stream, text: str) -> tuple[str | None, list[ParsedCall]]:
    """A whole output parsed as one final piece of a stream (so the two always agree): content None when calls
    were found and nothing but whitespace is left around them."""
    content, calls = stream.feed(text, final=True)
    if calls:
        content = content.strip() or None
    return content, calls


@dataclass(frozen=True)
class Llama3JsonToolParser:
    """Llama 3.x JSON tool calls: an output that begins (after whitespace) with ``<|python_tag|>`` or ``{`` is a
    sequence of ``{"name": ..., "parameters": ...}`` objects separated by ``;``; any other output is content. What
    follows the calls and is not one (or a call that does not parse) is content."""

    tag: str = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        return _whole(self.stream(), text)

    def stream(self) -> "Llama3JsonStream":
        return Llama3JsonStream(self.tag)


def _decode_call(text: str) -> tuple[ParsedCall | None, int]:
    """The JSON object at the start of ``text`` as a call, and where it ends; ``(None, 0)`` while it is incomplete
    or not JSON, ``(None, -1)`` for a complete object that is not a call."""
    try:
        obj, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None, 0
    call = _parse_call(json.dumps(obj)) if isinstance(obj, dict) else None
    return (call, end) if call is not None else (None, -1)


class Llama3JsonStream:
    """``Llama3JsonToolParser`` piece by piece: the first characters decide between content and calls; each call
    is sent once its object closes."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.state = "undecided"  # then "calls" or "content"
        self.pending = ""

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[ParsedCall]]:
        self.pending += piece
        if self.state == "undecided":
            head = self.pending.lstrip()
            if head.startswith(self.tag):
                self.state, self.pending = "calls", head[len(self.tag) :]
            elif head.startswith("{"):
                self.state, self.pending = "calls", head
            elif not final and (not head or self.tag.startswith(head)):
                return "", []  # could still open a call
            else:
                self.state = "content"
        calls: list[ParsedCall] = []
        while self.state == "calls":
            rest = _skip_separators(self.pending, ";")
            if not rest:
                self.pending = "" if final else self.pending
                break
            call, end = _decode_call(rest) if rest.startswith("{") else (None, -1)
            if call is not None:
                calls.append(call)
                self.pending = rest[end:]
            elif end == 0 and not final:  # an object still arriving
                break
            else:  # not a call: the rest of the output is content
                self.state, self.pending = "content", rest
        if self.state == "content":
            out, self.pending = self.pending, ""
            return out, calls
        return "", calls


@dataclass(frozen=True)
class MistralToolParser:
    """Mistral tool calls: content, then ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}`` (a single
    object is taken too), or ``[TOOL_CALLS]name[ARGS]{arguments}`` / ``[TOOL_CALLS]name{arguments}``. A block that
    does not parse stays in the content. Mistral's templates want call ids of 9 letters and digits (``id_length``)."""

    start: str = "[TOOL_CALLS]"
    args: str = "[ARGS]"
    id_length: int = 9

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        return _whole(self.stream(), text)

    def stream(self) -> "MistralStream":
        return MistralStream(self)


class MistralStream:
    """``MistralToolParser`` piece by piece: content streams (holding back what could begin ``[TOOL_CALLS]``), the
    calls after the tag are sent once their JSON closes. ``[TOOL_CALLS]`` is a special token in Mistral's
    tokenizers, which ``skip_special_tokens`` (the default) drops from the text: an output that begins with a JSON
    array of objects is taken as calls without it."""

    def __init__(self, parser: MistralToolParser) -> None:
        self.parser = parser
        self.pending = ""
        self.in_calls = False
        self.at_start = True
        self.tag = parser.start  # the tag the calls being read came after ("" for a bare array at the start)

    def _start(self, final: bool) -> bool:
        """Decide, at the output's start, whether it is a bare array of calls; False while it cannot tell yet."""
        head = self.pending.lstrip()
        if re.match(r"\[\s*\{", head):
            self.in_calls, self.tag, self.pending = True, "", head
        elif not final and (self.parser.start.startswith(head) or re.fullmatch(r"\[\s*", head)):
            return False
        self.at_start = False
        return True

    def feed(self, piece: str, final: bool = False) -> tuple[str, list[ParsedCall]]:
        self.pending += piece
        p, content, calls = self.parser, [], []
        if self.at_start and not self._start(final):
            return "", []
        while True:
            if not self.in_calls:
                i = self.pending.find(p.start)
                if i < 0:
                    keep = 0 if final else _held_back(self.pending, p.start)
                    content.append(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    return "".join(content), calls
                content.append(self.pending[:i])
                self.pending, self.in_calls, self.tag = self.pending[i + len(p.start) :], True, p.start
            found, used = self._calls(self.pending.lstrip(), final)
            if used == 0:  # still arriving
                if not final:
                    return "".join(content), calls
                content.append(self.tag + self.pending)  # never completed: content as it was
                self.pending = ""
            elif found is None:  # not calls: the tag and what follows are content
                content.append(self.tag)
            else:
                calls.extend(found)
                self.pending = self.pending.lstrip()[used:]
            self.in_calls = False

    def _calls(self, text: str, final: bool) -> tuple[list[ParsedCall] | None, int]:
        """The calls at the start of ``text`` and the characters they take; ``(None, 0)`` while incomplete,
        ``(None, -1)`` when what follows the tag is not calls."""
        if text.startswith("["):
            try:
                arr, end = json.JSONDecoder().raw_decode(text)
            except json.JSONDecodeError:
                return None, 0 if not final else -1
            items = arr if isinstance(arr, list) else []
            found = [_decode_call(json.dumps(x))[0] if isinstance(x, dict) else None for x in items]
            if not found or None in found:
                return None, -1
            return found, end
        if text.startswith("{"):
            call, end = _decode_call(text)
            return ([call], end) if call is not None else (None, end)
        # name[ARGS]{...} or name{...}
        j = 0
        while j < len(text) and (text[j].isalnum() or text[j] in "_.-"):
            j += 1
        if j == 0:
            return (None, 0) if not text and not final else (None, -1)
        rest = text[j:]
        args_at = j + len(self.parser.args) if rest.startswith(self.parser.args) else j
        if not rest.startswith(self.parser.args) and self.parser.args.startswith(rest) and not final:
            return None, 0
        body = text[args_at:]
        if not body.startswith("{"):
            return (None, 0) if not body and not final else (None, -1)
        try:
            args, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            return None, 0 if not final else -1
        if not isinstance(args, dict):
            return None, -1
        return [ParsedCall(text[:j], json.dumps(args, ensure_ascii=False))], args_at + end


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """Qwen3's ``(reasoning, content)``: an output that opens with ``<think>`` (or whose prompt ended with it:
    ``opened``) reasons until ``</think>``; the rest, newlines after the tag dropped, is the content. Any other
    output is all content (reasoning None). ``ReasoningStream`` gives the same split piece by piece."""
    stream = ReasoningStream(opened)
    reasoning, content = stream.feed(text, final=True)
    return (reasoning if stream.reasoned else None), content


class ReasoningStream:
    """``split_reasoning`` piece by piece: ``feed`` returns the ``(reasoning, content)`` that can be sent now,
    holding back what could still be ``<think>`` at the start or ``</think>`` at the end."""

    START, END = "<think>", "</think>"

    def __init__(self, opened: bool = False) -> None:
        self.state = "reasoning" if opened else "undecided"
        self.reasoned = opened  # the output reasons (some of it is reasoning)
        self.pending = ""
        self.strip_newlines = False  # right after </think>

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.pending += piece
        if self.state == "undecided":
            head = self.pending.lstrip()
            if head.startswith(self.START):
                self.state, self.reasoned, self.pending = "reasoning", True, head[len(self.START) :]
            elif self.START.startswith(head) and not final:
                return "", ""  # could still open with <think>
            else:
                self.state = "content"
        if self.state == "reasoning":
            j = self.pending.find(self.END)
            if j < 0:
                keep = 0 if final else _held_back(self.pending, self.END)
                out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
                return out, ""
            reasoning, self.pending = self.pending[:j], self.pending[j + len(self.END) :]
            self.state, self.strip_newlines = "content", True
            return reasoning, self._content(final)
        return "", self._content(final)

    def _content(self, final: bool) -> str:
        out, self.pending = self.pending, ""
        if self.strip_newlines:
            out = out.lstrip("\n")
            self.strip_newlines = not out and not final
        return out
