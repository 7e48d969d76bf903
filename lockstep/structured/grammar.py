"""Grammars for structured outputs, on llguidance: compile a constraint once, follow each request through it.

``GrammarCompiler`` turns a ``StructuredOutputsParams`` into a checked llguidance matcher, kept in a cache keyed
by the constraint (a server compiles in its request threads, so the engine step only ever hits the cache), and
hands each request a ``GrammarState``: a copy of that matcher fed the request's own output tokens. The state is a
function of those tokens alone (``advance`` replays whatever it has not seen, from the start if the tokens went
back), so preemption, recompute and batching cannot change which tokens it allows. With ``reasoning_end`` the
state leaves the output free until that marker's tokens appear in it, then follows the tokens after them.

``token_masks`` turns the states of one step's constrained rows into a ``[rows, vocab]`` bool tensor of allowed
tokens: each row's bits are unpacked from its own bitmask (an elementwise shift and and), on the logits' device.

Why llguidance and not xgrammar: docs/design.md, "Structured outputs" (bench/grammar.py measures both).
"""

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from lockstep.structured.params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled constraints kept (least recently used dropped first)


class GrammarError(ValueError):
    """A constraint that cannot be compiled (a bad schema, regex or grammar), or an output it cannot follow."""


def _closed_objects(schema: object) -> object:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say otherwise."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) for one constraint; GrammarError for one it cannot express."""
    import llguidance

    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            if params.disable_additional_properties:
                schema = _closed_objects(schema)
            options: dict = {"whitespace_flexible": not params.disable_any_whitespace}
            if params.whitespace_pattern is not None:
                options["whitespace_pattern"] = params.whitespace_pattern
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            # Lark string literals take JSON's escapes.
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid {kind} for structured outputs: {e}") from None


class _TokenTable:
    """What llguidance's generic tokenizer interface reads, for tokenizers whose tokenizer.json it cannot (say,
    a decoder it does not know): each token's bytes, the special ones flagged."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        special = set(tokenizer.all_special_ids)
        self.tokens = []  # a special token's bytes are its name (llguidance marks it as special)
        for i in range(vocab_size):
            if i >= len(tokenizer):
                self.tokens.append(f"<unused_{i}>".encode())
            else:
                self.tokens.append(
                    (tokenizer.convert_ids_to_tokens(i) if i in special else tokenizer.decode([i])).encode()
                )
        self.special_token_ids = sorted(special | set(range(len(tokenizer), vocab_size)))
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer and vocabulary, caching each by ``params.key``.

    ``eos_token_ids`` are the tokens a finished output may end with. Thread-safe: the server compiles in its
    request threads while the engine thread starts requests from the cache. The tokenizer's llguidance view
    (0.4 s for a 49k vocabulary, 1.5 s for 152k) is built on the first constraint.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        if tokenizer is None:
            raise GrammarError("structured outputs need the model's tokenizer, and this model has none")
        if not eos_token_ids:
            raise GrammarError("structured outputs need an EOS token to end the output, and this model has none")
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._markers: dict[str, tuple[int, ...]] = {}

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._make_ll_tokenizer()
            return self._ll_tokenizer

    def _make_ll_tokenizer(self):
        import llguidance
        import llguidance.hf

        eos = list(self.eos_token_ids)
        n_vocab = max(self.vocab_size, len(self.hf_tokenizer))
        try:
            return llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=n_vocab, eos_token=eos)
        except ValueError:  # a tokenizer.json llguidance cannot read: hand it the tokens' bytes instead
            table = _TokenTable(self.hf_tokenizer, n_vocab, eos)
            return llguidance.LLTokenizer(llguidance.TokenizerWrapper(table), n_vocab=n_vocab, eos_token=eos)

    def compile(self, params: StructuredOutputsParams):
        """The checked llguidance matcher of ``params`` at its start (shared: copy it before use); GrammarError
        naming the problem for a constraint that does not compile."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        import llguidance

        text = grammar_text(params)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {params.kind} for structured outputs: {matcher.get_error()[:1000]}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def start(self, params: StructuredOutputsParams) -> "GrammarState":
        """A new request's state in the grammar of ``params`` (compiled, or taken from the cache)."""
        template = self.compile(params)
        with self._lock:
            matcher = template.deep_copy()
        after = self.marker(params.reasoning_end) if params.reasoning_end is not None else ()
        return GrammarState(matcher, self.ll_tokenizer.vocab_size, self.eos_token_ids, after)

    def marker(self, text: str) -> tuple[int, ...]:
        """The token ids ``text`` is written with (a special token such as Qwen3's ``</think>``: one id)."""
        with self._lock:
            if text not in self._markers:
                self._markers[text] = tuple(self.hf_tokenizer.encode(text, add_special_tokens=False))
            return self._markers[text]


class GrammarState:
    """One request's place in its grammar: an llguidance matcher fed the request's output tokens so far (with
    ``after``, a marker's token ids: only those after the marker's first occurrence; before it, all are allowed)."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: Sequence[int], after: Sequence[int] = ()) -> None:
        self._matcher = matcher
        self._start = matcher.deep_copy()  # to replay from, should the tokens ever go back
        self.num_words = bitmask_words(vocab_size)  # the grammar's vocabulary (at least the model's), in words
        self.eos_token_ids = tuple(eos_token_ids)
        self._consumed: list[int] = []  # the output tokens fed to the matcher
        self.after = tuple(after)
        self.free = bool(self.after)  # no marker seen yet: the output is unconstrained
        self._scanned = 0  # output tokens searched for the marker (where the next search may start a match)

    @property
    def num_tokens(self) -> int:
        return len(self._consumed)

    def _constrained_part(self, output_token_ids: list[int]) -> list[int] | None:
        """The output tokens the grammar follows: all of them, or those after the marker; None before it."""
        if not self.after:
            return output_token_ids
        m, first = len(self.after), self.after[0]
        start = min(self._scanned, max(len(output_token_ids) - m + 1, 0))
        try:
            while True:
                i = output_token_ids.index(first, start)
                if tuple(output_token_ids[i : i + m]) == self.after:
                    self._scanned = i  # a later call finds the same occurrence at once
                    return output_token_ids[i + m :]
                start = i + 1
        except ValueError:
            self._scanned = max(len(output_token_ids) - m + 1, 0)
            return None

    def advance(self, output_token_ids: list[int]) -> None:
        """Bring the state to ``output_token_ids``: consume the new ones, or replay from the start if the tokens
        are not an extension of those consumed; GrammarError if the grammar does not allow one."""
        part = self._constrained_part(output_token_ids)
        self.free = part is None
        if part is None:
            if self._consumed:  # the tokens went back to before the marker
                self._matcher, self._consumed = self._start.deep_copy(), []
            return
        output_token_ids = part
        n = len(self._consumed)
        if output_token_ids[:n] != self._consumed:
            self._matcher, self._consumed, n = self._start.deep_copy(), [], 0
        new = output_token_ids[n:]
        if not new:
            return
        if not self._matcher.consume_tokens(new):
            why = self._matcher.get_error().splitlines()[0]
            self._matcher, self._consumed = self._start.deep_copy(), []  # a later call starts afresh
            raise GrammarError(f"the structured output's grammar rejects the output: {why}")
        self._consumed.extend(new)

    @property
    def finished(self) -> bool:
        """True once the grammar allows nothing more but the end (EOS)."""
        return not self.free and self._matcher.is_stopped()

    def fill_bitmask(self, out: torch.Tensor, output_token_ids: list[int], allow_eos: bool = True) -> None:
        """The tokens allowed after ``output_token_ids`` as a bitmask into ``out: [ceil(n_vocab / 32)]`` int32 on
        the CPU (bit ``t % 32`` of word ``t // 32`` set: token ``t`` allowed); without ``allow_eos``, EOS is not."""
        self.advance(output_token_ids)
        if (
            out.dtype != torch.int32
            or out.device.type != "cpu"
            or not out.is_contiguous()
            or len(out) != self.num_words
        ):
            raise ValueError(f"the bitmask must be a contiguous int32 CPU tensor of {self.num_words} words")
        if self.free:
            out.fill_(-1)  # every bit: any token
        else:
            self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())
        if not allow_eos:
            for t in self.eos_token_ids:
                out[t // 32] &= ~(1 << (t % 32))


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``words: [rows, W]`` int32 bitmasks -> ``[rows, vocab_size]`` bool, True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words[:, :, None] >> shifts) & 1  # [rows, W, 32]: elementwise, exact
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def token_masks(
    states: list[tuple[GrammarState, list[int], bool]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """The allowed tokens of several rows, ``[rows, vocab_size]`` bool on ``device``: each from its own
    ``(state, output token ids, allow EOS)``. GrammarError from a state that rejects its own tokens."""
    width = max([bitmask_words(vocab_size)] + [state.num_words for state, _, _ in states])
    words = torch.zeros(len(states), width, dtype=torch.int32)
    for row, (state, output_ids, allow_eos) in enumerate(states):
        state.fill_bitmask(words[row, : state.num_words], output_ids, allow_eos)
    return unpack_bitmask(words.to(device), vocab_size)


__all__ = [
    "CACHE_SIZE",
    "GrammarCompiler",
    "GrammarError",
    "GrammarState",
    "bitmask_words",
    "grammar_text",
    "token_masks",
    "unpack_bitmask",
]
