"""vLLM's ``use_beam_search: true`` on /v1/completions and /v1/chat/completions: ``n`` is the beam width, each
prompt's ``n`` best beams are its choices (generated text only, best first), with vLLM's ``length_penalty``.

The search is ``lockstep.beam_search.BeamSearch`` driven from the event loop: each step submits every live beam of
the call as a one-token request (one ``RequestGroup``) and feeds the candidates back, so the beams are the same
bits whatever else the server runs (the module docstring of ``lockstep.beam_search``). The whole reply comes at
the end; what beam search cannot combine with (streaming, logprobs, stop conditions, penalties and sampling
filters, constraints and tools, a temperature) is refused with a 400 naming it (``check_beam_search``).
"""

import json
import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from lockstep.beam_search import BeamSearch
from lockstep.sampling_params import BeamSearchParams
from lockstep.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from lockstep.server.requests import ChoiceSpec
from lockstep.server.state import ServerState

# Fields beam search does not honour, with the values that change nothing (a field left out has its default).
_NOT_WITH_BEAMS = {
    "stream": (False,),
    "prompt_logprobs": (None,),
    "stop": (None, []),
    "stop_token_ids": (None, []),
    "min_tokens": (0,),
    "logit_bias": (None, {}),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "top_p": (1.0,),
    "top_k": (-1, 0),
    "min_p": (0.0,),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "echo": (False,),
}


def check_beam_search(req: CompletionRequest | ChatCompletionRequest, max_logprobs: int) -> None:
    """400 naming the first field set that beam search cannot honour, or a beam width whose ``2 n`` candidates a
    step are more logprobs than ``max_logprobs`` allows (vLLM's limit too)."""
    if 2 * req.n > max_logprobs:
        raise APIError(
            400,
            f"use_beam_search with n={req.n} needs the top {2 * req.n} logprobs a step, more than the server's "
            f"--max-logprobs ({max_logprobs})",
            param="n",
        )
    given = req.model_fields_set
    bad = [
        name for name, neutral in _NOT_WITH_BEAMS.items() if name in given and getattr(req, name, None) not in neutral
    ]
    if isinstance(req, CompletionRequest) and req.logprobs is not None or getattr(req, "logprobs", None) is True:
        bad.append("logprobs")
    if req.response_format is not None and req.response_format.type != "text":
        bad.append("response_format")
    if "temperature" in given and req.temperature != 0:
        bad.append("temperature")  # beams are scored by the raw logprobs, which no temperature changes
    if bad:
        raise APIError(400, f"use_beam_search does not combine with: {', '.join(bad)}", param=bad[0])


async def beam_reply(
    state: ServerState,
    request: Request,
    req: CompletionRequest | ChatCompletionRequest,
    specs: list[ChoiceSpec],
    chat: bool,
) -> Response:
    """Run the call's beam search and answer with one JSON body (499 if the client leaves first); 400 first for what
    it cannot honour (``check_beam_search``)."""
    check_beam_search(req, state.engine.engine.max_logprobs)
    n = req.n
    engine = state.engine.engine
    searches = [
        BeamSearch(
            [specs[j].prompt_ids],
            BeamSearchParams(
                beam_width=n,
                max_tokens=specs[j].params.max_tokens,
                ignore_eos=req.ignore_eos,
                length_penalty=req.length_penalty,
            ),
            engine.eos_token_ids,
            engine.max_model_len,
        )
        for j in range(0, len(specs), n)
    ]
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    step = 0
    while not all(s.done for s in searches):
        if await request.is_disconnected():
            return Response(status_code=499)
        live = [s for s in searches if not s.done]
        requests = [(s, ids) for s in live for ids in s.pending()]
        ids = [f"{response_id}-beam{step}-{k}" for k in range(len(requests))]
        try:
            group = await state.engine.submit(
                [(rid, tokens, s.step_params, None) for rid, (s, tokens) in zip(ids, requests, strict=True)]
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None
        finals = {out.request_id: out async for out in group if out.finished}
        steps = [(owner, finals[rid].outputs[0].logprobs[0]) for rid, (owner, _) in zip(ids, requests, strict=True)]
        for s in live:
            s.advance([lps for owner, lps in steps if owner is s])
        step += 1
    return Response(json.dumps(_body(state, req, specs, searches, response_id, chat)), media_type="application/json")


def _body(state: ServerState, req, specs: list[ChoiceSpec], searches: list[BeamSearch], rid: str, chat: bool) -> dict:
    tok = state.tokenizer
    choices, completion = [], 0
    for j, search in enumerate(searches):
        prompt = specs[j * req.n].prompt_ids
        [out] = search.outputs(None)
        for b, beam in enumerate(out.sequences):
            generated = beam.tokens[len(prompt) :]
            completion += len(generated)
            text = tok.decode(generated, skip_special_tokens=req.skip_special_tokens) if tok is not None else ""
            index = j * req.n + b
            choice = {"index": index, "logprobs": None, "finish_reason": beam.finish_reason, "stop_reason": None}
            token_ids = generated if req.return_token_ids else None
            if chat:
                choice |= {"message": {"role": "assistant", "content": text}, "token_ids": token_ids}
            else:
                choice |= {"text": text, "prompt_logprobs": None, "token_ids": token_ids}
                choice["prompt_token_ids"] = list(prompt) if req.return_token_ids else None
            choices.append(choice)
    prompt_tokens = sum(len(s.prompt_ids) for s in specs)
    body = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "system_fingerprint": state.fingerprint,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": None,
        },
    }
    if chat:
        body["prompt_logprobs"] = None
        body["prompt_token_ids"] = list(specs[0].prompt_ids) if req.return_token_ids else None
    return body
