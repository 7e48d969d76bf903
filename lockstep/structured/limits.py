"""How large a constraint may be, and what a compiled one is charged in the cache.

A client's constraint costs memory and compile time in proportion to its text: llguidance's compiled grammar
(the matcher the cache keeps) holds 20 to 150 bytes for each byte of the constraint's canonical JSON text, plus
30 to 170 KiB whatever its size, measured as the live heap bytes (glibc ``mallinfo2``) each ``LLMatcher`` adds,
over enums, objects of many properties, nested objects, choices, alternations, repetitions, ``$ref`` cycles and
Lark grammars; the tokenizer's vocabulary size does not enter (the same on a 100-token and a 49k-token
vocabulary). So a constraint is refused past ``max_bytes`` of that text, and each cached one is charged
``charge(size)``: an upper bound of all those measurements (it overstates an enum's memory about sevenfold, an
object's of many properties little). docs/reliability.md has the table.

Nesting is bounded before anything walks the schema recursively: llguidance refuses a schema nested past 124
objects and arrays, and Python's own ``json.dumps`` (the cache key) would raise RecursionError soon after.
"""

from dataclasses import dataclass

from lockstep.structured.params import StructuredOutputsParams

CHARGE_BASE = 128 << 10  # bytes charged for any compiled constraint
CHARGE_PER_BYTE = 160  # and for each byte of its text
MAX_SCHEMA_DEPTH = 100  # objects and arrays nested in a JSON schema


@dataclass(frozen=True)
class GrammarLimits:
    """``max_bytes``: a constraint's text (its canonical JSON: a schema, a regex, a grammar, the choices) at most
    this long, in UTF-8 bytes. ``max_choices``: a ``choice`` of at most this many strings. ``cache_bytes``: the
    compiled constraints kept, charged ``charge`` each, at most this much in all (least recently used dropped
    first); it must hold at least one constraint of ``max_bytes``."""

    max_bytes: int = 256 << 10
    max_choices: int = 4096
    cache_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_choices", "cache_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if charge(self.max_bytes) > self.cache_bytes:
            raise ValueError(
                f"the grammar cache ({self.cache_bytes} bytes) must hold one constraint of max_bytes "
                f"({self.max_bytes}), which is charged {charge(self.max_bytes)} bytes"
            )


def charge(size: int) -> int:
    """The bytes a compiled constraint of ``size`` bytes of text is counted as in the cache."""
    return CHARGE_BASE + CHARGE_PER_BYTE * size


def depth(value: object, limit: int | None = None) -> int:
    """How many objects and arrays ``value`` nests, at its deepest; with ``limit``, at most ``limit + 1`` (the walk
    stops there). Level by level, iterative: any depth is safe to measure, in about 10 ms for 256 KiB of schema."""
    level, d = [value], 0
    while limit is None or d <= limit:
        below, found = [], False
        for v in level:
            kind = type(v)
            if kind is dict:
                below += v.values()
                found = True
            elif kind is list or kind is tuple:
                below += v
                found = True
        if not found:
            return d
        level, d = below, d + 1
    return d


def check(params: StructuredOutputsParams, limits: GrammarLimits) -> int:
    """The size of ``params`` (the bytes its cache key has); ValueError naming the limit it passes, if any."""
    if params.kind == "json" and depth(params.json, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} objects and arrays")
    if params.choice is not None and len(params.choice) > limits.max_choices:
        raise ValueError(
            f"choice has {len(params.choice)} strings; the server takes at most {limits.max_choices} "
            "(--max-structured-output-choices)"
        )
    size = params.size
    if size > limits.max_bytes:
        raise ValueError(
            f"the {params.kind} constraint is {size} bytes; the server takes at most {limits.max_bytes} "
            "(--max-structured-output-bytes)"
        )
    return size


def check_text(schema: object, limits: GrammarLimits) -> None:
    """ValueError for a JSON schema given as JSON text longer than ``max_bytes``: refused before ``json.loads``
    holds the GIL for it (some 2 s for 8 MB of nested arrays)."""
    if isinstance(schema, str) and len(schema) > limits.max_bytes:  # characters: at most as many as bytes
        raise ValueError(
            f"structured outputs: the JSON schema's text is {len(schema)} characters; the server takes at most "
            f"{limits.max_bytes} bytes (--max-structured-output-bytes)"
        )


__all__ = ["GrammarLimits", "MAX_SCHEMA_DEPTH", "charge", "check", "check_text", "depth"]
