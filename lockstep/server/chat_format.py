"""How a chat choice's generated text becomes the assistant's message: plain content, a forced tool call, the
calls of "required", calls parsed out of free text (``tool_choice="auto"``), and reasoning split off.

``ChatFormat`` is decided once per call (``requests``); ``message`` shapes a finished choice, ``stream`` gives a
``ChoiceStream`` whose ``feed`` turns each new piece of text into the delta fields to send (vLLM's shapes).
"""

import secrets
import string
import uuid
from dataclasses import dataclass

from lockstep.structured.tools import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedCall,
    ReasoningStream,
    parse_required_calls,
    split_reasoning,
)

TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser}
_ID_CHARS = string.ascii_letters + string.digits


def tool_call_id(parser: str | None = None) -> str:
    """A new call id: Mistral's templates refuse any but 9 letters and digits; the others take vLLM's form."""
    if parser == "mistral":
        return "".join(secrets.choice(_ID_CHARS) for _ in range(MistralToolParser.id_length))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(index: int, call: ParsedCall, with_index: bool, parser: str | None = None) -> dict:
    fn = {"name": call.name, "arguments": call.arguments}
    out = {"id": tool_call_id(parser), "type": "function", "function": fn}
    return {"index": index, **out} if with_index else out


def _finish(reason: str | None, called: bool, mode: str | None) -> str | None:
    """OpenAI's finish_reason (vLLM matches it since vllm-project/vllm#25054): "tool_calls" once the model chose to
    call (auto, required) and stopped by itself; a forced named call stops with "stop", streamed or not."""
    return "tool_calls" if called and reason == "stop" and mode != "named" else reason


@dataclass(frozen=True)
class ChatFormat:
    """``tool_mode``: None (plain text), "named" (the output is ``function``'s arguments), "required" (a JSON
    array of calls) or "auto" (calls parsed with ``parser``); ``reasoning``: split ``<think>`` off first
    (``opened``: the prompt already opened it)."""

    tool_mode: str | None = None
    function: str | None = None
    parser: str | None = None
    reasoning: bool = False
    opened: bool = False

    @property
    def plain(self) -> bool:
        """True when the text is the content as it is (no tools to find, no reasoning to split)."""
        return self.tool_mode in (None, "none") and not self.reasoning

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished choice, and its finish_reason (``_finish``)."""
        msg: dict = {"role": "assistant"}
        if self.reasoning:
            reasoning, text = split_reasoning(text, self.opened)
            # vLLM's current name, and the one it used before (which LangChain and older clients read)
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        calls: list[ParsedCall] = []
        content: str | None = text
        if self.tool_mode == "named":  # cut off (finish_reason "length") too: a call, as vLLM and the stream send it
            calls, content = [ParsedCall(self.function, text)], None
        elif self.tool_mode == "required":
            parsed = parse_required_calls(text)
            if parsed:
                calls, content = parsed, None
        elif self.tool_mode == "auto":
            content, calls = TOOL_PARSERS[self.parser]().parse(text)
        msg["content"] = content
        if calls:
            msg["tool_calls"] = [_call(i, c, False, self.parser) for i, c in enumerate(calls)]
        return msg, _finish(finish_reason, bool(calls), self.tool_mode)

    def stream(self) -> "ChoiceStream":
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: ``feed(piece, finished)`` -> the delta's fields (content, reasoning and its older
    name reasoning_content, tool_calls; absent when empty); ``finish_reason`` maps the engine's reason at the end."""

    def __init__(self, fmt: ChatFormat) -> None:
        self.fmt = fmt
        self.reasoning = ReasoningStream(fmt.opened) if fmt.reasoning else None
        self.parser = TOOL_PARSERS[fmt.parser]().stream() if fmt.tool_mode == "auto" else None
        self.buffer = ""  # "required": the whole output, parsed at the end
        self.num_calls = 0
        self.named_id: str | None = None

    def feed(self, piece: str, finished: bool) -> dict:
        delta: dict = {}
        if self.reasoning is not None:
            reasoning, piece = self.reasoning.feed(piece, finished)
            if reasoning:
                delta["reasoning"] = delta["reasoning_content"] = reasoning
        mode = self.fmt.tool_mode
        if mode == "named":
            # The arguments stream as they come, under one call opened with the first piece.
            if piece or (finished and self.named_id is None):
                call: dict = {"index": 0, "function": {"arguments": piece}}
                if self.named_id is None:
                    self.named_id = tool_call_id(self.fmt.parser)
                    call |= {"id": self.named_id, "type": "function"}
                    call["function"] = {"name": self.fmt.function, "arguments": piece}
                delta["tool_calls"] = [call]
                self.num_calls = 1
            return delta
        if mode == "required":
            self.buffer += piece
            if finished:
                calls = parse_required_calls(self.buffer) or []
                if calls:
                    delta["tool_calls"] = [_call(i, c, True, self.fmt.parser) for i, c in enumerate(calls)]
                    self.num_calls = len(calls)
                elif self.buffer:
                    delta["content"] = self.buffer  # not a complete array (cut off): sent as it is
            return delta
        if self.parser is not None:
            piece, calls = self.parser.feed(piece, finished)
            if calls:
                first = self.num_calls
                delta["tool_calls"] = [_call(first + i, c, True, self.fmt.parser) for i, c in enumerate(calls)]
                self.num_calls += len(calls)
        if piece:
            delta["content"] = piece
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return _finish(reason, self.num_calls > 0, self.fmt.tool_mode)
