"""From engine outputs to an OpenAI response: one JSON body once every choice has finished (``_reply``), or a
server-sent event stream of deltas (``_stream``). Both build their choices with ``_Response.choice``.

A whole reply (its logprobs decode a token each, its JSON grows with the output) is built and encoded in a
worker thread; a stream's chunks, a step's new tokens each, on the event loop.
"""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from lockstep.engine.detokenizer import IncrementalDetokenizer
from lockstep.outputs import Logprob, RequestOutput
from lockstep.server.async_engine import EngineError, RequestGroup
from lockstep.server.chat_format import ChoiceStream
from lockstep.server.metrics import per_request_metrics
from lockstep.server.middleware import ACCESS_KEY, new_error_id, server_error_body
from lockstep.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from lockstep.server.requests import ChoiceSpec
from lockstep.server.state import ServerState

# How often a non-streaming request checks that its client is still connected.
DISCONNECT_POLL_SECONDS = 0.25

log = logging.getLogger("uvicorn.error")


class _StopPrefix:
    """How long a prefix of ``stop`` the text fed so far ends with, short of the whole string: the text to hold
    back, since it may begin the stop string. Knuth-Morris-Pratt: each character is fed once, so a stream's
    checks cost O(its text + the stop string), not the O(text x stop) of trying every prefix at every chunk."""

    def __init__(self, stop: str) -> None:
        self.stop, self.k = stop, 0
        # border[i]: the longest proper prefix of stop[: i + 1] that is also its suffix
        self.border = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.border[k - 1]
            k += stop[i] == stop[k]
            self.border[i] = k

    def feed(self, chars: str) -> int:
        stop, border, k = self.stop, self.border, self.k
        for c in chars:
            if k == len(stop):  # the whole stop string (the engine ends the text there): go on from its border
                k = border[k - 1]
            while k and stop[k] != c:
                k = border[k - 1]
            k += stop[k] == c
        self.k = k
        return border[k - 1] if k == len(stop) else k


class _TextStream:
    """Incremental text of one choice: holds back a trailing partial UTF-8 character and any tail that could
    begin a stop string, so the deltas add up to the final (stop-cut) text."""

    def __init__(self, tokenizer, stops: list[str], options: tuple[bool, bool] = (True, True)) -> None:
        self.stops, self.sent = stops, ""
        self.prefixes = [_StopPrefix(s) for s in stops]
        self.fed = 0  # characters of the text fed to the prefixes
        self.held = 0  # characters at the end of the text that may begin a stop string
        self.num_tokens = 0  # tokens whose logprobs were sent
        self.ids_sent = 0  # tokens whose ids were sent (return_token_ids)
        self.echoed = False  # the prompt was sent (completions with echo)
        # options: skip_special_tokens, spaces_between_special_tokens, as the engine decodes the final text
        self.detokenizer = IncrementalDetokenizer(tokenizer, *options) if tokenizer is not None else None

    def delta(self, out: RequestOutput) -> str:
        if self.detokenizer is None:
            return ""
        if out.finished:
            text = out.text
        else:
            # With stop strings the engine keeps the text up to date (it only grows until the request finishes);
            # otherwise decode only the newest tokens. Either way a partial UTF-8 character is held back until its
            # last byte arrives.
            if self.stops:
                text = out.text
                if len(text) > self.fed:
                    new = text[self.fed :]
                    self.held = max(p.feed(new) for p in self.prefixes)
                    self.fed = len(text)
                text = text[: len(text) - self.held]
            else:
                self.detokenizer.update(out.token_ids)
                text = self.detokenizer.text
        if not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent) :], text
        return piece


def _token_str(tokenizer, token_id: int, as_ids: bool = False) -> str:
    """A token as logprobs name it: its text, or (vLLM's ``return_tokens_as_token_ids``, or without a tokenizer)
    ``token_id:N``."""
    return tokenizer.decode([token_id]) if tokenizer is not None and not as_ids else f"token_id:{token_id}"


def _tops(out: RequestOutput, start: int, n: int, sampled: bool = False) -> list[dict[int, float]]:
    """The top ``n`` ``{token_id: logprob}`` of each step from ``start`` on (``out.logprobs`` also holds the sampled
    token, ranked wherever it fell); with ``sampled``, the sampled token too wherever it ranked (the legacy
    completions' logprobs, as vLLM writes them: ``logprobs: 0`` gives the sampled token alone)."""
    if out.logprobs is None:
        return [{} for _ in out.token_ids[start:]]
    steps = out.logprobs[start:]
    tokens = out.token_ids[start:] if sampled else [None] * len(steps)
    return [
        {t: lp.logprob for t, lp in sorted(step.items(), key=lambda item: item[1].rank) if lp.rank <= n or t == token}
        for token, step in zip(tokens, steps, strict=True)
    ]


def _offsets(tokens: list[str], start: int) -> list[int]:
    offsets, pos = [], start
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return offsets


def _completion_logprobs(tok, out: RequestOutput, start: int, offset: int, n: int, as_ids: bool = False) -> dict:
    tokens = [_token_str(tok, t, as_ids) for t in out.token_ids[start:]]
    tops = _tops(out, start, n, True)
    return {
        "tokens": tokens,
        "token_logprobs": out.token_logprobs[start:],
        "top_logprobs": [{_token_str(tok, t, as_ids): lp for t, lp in top.items()} for top in tops],
        "text_offset": _offsets(tokens, offset),
    }


def _prompt_logprobs(tok, out: RequestOutput, n: int, as_ids: bool = False) -> dict:
    """An echoed prompt's part of the legacy logprobs: each prompt token, its logprob and the top ``n`` at its
    position (None for the first token, which nothing predicts), from the engine's prompt logprobs."""

    def name(token_id: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None and not as_ids:
            return lp.decoded_token
        return _token_str(tok, token_id, as_ids)

    ids, dicts = out.prompt_token_ids, out.prompt_logprobs
    tokens, logprobs, tops = [name(ids[0])], [None], [None]
    for t, d in zip(ids[1:], dicts[1:], strict=True):
        tokens.append(name(t, d[t]))
        logprobs.append(d[t].logprob)
        ranked = sorted(d.items(), key=lambda item: item[1].rank)
        tops.append({name(k, v): v.logprob for k, v in ranked if v.rank <= n or k == t})  # the prompt token too
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": _offsets(tokens, 0)}


def _vllm_prompt_logprobs(tok, out: RequestOutput, n: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of a reply: for each prompt position, None for the first (nothing predicts it),
    then ``{token_id: {"logprob", "rank", "decoded_token"}}`` of the top ``n`` and the prompt token itself."""
    ids, dicts = out.prompt_token_ids, out.prompt_logprobs
    result: list[dict | None] = [None]
    for t, d in zip(ids[1:], dicts[1:], strict=True):
        ranked = sorted(d.items(), key=lambda item: item[1].rank)
        result.append(
            {
                k: {
                    "logprob": max(v.logprob, -9999.0),  # -inf is not JSON; vLLM clamps it the same way
                    "rank": v.rank,
                    "decoded_token": v.decoded_token if v.decoded_token is not None else _token_str(tok, k),
                }
                for k, v in ranked
                if v.rank <= n or k == t
            }
        )
    return result


def _chat_logprobs(tok, out: RequestOutput, start: int, n: int, as_ids: bool = False) -> dict:
    def entry(t: int, lp: float) -> dict:
        s = _token_str(tok, t, as_ids)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    content = []
    steps = zip(out.token_ids[start:], out.token_logprobs[start:], _tops(out, start, n), strict=True)
    for t, lp, top in steps:
        content.append(entry(t, lp) | {"top_logprobs": [entry(k, v) for k, v in top.items()]})
    return {"content": content}


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


@dataclass(frozen=True)
class _Response:
    """What the reply and the stream of one API call share: its requests, their outputs and how a choice looks."""

    state: ServerState
    group: RequestGroup
    id: str
    request_ids: list[str]  # choice i is request_ids[i]
    specs: list[ChoiceSpec]
    chat: bool
    arrival: float  # perf_counter() when the requests were submitted
    created: int  # unix time, as OpenAI's "created"
    echo: bool = False  # completions: each choice begins with its prompt (text, and logprobs when asked for)
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (the one token generated is left out)
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and the output's token ids
    as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    role: str = "assistant"  # chat: the reply's role (vLLM's: the final message's without a generation prompt)
    chat_echo: str = ""  # chat's echo: the final message's content, put before each choice's
    access: dict = field(default_factory=dict)  # the call's access log fields (middleware.ACCESS_KEY)

    @property
    def logprobs(self) -> bool:
        return self.specs[0].params.logprobs is not None

    def head(self, stream: bool) -> dict:
        if self.chat:
            obj = "chat.completion.chunk" if stream else "chat.completion"
        else:
            obj = "text_completion"  # OpenAI names completion chunks the same as whole completions
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.state.model_name,
            "system_fingerprint": self.state.fingerprint,
        }

    def choice(
        self,
        index: int,
        out: RequestOutput,
        text: str,
        start: int = 0,
        offset: int = 0,
        delta: bool = False,
        shaper: ChoiceStream | None = None,
        echo: bool | None = None,
    ) -> dict:
        """Choice ``index`` of a reply (``text`` is the whole text), or of a stream chunk (``delta``: ``text`` is
        the new piece, which begins at character ``offset`` of the choice's generated text; logprobs from token
        ``start`` on). ``shaper``: the choice's tool-call and reasoning stream, for chat calls that have one;
        ``echo`` (default: the call's) puts the prompt first, as a completion with echo begins."""
        tok = self.state.tokenizer
        n = self.specs[index].params.logprobs
        finish_reason = out.finish_reason
        if self.chat:
            lp = _chat_logprobs(tok, out, start, n, self.as_ids) if self.logprobs else None
            fmt = self.specs[index].chat_format
            if delta and shaper is not None:
                body = {"delta": shaper.feed(text, out.finished)}
                finish_reason = shaper.finish_reason(out.finish_reason)
            elif delta:
                body = {"delta": {"content": text} if text else {}}
            elif fmt is not None and not fmt.plain:
                message, finish_reason = fmt.message(text, out.finish_reason)
                body = {"message": message | {"role": self.role}}
            else:
                body = {"message": {"role": self.role, "content": text}}
            if self.chat_echo and not delta:  # vLLM's: the echo before whatever content the reply has
                body["message"]["content"] = self.chat_echo + (body["message"]["content"] or "")
            choice = {"index": index, **body, "logprobs": lp, "finish_reason": finish_reason}
            if not delta:  # vLLM's fields: token_ids null unless asked for (a stream's chunks add it in _stream)
                choice["stop_reason"] = out.outputs[0].stop_reason
                choice["token_ids"] = self.output_ids(out)
            elif finish_reason is not None:
                choice["stop_reason"] = out.outputs[0].stop_reason
            return choice
        if self.echo_only:  # the token generated to compute the prompt is not part of the answer
            text, start = "", len(out.token_ids)
        prompt_text = (self.specs[index].prompt_text or "") if self.echo else ""
        echo_now = self.echo if echo is None else echo
        lp = None
        if self.logprobs:
            lp = _completion_logprobs(tok, out, start, offset + len(prompt_text), n, self.as_ids)
            if echo_now:
                head = _prompt_logprobs(tok, out, n, self.as_ids)
                lp = {key: head[key] + lp[key] for key in lp}
        text = prompt_text + text if echo_now else text
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}
        if not delta or out.finish_reason is not None:  # vLLM's: the stop string or token id that ended it
            choice["stop_reason"] = out.outputs[0].stop_reason
        k = self.specs[index].prompt_logprobs
        if not delta:  # vLLM's fields, in each completion choice, null unless asked for
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(tok, out, k) if k is not None else None
            choice["prompt_token_ids"] = self.prompt_ids(index)
            choice["token_ids"] = self.output_ids(out)
        return choice

    def prompt_ids(self, index: int) -> list[int] | None:
        """Choice ``index``'s prompt token ids, for ``return_token_ids`` (else None)."""
        return list(self.specs[index].prompt_ids) if self.token_ids else None

    def output_ids(self, out: RequestOutput, start: int = 0) -> list[int] | None:
        """The output's token ids from ``start`` on, for ``return_token_ids`` (else None)."""
        if not self.token_ids:
            return None
        return [] if self.echo_only else list(out.token_ids[start:])

    def usage(self, finals: list[RequestOutput]) -> dict:
        prompt = sum(len(s.prompt_ids) for s in self.specs)
        completion = 0 if self.echo_only else sum(len(o.token_ids) for o in finals)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        details = None  # vLLM's: null unless --enable-prompt-tokens-details
        if self.state.enable_prompt_tokens_details:
            details = {"cached_tokens": sum(o.num_cached_tokens or 0 for o in finals)}
        return usage | {"prompt_tokens_details": details}

    def timings(self, finals: list[RequestOutput]) -> dict | None:
        """vLLM's per-request ``metrics``: with --enable-per-request-metrics, for a call of one prompt and one
        choice (else null)."""
        if not self.state.enable_per_request_metrics or len(finals) != 1:
            return None
        return per_request_metrics(finals[0].metrics, len(finals[0].token_ids))

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The group's outputs as steps make them, timing the first one and the whole call."""
        metrics, first = self.state.metrics, True
        generated: dict[str, int] = {}  # each request's tokens so far: the access line counts them however the call
        async for out in self.group:  # ends (an error event after 92 chunks used to count 0)
            if first:
                metrics.first_token_seconds.observe(time.perf_counter() - self.arrival)
                first = False
            if not self.echo_only:
                self.access["completion_tokens"] += len(out.token_ids) - generated.get(out.request_id, 0)
                generated[out.request_id] = len(out.token_ids)
            yield out
        metrics.request_seconds.observe(time.perf_counter() - self.arrival)


async def respond(
    state: ServerState,
    request: Request,
    req: CompletionRequest | ChatCompletionRequest,
    specs: list[ChoiceSpec],
    chat: bool,
) -> Response:
    """Submit one engine request per choice of ``specs`` and answer the call, streaming if it asked to."""
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    ids = [f"{response_id}-{i}" for i in range(len(specs))]
    try:
        group = await state.engine.submit(
            [(rid, s.prompt_ids, s.params, s.mm) for rid, s in zip(ids, specs, strict=True)]
        )
    except ValueError as e:
        raise APIError(400, str(e)) from None
    echo = not chat and req.echo
    r = _Response(
        state,
        group,
        response_id,
        ids,
        specs,
        chat,
        arrival=time.perf_counter(),
        created=int(time.time()),
        echo=echo,
        echo_only=echo and req.max_tokens == 0,
        token_ids=req.return_token_ids,
        as_ids=req.return_tokens_as_token_ids or state.return_tokens_as_token_ids,
        role=req.response_role if chat else "assistant",
        chat_echo=_chat_echo(req) if chat else "",
        access={"id": response_id, "prompt_tokens": sum(len(s.prompt_ids) for s in specs), "completion_tokens": 0},
    )
    request.scope[ACCESS_KEY] = r.access
    if not req.stream:
        return await _reply(r, request)
    # vLLM's --enable-force-include-usage: the usage chunk whatever the request says (not the continuous one)
    return _stream(r, req.include_usage or state.enable_force_include_usage, req.continuous_usage)


def _chat_echo(req: ChatCompletionRequest) -> str:
    """What vLLM's chat ``echo`` puts first: the final message's content when the reply continues its role (no
    generation prompt), its text parts joined by newlines; else nothing."""
    last = req.messages[-1]
    if not req.echo or last.role != req.response_role or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part["text"] for part in last.content if part.get("type") == "text")


async def _reply(r: _Response, request: Request) -> Response:
    """One JSON body once every choice has finished, or 499 if the client leaves first."""

    async def collect() -> dict[str, RequestOutput]:
        return {out.request_id: out async for out in r.outputs() if out.finished}

    collector = asyncio.ensure_future(collect())
    while not collector.done():
        await asyncio.wait({collector}, timeout=DISCONNECT_POLL_SECONDS)
        if not collector.done() and await request.is_disconnected():
            collector.cancel()  # leaving the group's iteration aborts its requests and frees their blocks
            return Response(status_code=499)
    finals = collector.result()

    def render() -> bytes:
        # The pure-Python encoder (iterencode) yields the GIL as it goes; json.dumps would hold it throughout.
        ordered = [finals[rid] for rid in r.request_ids]
        choices = [r.choice(i, out, out.text) for i, out in enumerate(ordered)]
        body = r.head(stream=False) | {"choices": choices, "usage": r.usage(ordered), "metrics": r.timings(ordered)}
        k = r.specs[0].prompt_logprobs
        if r.chat:  # vLLM's: a chat reply's prompt logprobs and ids, once (every choice shares the prompt); or null
            body["prompt_logprobs"] = _vllm_prompt_logprobs(r.state.tokenizer, ordered[0], k) if k is not None else None
            body["prompt_token_ids"] = r.prompt_ids(0)
        return "".join(json.JSONEncoder(ensure_ascii=False).iterencode(body)).encode()

    body = await asyncio.get_running_loop().run_in_executor(r.state.workers, render)
    return Response(body, media_type="application/json")


def _stream(r: _Response, include_usage: bool, continuous_usage: bool = False) -> StreamingResponse:
    """Server-sent events: a chunk whenever a choice gains text (or logprobs, or finishes), then the usage if asked
    for, then ``[DONE]``. With ``continuous_usage`` (vLLM's ``continuous_usage_stats``) every chunk also carries
    its choice's usage so far: the choice's prompt and the tokens generated up to it."""
    head = r.head(stream=True)
    index = {rid: i for i, rid in enumerate(r.request_ids)}
    options = [(s.params.skip_special_tokens, s.params.spaces_between_special_tokens) for s in r.specs]
    streams = [_TextStream(r.state.tokenizer, s.params.stop, o) for s, o in zip(r.specs, options, strict=True)]
    shapers = [s.chat_format.stream() if s.chat_format and not s.chat_format.plain else None for s in r.specs]

    def chunk(choice: dict, num_tokens: int) -> dict:
        body = head | {"choices": [choice]}
        if continuous_usage:
            prompt = len(r.specs[choice["index"]].prompt_ids)
            completion = 0 if r.echo_only else num_tokens
            body["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
        return body

    async def events() -> AsyncIterator[bytes]:
        finals: list[RequestOutput] = []
        try:
            if r.chat:  # a chat stream opens each choice with the reply's role
                for i in range(len(r.specs)):
                    delta = {"role": r.role, "content": ""}
                    body = chunk({"index": i, "delta": delta, "logprobs": None, "finish_reason": None}, 0)
                    if r.token_ids and i == 0:  # vLLM's: the prompt's ids in the stream's first chunk
                        body["prompt_token_ids"] = r.prompt_ids(0)
                    yield _sse(body)
                for i in range(len(r.specs) if r.chat_echo else 0):  # vLLM's echo: a chunk of its own per choice
                    delta = {"content": r.chat_echo}
                    yield _sse(chunk({"index": i, "delta": delta, "logprobs": None, "finish_reason": None}, 0))
            async for out in r.outputs():
                i = index[out.request_id]
                stream = streams[i]
                start = stream.num_tokens
                text = stream.delta(out)
                stream.num_tokens = len(out.token_ids)
                echo = r.echo and not stream.echoed  # the choice's first chunk begins with its prompt
                if not text and not out.finished and not r.logprobs and not echo:
                    continue
                stream.echoed = True
                if out.finished:
                    finals.append(out)
                choice = r.choice(
                    i, out, text, start, offset=len(stream.sent) - len(text), delta=True, shaper=shapers[i], echo=echo
                )
                if shapers[i] is not None and not choice["delta"] and not out.finished and not r.logprobs:
                    continue  # all of it held back (a tag in the making)
                if r.token_ids:  # vLLM's: each chunk's new token ids; completions' first chunk has the prompt's
                    if not r.chat and stream.ids_sent == 0:
                        choice["prompt_token_ids"] = r.prompt_ids(i)
                    choice["token_ids"] = r.output_ids(out, stream.ids_sent)
                    stream.ids_sent = len(out.token_ids)
                yield _sse(chunk(choice, len(out.token_ids)))
            if include_usage:
                body = head | {"choices": [], "usage": r.usage(finals)}
                if (metrics := r.timings(finals)) is not None:  # vLLM's: in the usage chunk only, when there are any
                    body["metrics"] = metrics
                yield _sse(body)
            yield _sse("[DONE]")
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except EngineError as e:  # the engine's own answer (shutting down, overload, time limit): said as it is
            yield _sse(error_body(str(e), e.type, code=e.code))
            yield _sse("[DONE]")
        except Exception:  # the engine failed mid-stream: the client hears it in-band, the log gets the details
            error_id = new_error_id()
            log.exception("a stream failed (%s)", error_id)
            yield _sse(server_error_body(error_id))
            yield _sse("[DONE]")  # the stream still ends as streams do (a client waits for it)
        finally:
            r.group.abort()  # a client that went away: its requests stop and their KV blocks are freed

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
