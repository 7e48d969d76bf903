"""The server's streamed text: deltas held back at partial characters and possible stop-string starts still add
up to the final text. (The routes themselves are driven over HTTP in test_openai_api.py.)"""

import random
from pathlib import Path

from transformers import AutoTokenizer

from lockstep.engine.detokenizer import IncrementalDetokenizer
from lockstep.outputs import CompletionOutput, RequestOutput
from lockstep.server.responses import _TextStream


def id_lists(tok) -> list[list[int]]:
    """Real texts (multi-byte characters, code, odd spacing) and random id lists, which split characters across
    tokens and hit special tokens."""
    texts = ["Grüße aus Köln — 東京 🙂🙂 ok.", "def f(x):\n    return x  # ok\n\n", " . , ' s n't  double  spaces "]
    rng = random.Random(1)
    randoms = [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))] for _ in range(100)]
    return [tok.encode(t) for t in texts] + randoms


def stream(tok, ids: list[int], stops: list[str], held_back: list[str]) -> tuple[list[str], str]:
    """The server's streamed pieces of one choice whose outputs grow a token at a time, as the engine makes them:
    with stop strings, each unfinished output carries the engine's incremental text and the request finishes at
    the first hit; the finished output carries the whole decode, cut at the earliest stop. The stream is told
    ``held_back`` as its stop strings. Returns (pieces, final text)."""
    text_stream, engine = _TextStream(tok, held_back), IncrementalDetokenizer(tok)
    pieces = []
    for n in range(1, len(ids) + 1):
        engine.update(ids[:n])
        if n == len(ids) or any(s in engine.text for s in stops):
            final = tok.decode(ids[:n], skip_special_tokens=True)
            final = final[: min([final.find(s) for s in stops if s in final], default=len(final))]
            done = CompletionOutput(0, final, ids[:n], finish_reason="stop")
            pieces.append(text_stream.delta(RequestOutput("r", None, [], [done])))
            return pieces, final
        step = CompletionOutput(0, engine.text if stops else "", ids[:n])
        pieces.append(text_stream.delta(RequestOutput("r", None, [], [step])))
    raise AssertionError("unreachable: the last token finishes the request")


def stops_for(tok, ids: list[int], i: int) -> list[str]:
    """Every other list gets a two-character stop string from the middle of its text."""
    whole = tok.decode(ids, skip_special_tokens=True)
    return [whole[len(whole) // 2 : len(whole) // 2 + 2]] if i % 2 and len(whole) > 4 else []


def test_stream_deltas_add_up_to_the_final_text(embedded_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(embedded_model_dir)
    early = 0
    for i, ids in enumerate(id_lists(tok)):
        stops = stops_for(tok, ids, i)
        pieces, final = stream(tok, ids, stops, stops)
        assert "".join(pieces) == final, ids
        early += sum(map(bool, pieces[:-1]))
    assert early > 500, "the text came in one piece at the end: nothing was streamed"


def test_negative_control_a_stream_that_does_not_hold_back_stop_starts(embedded_model_dir: Path) -> None:
    # Told no stop strings, the stream sends text the stop cut later removes: its pieces no longer add up.
    tok = AutoTokenizer.from_pretrained(embedded_model_dir)
    broken = 0
    for i, ids in enumerate(id_lists(tok)):
        stops = stops_for(tok, ids, i)
        pieces, final = stream(tok, ids, stops, [])
        broken += "".join(pieces) != final
    assert broken > 0
