"""A request body to a JSON object without stalling the event loop, and with a 400 for anything malformed.

Parsing runs in a worker thread, but C code holds the GIL: ``json.loads`` on 8 MB of ``[[1],[1],...`` holds it
for ~2 s, and pydantic's validation of the result for ~5 s more, during which the event loop cannot run. So a
body with few brackets and commas (whatever they mean: the C parser's cost is bounded by them) is parsed in C,
and any other by the pure-Python scanner, which yields the GIL every few milliseconds; and a body with more JSON
values than ``MAX_VALUES`` is refused before pydantic sees it. Too deep nesting, integers past Python's 4300
digits, invalid UTF-8 and lone surrogates (which no tokenizer and no UTF-8 reply can carry) are 400s.
"""

import json
import json.scanner

from lockstep.server.protocol import APIError

MAX_VALUES = 1 << 18  # a 256k-token prompt as ids; pydantic validates that many in ~100 ms
MAX_CONTAINERS = 1 << 14  # objects and arrays: messages, content parts, prompts as id lists
_C_BRACKETS, _C_COMMAS = 1 << 13, 1 << 17  # ~10 ms of the C parser at most
_TOO_MANY = f"the request body holds too many JSON values (at most {MAX_VALUES}, {MAX_CONTAINERS} objects and arrays)"


def decode_object(raw: bytes) -> dict:
    """``raw`` as a JSON object whose strings are all valid Unicode; APIError 400 otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    small = text.count("[") + text.count("{") <= _C_BRACKETS and text.count(",") <= _C_COMMAS
    try:
        data = json.loads(text) if small else _counting_decoder().decode(text)
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, or an integer of more than 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    values = containers = 0
    for field, value in data.items():
        _check_unicode(field, None)
        values, containers = _walk(field, value, values, containers)
    return data


def _counting_decoder() -> json.JSONDecoder:
    """The pure-Python decoder, refusing the body as soon as it has made ``MAX_VALUES`` values (before they cost
    seconds of parsing and an atomic garbage collection of millions of objects)."""
    decoder, made = json.JSONDecoder(), [0]

    def counted(parse):
        def parse_counted(*args):
            made[0] += 1
            if made[0] > MAX_VALUES:
                raise APIError(400, _TOO_MANY)
            return parse(*args)

        return parse_counted

    decoder.parse_object, decoder.parse_array = counted(decoder.parse_object), counted(decoder.parse_array)
    decoder.parse_string, decoder.parse_int = counted(decoder.parse_string), counted(decoder.parse_int)
    decoder.parse_float, decoder.parse_constant = counted(decoder.parse_float), counted(decoder.parse_constant)
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder


def _walk(field: str, value: object, values: int, containers: int) -> tuple[int, int]:
    """Count the JSON values under one top-level field on top of ``values`` and ``containers`` (refusing the
    body past the limits), and look for lone surrogates in its strings."""
    stack = [value]
    while stack:
        v = stack.pop()
        values += 1
        if isinstance(v, str):
            _check_unicode(v, field)
        elif isinstance(v, dict):
            containers += 1
            stack += v.keys()
            stack += v.values()
        elif isinstance(v, list):
            containers += 1
            stack += v
        if values + len(stack) > MAX_VALUES or containers > MAX_CONTAINERS:
            raise APIError(400, _TOO_MANY, param=field)
    return values, containers


def _check_unicode(s: str, field: str | None) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        where = f"the field {field}" if field is not None else "a field name"
        raise APIError(
            400, f"invalid Unicode in {where}: a lone surrogate at character {e.start}", param=field
        ) from None
