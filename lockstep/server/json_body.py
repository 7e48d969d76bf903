"""A request body to a JSON object without stalling the event loop, and with a 400 for anything malformed.

Parsing runs in a worker thread, but C code holds the GIL: ``json.loads`` on 8 MB of ``[[1],[1],...`` holds it
for ~2 s, and pydantic's validation of the result for ~5 s more, during which the event loop cannot run. So the
body's structure is counted first, string by string (``json``'s C string scanner, linear, between Python steps
that let other threads run): a body with more than ``MAX_VALUES`` commas, ``MAX_CONTAINERS`` objects and arrays
or ``MAX_STRINGS`` strings is refused before it is parsed, and any other parses in C in a few tens of ms. The
same pass refuses lone surrogates (``"\\ud800"``), which no tokenizer and no UTF-8 reply can carry. Too deep
nesting, integers past Python's 4300 digits and invalid UTF-8 are 400s too.
"""

import json
import json.decoder

from lockstep.server.protocol import APIError

MAX_VALUES = 1 << 18  # commas outside strings: a 256k-token prompt as ids (pydantic validates it in ~10 ms)
MAX_CONTAINERS = 1 << 14  # objects and arrays: messages, content parts, prompts as id lists
MAX_STRINGS = 1 << 15  # keys included: prompts, messages' roles and contents, stop strings, logit_bias keys
_TOO_MANY = (
    f"the request body holds too many JSON values (at most {MAX_VALUES} commas, {MAX_CONTAINERS} objects and "
    f"arrays, {MAX_STRINGS} strings)"
)


def decode_object(raw: bytes) -> dict:
    """``raw`` as a JSON object whose strings are all valid Unicode; APIError 400 otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        _check_structure(text)
        data = json.loads(text)
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, or an integer of more than 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return data


def _check_structure(text: str) -> None:
    """Refuse ``text`` past the limits on commas, brackets and strings, or with a lone surrogate in a string.
    Linear in ``text``, whatever it holds: every step is a C scan from where the last one stopped."""
    strings = commas = containers = pos = 0
    while True:
        quote = text.find('"', pos)
        end = len(text) if quote < 0 else quote
        commas += text.count(",", pos, end)
        containers += text.count("[", pos, end) + text.count("{", pos, end)
        strings += quote >= 0
        if commas > MAX_VALUES or containers > MAX_CONTAINERS or strings > MAX_STRINGS:
            raise APIError(400, _TOO_MANY)
        if quote < 0:
            return
        s, pos = json.decoder.scanstring(text, quote + 1)  # ValueError for an unterminated or invalid string
        if not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(
                    400, f"invalid Unicode: a lone surrogate in the string at character {quote} of the body"
                ) from None
