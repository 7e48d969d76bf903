"""From an API request to engine requests: parse and validate the body against the served model, tokenize the
prompt(s), fit ``max_tokens`` to the context and build one ``ChoiceSpec`` per choice of each prompt.

All of it runs in a worker thread (``ServerState.workers``), never on the event loop: ``parse_call``.
"""

import dataclasses
import json
import threading
from typing import Any, NamedTuple, TypeVar

from pydantic import ValidationError

from lockstep.engine.multimodal import MultimodalInputs
from lockstep.layers.token_bans import bad_words_token_ids
from lockstep.multimodal.chat import has_images, split_content, text_chars
from lockstep.sampling_params import SamplingParams
from lockstep.server import chat_template
from lockstep.server.chat_format import ChatFormat
from lockstep.server.images import check_image_count, image_prompt
from lockstep.server.json_body import decode_object
from lockstep.server.protocol import GENERATION_FIELDS, APIError, ChatCompletionRequest, CompletionRequest
from lockstep.server.state import ServerState
from lockstep.structured.grammar import GrammarError
from lockstep.structured.limits import check_text
from lockstep.structured.params import StructuredOutputsParams
from lockstep.structured.tools import ReasoningStream, named_tool_schema, required_tools_schema

AnyRequest = TypeVar("AnyRequest", CompletionRequest, ChatCompletionRequest)
_UNION_TAGS = {"text", "texts", "ids", "id_lists", "str"}  # in a validation error's location, not fields


class ChoiceSpec(NamedTuple):
    """One engine request of an API call: a prompt's token ids and the sampling params of one of its choices
    (for chat, how its text becomes the message: tool calls, reasoning)."""

    prompt_ids: list[int]
    params: SamplingParams
    chat_format: ChatFormat | None = None
    prompt_text: str | None = None  # a completion prompt's text, for echo (decoded from prompt_ids if given as ids)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs asked for (the reply's top N of each position)
    mm: MultimodalInputs | None = None  # the prompt's images (a vision-language model's chat), shared by its choices


def parse_call(
    state: ServerState, body: bytes, chat: bool, cancelled: threading.Event | None = None
) -> tuple[AnyRequest, list[ChoiceSpec]]:
    """A /v1/completions (or, with ``chat``, /v1/chat/completions) body as its request and engine requests;
    APIError for anything the client got wrong. Blocking: run it in ``state.workers``; set ``cancelled`` when the
    client leaves (the chat template stops rendering: ``chat_template.RenderCancelled``)."""
    if chat:
        req = parse_body(body, ChatCompletionRequest)
        return req, chat_specs(state, req, cancelled)
    req = parse_body(body, CompletionRequest)
    return req, completion_specs(state, req)


def parse_body(body: bytes, model: type[AnyRequest]) -> AnyRequest:
    """The request body as ``model``; 400 with an OpenAI-style error for bad JSON or an invalid field."""
    data = decode_object(body)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        path = ""
        for x in err["loc"]:
            if isinstance(x, int):
                path += f"[{x}]"
            elif x not in _UNION_TAGS and "[" not in x:
                path += f".{x}" if path else x
        if not err["loc"]:  # a check of the whole body (a model validator)
            raise APIError(400, f"invalid request: {err['msg']}") from None
        raise APIError(400, f"invalid parameter {path}: {err['msg']}", param=str(err["loc"][0])) from None


def completion_specs(state: ServerState, req: CompletionRequest) -> list[ChoiceSpec]:
    """A /v1/completions call's engine requests: the ``n`` choices of the first prompt, then of the next, ...

    With ``echo`` each choice also computes its prompt's logprobs (when ``logprobs`` is asked for: the legacy API
    returns them before the generated tokens'); ``max_tokens`` 0 then generates one token that the reply leaves out,
    as vLLM does, so the call costs one prefill."""
    _check_common(state, req)
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens must be >= 1 (0 only with echo: the prompt alone)", param="max_tokens")
    _check_num_seqs(state, req)
    structured = _compile(state, *_structured_outputs(state, req))
    prompts = [_truncate(state, req, p) for p in _completion_prompts(state, req)]
    if "max_tokens" in req.model_fields_set or "max_tokens" not in state.engine.engine.default_sampling:
        wanted = 1 if req.max_tokens == 0 else req.max_tokens
        max_tokens = [_check_length(state, len(p), wanted, "prompt") for p in prompts]
    else:  # the model's generation config's max_new_tokens, as far as the context allows
        max_tokens = [_default_max_tokens(state, len(p), "prompt") for p in prompts]
    if req.echo:  # the echo decodes the prompts here, before the engine checks their ids
        for ids in prompts:
            check_token_ids(state, ids, "prompt", "prompt token")
    texts = _echo_texts(state, req, prompts) if req.echo else [None] * len(prompts)
    logprobs, asked_prompt = (_whole_vocab(state, k) for k in (req.logprobs, req.prompt_logprobs))
    wanted = [k for k in (logprobs if req.echo else None, asked_prompt) if k is not None]
    prompt_logprobs = max(wanted) if wanted else None
    defaults = state.engine.engine.default_sampling
    return [
        ChoiceSpec(
            p,
            dataclasses.replace(
                _params(req, m, logprobs, i, defaults, structured, state.tokenizer),
                prompt_logprobs=prompt_logprobs,
            ),
            prompt_text=text,
            prompt_logprobs=asked_prompt,
        )
        for p, m, text in zip(prompts, max_tokens, texts, strict=True)
        for i in range(req.n)
    ]


def check_token_ids(state: ServerState, ids: list[int], param: str, what: str = "token") -> None:
    """A 400 for a token id outside the vocabulary, before the tokenizer sees it (the engine checks prompts too,
    but echo and /detokenize decode first)."""
    vocab = state.engine.engine.vocab_size
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise APIError(400, f"{what} {t} at index {i} is not a token id in [0, {vocab})", param=param)


def _echo_texts(state: ServerState, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """The text each prompt is echoed as: as sent, or its token ids (as truncated) decoded."""
    p = req.prompt
    if req.truncate_prompt_tokens is not None and state.tokenizer is not None:
        return [state.tokenizer.decode(ids) for ids in prompts]
    if isinstance(p, str):
        return [p]
    if p and isinstance(p[0], str):
        return list(p)
    if state.tokenizer is None:
        return ["" for _ in prompts]
    return [state.tokenizer.decode(ids) for ids in prompts]


def chat_specs(
    state: ServerState, req: ChatCompletionRequest, cancelled: threading.Event | None = None
) -> list[ChoiceSpec]:
    """A /v1/chat/completions call's engine requests: the ``n`` choices of the templated conversation."""
    _check_common(state, req)
    check_template_kwargs(req.chat_template_kwargs)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    fmt, forced = _tool_format(state, req)
    param, structured = _structured_outputs(state, req)
    if forced is not None:
        if structured is not None:
            raise APIError(400, f"{param} cannot constrain the output of a forced tool call", param=param)
        param, structured = "tools", forced
    structured = _compile(state, param, structured)
    given = req.model_fields_set
    if "max_tokens" in given and "max_completion_tokens" in given and req.max_tokens != req.max_completion_tokens:
        raise APIError(
            400,
            f"max_completion_tokens ({req.max_completion_tokens}) and max_tokens ({req.max_tokens}) differ: give one "
            "(max_tokens is the older name of max_completion_tokens)",
            param="max_completion_tokens",
        )
    prompt, opened, closed, mm = _chat_prompt(state, req, cancelled)
    if mm is not None and req.truncate_prompt_tokens is not None:
        raise APIError(400, "truncate_prompt_tokens would cut the prompt's images", param="truncate_prompt_tokens")
    prompt = _truncate(state, req, prompt)
    if fmt.reasoning:
        fmt = ChatFormat(fmt.tool_mode, fmt.function, fmt.parser, True, opened)
        if structured is not None and not closed:
            # As vLLM: the constraint starts once the reasoning has ended (unless the prompt already ended it, as
            # Qwen3's template does with enable_thinking off).
            structured = dataclasses.replace(structured, reasoning_end=ReasoningStream.END)
    if given & {"max_tokens", "max_completion_tokens"} or "max_tokens" not in state.engine.engine.default_sampling:
        max_tokens = _check_length(state, len(prompt), req.max_completion_tokens or req.max_tokens, "messages")
    else:  # the model's generation config's max_new_tokens, as far as the context allows
        max_tokens = _default_max_tokens(state, len(prompt), "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    logprobs, asked_prompt = (_whole_vocab(state, k) for k in (logprobs, req.prompt_logprobs))
    defaults = state.engine.engine.default_sampling
    return [
        ChoiceSpec(
            prompt,
            dataclasses.replace(
                _params(req, max_tokens, logprobs, i, defaults, structured, state.tokenizer),
                prompt_logprobs=asked_prompt,
            ),
            fmt,
            prompt_logprobs=asked_prompt,
            mm=mm,
        )
        for i in range(req.n)
    ]


def _truncate(state: ServerState, req: CompletionRequest | ChatCompletionRequest, ids: list[int]) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last k prompt tokens (-1: as many as leave room to generate one), or
    the first k with ``truncation_side`` "right"."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    k = state.max_model_len - 1 if k == -1 else k
    return ids[:k] if req.truncation_side == "right" else ids[-k:]


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured_outputs(
    state: ServerState, req: CompletionRequest | ChatCompletionRequest
) -> tuple[str, StructuredOutputsParams | None]:
    """The call's output constraint and the parameter that set it: ``structured_outputs``, a ``guided_*`` field
    or ``response_format``; 400 for a bad one, or for more than one (or a schema's JSON text past the size limit,
    before it is parsed)."""
    given: list[tuple[str, StructuredOutputsParams]] = []
    candidates: list[tuple[str, dict]] = []  # (parameter, StructuredOutputsParams fields)
    if req.structured_outputs is not None:
        candidates.append(("structured_outputs", req.structured_outputs.model_dump(by_alias=True)))
    candidates += [
        (name, {kind: getattr(req, name)}) for name, kind in _GUIDED.items() if getattr(req, name) is not None
    ]
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        candidates.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        candidates.append(("response_format", {"json": rf.json_schema.schema_}))
    for name, fields in candidates:
        try:
            check_text(fields.get("json"), state.engine.engine.grammar_limits)
            given.append((name, StructuredOutputsParams(**fields)))
        except ValueError as e:
            raise APIError(400, str(e), param=name) from None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(400, f"only one of these may constrain the output, got {names}", param=given[1][0])
    return given[0] if given else ("structured_outputs", None)


def _compile(state: ServerState, param: str, params: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
    """Compile the constraint here, in a request thread, so that the engine step finds it in the cache; 400 for
    one that does not compile."""
    if params is not None:
        try:
            state.engine.engine.grammars.compile(params)
        except GrammarError as e:
            raise APIError(400, str(e), param=param) from None
    return params


def _tool_format(state: ServerState, req: ChatCompletionRequest) -> tuple[ChatFormat, StructuredOutputsParams | None]:
    """How the reply's text becomes a message, and the constraint a forced tool call puts on it (vLLM's rules:
    ``tool_choice`` defaults to "auto" with tools, "auto" needs ``--enable-auto-tool-choice`` and a parser)."""
    reasoning = state.reasoning_parser is not None
    tools = [t.function for t in req.tools or []]
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if choice == "none":
        return ChatFormat(reasoning=reasoning), None
    if choice == "auto":
        if not state.enable_auto_tool_choice or state.tool_call_parser is None:
            raise APIError(
                400,
                '"auto" tool choice needs the server to run with --enable-auto-tool-choice and --tool-call-parser',
                param="tool_choice",
            )
        return ChatFormat("auto", parser=state.tool_call_parser, reasoning=reasoning), None
    as_dicts = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "required":
        schema = required_tools_schema(as_dicts, req.parallel_tool_calls)
        fmt = ChatFormat("required", parser=state.tool_call_parser, reasoning=reasoning)
        return fmt, StructuredOutputsParams(json=schema)
    name = choice.function.name
    function = next((f for f in as_dicts if f["name"] == name), None)
    if function is None:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice")
    fmt = ChatFormat("named", name, state.tool_call_parser, reasoning=reasoning)
    return fmt, StructuredOutputsParams(json=named_tool_schema(function))


def _whole_vocab(state: ServerState, k: int | None) -> int | None:
    """A logprobs count with vLLM's -1 (the whole vocabulary) as the vocabulary's size."""
    return state.engine.engine.vocab_size if k == -1 else k


def _check_logprobs(state: ServerState, req: CompletionRequest | ChatCompletionRequest) -> None:
    """vLLM's cap on logprobs (``--max-logprobs``; -1 asks for the whole vocabulary): a 400 naming the parameter."""
    engine = state.engine.engine
    asked = [("prompt_logprobs", req.prompt_logprobs)]
    asked.append(
        ("top_logprobs", req.top_logprobs) if isinstance(req, ChatCompletionRequest) else ("logprobs", req.logprobs)
    )
    for name, n in asked:
        if n is None:
            continue
        if n == -1:
            n = engine.vocab_size
        if n > engine.max_logprobs:
            raise APIError(
                400,
                f"Requested {name} of {n}, which is greater than max allowed: {engine.max_logprobs} (the server's "
                "--max-logprobs; -1 asks for the whole vocabulary)",
                param=name,
            )


def _check_common(state: ServerState, req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.model not in (state.model_name, state.model_path):
        raise APIError(
            404,
            f"The model '{req.model[:200]}' does not exist; this server serves '{state.model_name}'",
            param="model",
            code="model_not_found",
        )
    bad = req.unsupported()
    if bad:
        raise APIError(400, f"unsupported parameter(s) with non-default values: {', '.join(bad)}", param=bad[0])
    options = req.stream_options
    if not req.stream and options is not None and (options.model_fields_set or options.model_extra):  # as vLLM
        raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")
    if req.stream and req.prompt_logprobs is not None:  # as vLLM refuses them
        raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    _check_logprobs(state, req)


def _check_num_seqs(state: ServerState, req: CompletionRequest) -> None:
    """Refuse a call of more sequences (``n`` times its prompts) than the server takes, before tokenizing any."""
    p = req.prompt
    num_prompts = len(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else 1
    limit = state.engine.limits.max_seqs_per_request
    if num_prompts * req.n > limit:
        raise APIError(
            400,
            f"this request needs {num_prompts * req.n} sequences (n times the number of prompts); the server takes "
            f"at most {limit} per request",
            param="n" if req.n > 1 else "prompt",
        )


def _too_long(state: ServerState, what: str, has: str) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {state.max_model_len} tokens, but the {what} has {has}.",
        param="messages" if what == "messages" else "prompt",
        code="context_length_exceeded",
    )


def _check_chars(state: ServerState, num_chars: int, what: str) -> None:
    """Refuse a text too long for the context before tokenizing it (``ServerState.max_prompt_chars``)."""
    limit = state.max_prompt_chars
    if limit is not None and num_chars > limit:
        raise _too_long(state, what, f"{num_chars} characters: more than {limit}, which no text that fits exceeds")


def _check_length(state: ServerState, prompt_len: int, max_tokens: int | None, what: str) -> int:
    limit = state.max_model_len
    if prompt_len >= limit:
        raise _too_long(state, what, f"{prompt_len} tokens (at most {limit - 1} leave room for one generated token)")
    if max_tokens is None:
        return limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} for the completion).",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def _default_max_tokens(state: ServerState, prompt_len: int, what: str) -> int:
    """The generation config's ``max_new_tokens``, cut to the room the context leaves after the prompt."""
    room = _check_length(state, prompt_len, None, what)
    return min(state.engine.engine.default_sampling["max_tokens"], room)


def _params(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    index: int,
    defaults: dict | None = None,
    structured: StructuredOutputsParams | None = None,
    tokenizer=None,
) -> SamplingParams:
    """Choice ``index``'s SamplingParams; ``defaults`` (the model's generation config) fill what ``req`` left out;
    ``tokenizer`` (the server's) tokenizes ``bad_words``."""
    sampling = {name: getattr(req, name) for name in GENERATION_FIELDS}
    bad_words_ids = None
    if req.bad_words and tokenizer is not None:  # tokenized here, in a request thread, not on the engine's
        try:
            bad_words_ids = bad_words_token_ids(req.bad_words, tokenizer)
        except ValueError as e:
            raise APIError(400, str(e), param="bad_words") from None
    sampling |= {k: v for k, v in (defaults or {}).items() if k in sampling and k not in req.model_fields_set}
    try:
        return SamplingParams(
            **sampling,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=req.stop,
            logprobs=logprobs,
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
            structured_outputs=structured,
            min_tokens=req.min_tokens,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            bad_words_token_ids=bad_words_ids,
        ).for_choice(index)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _completion_prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], str)):
        if state.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        texts = [p] if isinstance(p, str) else p
        for t in texts:
            if req.truncate_prompt_tokens is None:  # a longer text may still fit once truncated
                _check_chars(state, len(t), "prompt")
        return [list(state.tokenizer.encode(t)) for t in texts]
    if not p:
        raise APIError(400, "the prompt is empty", param="prompt")
    return [p] if isinstance(p[0], int) else p


def template_message(m, images: list | None = None) -> dict:
    """One request message as the chat template reads it: tool calls' arguments as objects (what Hugging Face
    templates expect; vLLM does the same), tool results with their call's id. With ``images``, image content parts
    become ``{"type": "image"}`` parts and their sources (URLs) are appended to it; without, they are refused."""
    if images is not None and has_images(m.content):
        content, sources = split_content(m.content)
        images += sources
    else:
        content = m.text()
    out: dict = {"role": m.role, "content": content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                arguments = json.loads(c.function.arguments)
            except json.JSONDecodeError:
                arguments = c.function.arguments
            calls.append({"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": arguments}})
        out["tool_calls"] = calls
    return out


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """400 naming the first ``chat_template_kwargs`` key a client may not set (``chat_template.TEMPLATE_KWARGS``)."""
    why = chat_template.check_template_kwargs(kwargs or {})
    if why is not None:
        raise APIError(400, why, param="chat_template_kwargs")


def render_chat(
    state: ServerState,
    messages: list[dict],
    *,
    tools: list[dict] | None,
    kwargs: dict[str, Any] | None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    truncating: bool = False,
    cancelled: threading.Event | None = None,
) -> str:
    """The model's chat template over ``messages``, bounded in time and characters (``chat_template.render``): at
    most ``max_prompt_chars`` (a longer text cannot fit the context), or twice the body limit when the prompt is
    to be truncated; 400 past a bound or when the template refuses the conversation."""
    limit = state.max_prompt_chars or 2 * state.http.max_body_bytes
    if truncating:
        limit = max(limit, 2 * state.http.max_body_bytes)
    try:
        return chat_template.render(
            state.tokenizer,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            kwargs=kwargs,
            max_chars=limit,
            cancelled=cancelled,
        )
    except chat_template.RenderLimitError as e:
        if e.kind == "size" and not truncating:
            raise _too_long(state, "messages", f"more characters once templated: {e}") from None
        raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None
    except chat_template.TemplateError as e:  # a template that rejects the conversation
        raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None


def chat_text(
    state: ServerState,
    req,
    images: list,
    instead: str,
    truncating: bool = False,
    cancelled: threading.Event | None = None,
) -> str:
    """``req.messages`` rendered by the model's chat template with ``req``'s tools and template options, the images
    collected into ``images`` (chat completions and /tokenize). 400 without a template (``instead`` says what to
    use), for a message the template cannot take, too many images, or a conversation (before and after rendering)
    longer than a prompt may be; ``truncating`` skips the length checks (the prompt is cut to fit later)."""
    if not getattr(state.tokenizer, "chat_template", None):
        raise APIError(400, f"this model has no chat template: {instead}", param="messages")
    try:
        messages = [template_message(m, images) for m in req.messages]
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    check_image_count(state, len(images))
    if not truncating:
        _check_chars(state, sum(text_chars(m["content"]) for m in messages), "messages")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    text = render_chat(
        state,
        messages,
        tools=tools,
        kwargs=req.chat_template_kwargs,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        truncating=truncating,
        cancelled=cancelled,
    )
    if not truncating:
        _check_chars(state, len(text), "messages")
    return text


def _chat_prompt(
    state: ServerState, req: ChatCompletionRequest, cancelled: threading.Event | None = None
) -> tuple[list[int], bool, bool, MultimodalInputs | None]:
    """The templated conversation's token ids (image placeholders expanded), whether the text ends inside an open
    ``<think>`` (opened) or right after a ``</think>`` (closed: the reply is not to reason), and its images."""
    images: list = []
    text = chat_text(state, req, images, "use /v1/completions", req.truncate_prompt_tokens is not None, cancelled)
    tail = text.rstrip()
    ids, mm = image_prompt(
        state, list(state.tokenizer.encode(text, add_special_tokens=False)), images, req.mm_processor_kwargs
    )
    return ids, tail.endswith(ReasoningStream.START), tail.endswith(ReasoningStream.END), mm
