"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer over HTTP.

``/tokenize`` takes a ``prompt`` (``add_special_tokens``, default true, adds BOS and the like as a completion
prompt gets them) or chat ``messages`` (rendered with the model's chat template, as chat completions render them:
``add_generation_prompt`` default true, ``continue_final_message``, ``add_special_tokens`` default false, ``tools``,
``chat_template_kwargs``, the keys ``chat_template.TEMPLATE_KWARGS`` allows; tool calls and tool results in the
messages) and answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (image content parts, for a
vision-language model, counted as the image tokens each expands to) (``token_strs`` with ``return_token_strs``).
``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``, special tokens kept. Both run in a worker thread, and a
text longer than any prompt that fits the context is refused before it is tokenized (``ServerState
.max_prompt_chars``), as the completion routes refuse it.
"""

import threading
from typing import Any

from pydantic import BaseModel, Field, model_validator

from lockstep.server.images import image_prompt
from lockstep.server.protocol import STRICT, APIError, ChatMessage, Tool
from lockstep.server.requests import (
    _check_chars,
    chat_text,
    check_template_kwargs,
    check_token_ids,
    parse_body,
)
from lockstep.server.state import ServerState

_UNSUPPORTED = ("chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")


class _TokenizerRequest(BaseModel):
    model_config = STRICT

    model: str | None = None

    def check(self, state: ServerState) -> None:
        if self.model is not None and self.model not in (state.model_name, state.model_path):
            raise APIError(
                404,
                f"The model '{self.model[:200]}' does not exist; this server serves '{state.model_name}'",
                param="model",
                code="model_not_found",
            )
        if state.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        extra = self.model_extra or {}
        bad = [name for name in _UNSUPPORTED if extra.get(name) is not None]
        if bad:
            raise APIError(400, f"unsupported parameter(s): {', '.join(bad)}", param=bad[0])


class TokenizeRequest(_TokenizerRequest):
    """vLLM's two tokenize requests in one: a ``prompt``, or chat ``messages`` with the template's options."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (the template adds them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = None  # rendered into the prompt as chat completions render them
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self


class DetokenizeRequest(_TokenizerRequest):
    tokens: list[int]


def tokenize(state: ServerState, body: bytes, cancelled: threading.Event | None = None) -> dict:
    """A /tokenize body's answer; APIError for anything the client got wrong. Blocking: run it in a worker (set
    ``cancelled`` when the client leaves: the chat template stops rendering)."""
    req = parse_body(body, TokenizeRequest)
    req.check(state)
    check_template_kwargs(req.chat_template_kwargs)
    tok = state.tokenizer
    images: list = []
    if req.messages is not None:
        text = chat_text(state, req, images, "tokenize a prompt instead", cancelled=cancelled)
        special = bool(req.add_special_tokens)
    else:
        text = req.prompt
        _check_chars(state, len(text), "prompt")
        special = req.add_special_tokens is not False
    ids = list(tok.encode(text, add_special_tokens=special))
    if images:  # a vision-language model's image parts: counted as the image tokens they expand to
        ids, _ = image_prompt(state, ids, images)
    return {
        "count": len(ids),
        "max_model_len": state.max_model_len,
        "tokens": ids,
        "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None,
    }


def detokenize(state: ServerState, body: bytes, cancelled: threading.Event | None = None) -> dict:
    """A /detokenize body's answer: the text of its token ids, special tokens kept (vLLM's)."""
    req = parse_body(body, DetokenizeRequest)
    req.check(state)
    check_token_ids(state, req.tokens, "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}
