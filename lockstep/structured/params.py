"""What a request's output must look like: vLLM's ``StructuredOutputsParams``."""

import json
from dataclasses import dataclass
from functools import cached_property

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output to a JSON schema, a regular expression, one of a list of strings, a
    context-free grammar, or any JSON object; exactly one of them (vLLM's names and meanings).

    ``json``: a JSON schema, as a dict or its JSON text. ``regex``: the whole output matches it. ``choice``: the
    output is exactly one of these strings. ``grammar``: a Lark grammar (llguidance's dialect) or a GBNF one, as
    in llama.cpp. ``json_object=True``: any JSON object. ``disable_any_whitespace``: JSON without whitespace
    between tokens (by default any is allowed, as in vLLM); ``disable_additional_properties``: objects in the
    schema that do not say otherwise take no properties besides theirs; ``whitespace_pattern``: a regex for the
    whitespace JSON may use instead.

    The output is steered token by token: at each step the tokens that cannot continue a valid output get no
    chance. A request can still stop early (``max_tokens``, a stop string), with an incomplete output.
    """

    json: dict | str | bool | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, regex, choice, grammar and json_object=True, got "
                + (", ".join(given) if given else "none")
            )
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured outputs: json is not valid JSON text: {e}") from None
            except RecursionError:
                raise ValueError("structured outputs: json is not valid JSON text: nested too deeply") from None
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured outputs: json must be a JSON schema (an object), got {self.json!r:.200}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured outputs: regex must be a string, got {self.regex!r:.200}")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise ValueError(f"structured outputs: grammar must be a non-empty string, got {self.grammar!r:.200}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured outputs: choice must be a non-empty list of strings, got {self.choice!r}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured outputs: every choice must be a non-empty string, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured outputs: json_object must be a bool, got {self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured outputs: {name} must be a bool, got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError(
                f"structured outputs: whitespace_pattern must be a string, not {self.whitespace_pattern!r}"
            )

        if self.reasoning_end is not None and not (isinstance(self.reasoning_end, str) and self.reasoning_end):
            raise ValueError(
                f"structured outputs: reasoning_end must be a non-empty string, got {self.reasoning_end!r}"
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @cached_property
    def key(self) -> str:
        """A canonical text of the constraint: equal constraints have equal keys (the compiled-grammar cache's;
        ``reasoning_end`` is not part of it: where the grammar starts does not change the grammar). RecursionError
        for a schema nested too deeply (``limits.check`` refuses those first)."""
        spec = {
            "kind": self.kind,
            "value": getattr(self, self.kind),
            "disable_any_whitespace": self.disable_any_whitespace,
            "disable_additional_properties": self.disable_additional_properties,
            "whitespace_pattern": self.whitespace_pattern,
        }
        return json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @cached_property
    def size(self) -> int:
        """The constraint's size: its key's UTF-8 bytes (what ``limits.GrammarLimits.max_bytes`` bounds)."""
        return len(self.key.encode("utf-8", "surrogatepass"))
