"""Grammars for structured outputs, on llguidance: compile a constraint once, follow each request through it.

``GrammarCompiler`` turns a ``StructuredOutputsParams`` into a checked llguidance matcher, kept in a cache keyed
by the constraint (a server compiles in its request threads, so the engine step only ever hits the cache), and
hands each request a ``GrammarState``: a copy of that matcher fed the request's own output tokens. The state is a
function of those tokens alone (``advance`` replays whatever it has not seen, from the start if the tokens went
back), so preemption, recompute and batching cannot change which tokens it allows. With ``reasoning_end`` the
state leaves the output free until that marker's tokens appear in it, then follows the tokens after them.

``token_masks`` turns the states of one step's constrained rows into a ``[rows, vocab]`` bool tensor of allowed
tokens: each row's bits are unpacked from its own bitmask (an elementwise shift and and), on the logits' device.

A constraint is checked against ``GrammarLimits`` (its size, nesting and number of choices) before it is compiled,
and once compiled its first step is taken on a copy (the first mask, the tokens it forces, the mask after them),
so that one llguidance cannot follow from the start (a row of more alternatives than its parser takes, a lexer
past its budget, a rule without a base case) is a ``GrammarError`` there, in the request's thread, and not a failed
engine step. The cache keeps compiled constraints by the bytes they are charged (``limits.charge``), not by count.

Why llguidance and not xgrammar: docs/design.md, "Structured outputs" (bench/grammar.py measures both).
"""

import json
import threading
from collections.abc import Sequence

import torch

from lockstep.structured import limits as _limits
from lockstep.structured.cache import GrammarCache
from lockstep.structured.limits import GrammarLimits
from lockstep.structured.params import StructuredOutputsParams

MAX_FORCED_TOKENS = 4096  # the tokens a constraint forces at its start that the check feeds it, at most


class GrammarError(ValueError):
    """A constraint that cannot be compiled (a bad schema, regex or grammar), or an output it cannot follow."""


def _closed_objects(schema: object) -> object:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say otherwise (a copy;
    iterative, so any depth is safe)."""

    def copy(value: object) -> object:
        if isinstance(value, dict):
            out = {}
            todo.append((value, out))
            return out
        if isinstance(value, list):
            out = [None] * len(value)
            todo.append((value, out))
            return out
        return value

    todo: list[tuple[dict | list, dict | list]] = []
    root = copy(schema)
    while todo:
        src, dst = todo.pop()
        if isinstance(src, list):
            for i, v in enumerate(src):
                dst[i] = copy(v)
            continue
        for k, v in src.items():
            dst[k] = copy(v)
        if (src.get("type") == "object" or "properties" in src) and "additionalProperties" not in src:
            dst["additionalProperties"] = False
    return root


# The ASCII meaning of the Perl classes, as JSON Schema (ECMA-262), xgrammar and outlines (so vLLM) read them;
# llguidance's regexes (Rust's syntax) take them as Unicode classes, so "\d" let a model write "🯸" for a digit.
_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(regex: str) -> str:
    r"""``regex`` with ``\d``, ``\w`` (and ``\D``, ``\W``) spelled as their ASCII classes, in and out of brackets
    (a negated one inside brackets as a nested class, which Rust's syntax takes); everything else as written."""
    out, i, depth = [], 0, 0  # depth: how many "[" are open
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            e = regex[i + 1]
            chars = _ASCII_CLASSES.get(e.lower())
            if chars is None:
                out.append(regex[i : i + 2])
            elif e.islower():
                out.append(chars if depth else f"[{chars}]")
            else:
                out.append(f"[^{chars}]")
            i += 2
            continue
        if c == "[":
            if depth and regex.startswith("[:", i):  # [[:alpha:]]: a POSIX class, copied whole
                end = regex.find(":]", i + 2)
                if end != -1:
                    out.append(regex[i : end + 2])
                    i = end + 2
                    continue
            depth += 1
            out.append(c)
            i += 1
            # a "]" right after "[" or "[^" is a literal, not the end of the class
            for prefix in ("^]", "]", "^"):
                if regex.startswith(prefix, i):
                    out.append(prefix)
                    i += len(prefix)
                    break
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


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
            return llguidance.LLMatcher.grammar_from_regex(ascii_classes(params.regex))
        if kind == "choice":
            # One terminal of alternatives (Lark string literals take JSON's escapes): the lexer follows all of them
            # at once, where a rule of alternatives puts each in the parser's row, which takes at most 2000.
            alternatives = " | ".join(json.dumps(c) for c in params.choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {alternatives}")
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

    ``eos_token_ids`` are the tokens a finished output may end with; ``limits`` bound each constraint and the
    cache. Thread-safe: the server compiles in its request threads while the engine thread starts requests from
    the cache. The tokenizer's llguidance view (0.4 s for a 49k vocabulary, 1.5 s for 152k) is built on the first
    constraint.
    """

    def __init__(
        self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], limits: GrammarLimits | None = None
    ) -> None:
        if tokenizer is None:
            raise GrammarError("structured outputs need the model's tokenizer, and this model has none")
        if not eos_token_ids:
            raise GrammarError("structured outputs need an EOS token to end the output, and this model has none")
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self.limits = limits or GrammarLimits()
        self._cache = GrammarCache(self.limits.cache_bytes)
        self._markers: dict[str, tuple[int, ...]] = {}

    @property
    def cache_bytes(self) -> int:
        """The bytes the cached constraints are charged, in all (at most ``limits.cache_bytes``)."""
        return self._cache.bytes

    @property
    def cache_entries(self) -> int:
        return len(self._cache)

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
        naming the problem for a constraint past the limits, one that does not compile, or one whose first step
        fails."""
        try:
            size = _limits.check(params, self.limits)
        except ValueError as e:
            raise GrammarError(f"invalid {params.kind} for structured outputs: {e}") from None
        try:
            key = params.key
        except RecursionError:  # nesting the depth check does not see (a dict subclass, say)
            raise GrammarError(f"invalid {params.kind} for structured outputs: nested too deeply") from None
        with self._lock:
            matcher = self._cache.get(key)
        if matcher is not None:
            return matcher
        import llguidance

        text = grammar_text(params)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {params.kind} for structured outputs: {matcher.get_error()[:1000]}")
        self._check_start(matcher, params.kind)
        with self._lock:
            self._cache.put(key, matcher, _limits.charge(size))
        return matcher

    def _check_start(self, matcher, kind: str) -> None:
        """Take the constraint's first step on a copy of ``matcher``: the first mask, the tokens it forces (where
        llguidance's limits on a parser row or the lexer show first), the mask after them. GrammarError for one
        that fails, or that allows no token at all."""
        m = matcher.deep_copy()
        mask = m.compute_bitmask()
        if not m.is_error():
            if mask.count(0) == len(mask):
                raise GrammarError(f"invalid {kind} for structured outputs: it allows no output at all")
            forced = m.compute_ff_tokens()[:MAX_FORCED_TOKENS]
            if forced and m.consume_tokens(forced):
                m.compute_bitmask()
        if m.is_error():
            why = m.get_error().splitlines()[0][:1000]
            raise GrammarError(f"invalid {kind} for structured outputs: it fails at its first step: {why}")

    def start(self, params: StructuredOutputsParams) -> "GrammarState":
        """A new request's state in the grammar of ``params`` (compiled, or taken from the cache: then without
        the limits' walk over the schema, which the compile that cached it did, and which each of a call's ``n``
        states would repeat in the engine thread)."""
        try:
            key = params.key
        except RecursionError:
            key = None  # compile says why
        with self._lock:
            template = self._cache.get(key) if key is not None else None
        if template is None:
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

    def fill_bitmasks_ahead(
        self, out: torch.Tensor, output_token_ids: list[int], drafts: Sequence[int], allow_eos: bool = True
    ) -> None:
        """Speculative decoding: row ``j`` of ``out: [len(drafts) + 1, words]`` gets ``fill_bitmask``'s mask after
        ``output_token_ids + drafts[:j]``, the mask plain decoding would use at that position. Rows after a draft
        the grammar rejects allow every token: a token sampled there is never kept (the draft before it differs
        from every token the grammar allows, so from the one sampled). The state is left at ``output_token_ids``."""
        self.fill_bitmask(out[0], output_token_ids, allow_eos)
        if not drafts:
            return
        saved = (self._matcher.deep_copy(), list(self._consumed), self.free, self._scanned) if self.after else None
        before = len(self._consumed)
        ahead = list(output_token_ids)
        j = 0
        try:
            for j, token in enumerate(drafts, start=1):
                ahead.append(token)
                self.fill_bitmask(out[j], ahead, allow_eos)
        except GrammarError:
            out[j:].fill_(-1)
        finally:
            if saved is not None:  # a marker's search state moves with the tokens: put all of it back
                self._matcher, self._consumed, self.free, self._scanned = saved
            elif len(self._consumed) >= before:
                if len(self._consumed) > before:
                    self._matcher.rollback(len(self._consumed) - before)
                    del self._consumed[before:]
            else:  # a rejected draft sent the matcher back to the start
                self.advance(output_token_ids)


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


def token_masks_ahead(
    states: list[tuple[GrammarState, list[int], Sequence[int], bool]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """``token_masks`` for verify chunks: for each ``(state, output token ids, drafts, allow EOS)``, one row per
    position of the chunk (``GrammarState.fill_bitmasks_ahead``), all in order: ``[rows, vocab_size]`` bool."""
    width = max([bitmask_words(vocab_size)] + [state.num_words for state, _, _, _ in states])
    words = torch.zeros(sum(1 + len(d) for _, _, d, _ in states), width, dtype=torch.int32)
    row = 0
    for state, output_ids, drafts, allow_eos in states:
        state.fill_bitmasks_ahead(words[row : row + 1 + len(drafts), : state.num_words], output_ids, drafts, allow_eos)
        row += 1 + len(drafts)
    return unpack_bitmask(words.to(device), vocab_size)


__all__ = [
    "GrammarCompiler",
    "GrammarError",
    "GrammarState",
    "bitmask_words",
    "grammar_text",
    "token_masks",
    "unpack_bitmask",
]
