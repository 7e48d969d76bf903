"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field

from lockstep.structured.params import StructuredOutputsParams


def _is_int(value: object) -> bool:
    # bool is an int subclass; ``max_tokens=True`` is a bug, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Temperatures below this are greedy, as in vLLM (its _SAMPLING_EPS): dividing fp32 logits by 1e-40 overflows
# them to +-inf, and the argmax of the result is what such a temperature means anyway.
MIN_TEMPERATURE = 1e-5
# repetition_penalty divides (multiplies) logits by it: outside this range it is not a penalty but an overflow.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
SEED_RANGE = (-(2**63), 2**64)  # any 64-bit pattern, signed or not


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request with ``n > 1``: choice 0 keeps ``seed`` (so ``n=1`` and choice 0
    of ``n>1`` agree); choice i > 0 uses the first 63 bits of blake2b(f"{seed}:{i}"), which is how a client can
    reproduce any one choice alone with ``n=1``."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    ``temperature == 0`` is greedy (ties go to the lowest token id); a temperature below ``MIN_TEMPERATURE``
    (1e-5) is too, and is normalised to 0. With ``temperature > 0`` the noise is a pure function of ``(seed,
    position, token id)``, so a seeded request gives the same tokens in any batch. Seeds are 64-bit.

    ``n`` completions are generated per prompt (``LLM.generate``), choice ``i`` with seed ``choice_seed(seed,
    i)``. ``top_k`` of ``-1`` or ``0`` turns top-k off; ``0`` is normalised to ``-1``. ``min_p`` drops tokens
    whose probability (after temperature) is below ``min_p`` times the most likely one's. ``stop`` may be one
    string or a list and is normalised to a list. ``logprobs`` is the number of top logprobs to return per
    generated token (``0``: only the sampled token's own logprob; ``-1``: the whole vocabulary, as in vLLM, within
    the engine's ``max_logprobs``; ``None``: none); they are of the raw
    distribution, before any penalty, bias or temperature (vLLM's default).

    Penalties and biases change the logits before greedy or random choice, as in vLLM and the OpenAI API:
    ``logit_bias`` adds to the given token ids; ``repetition_penalty`` divides the positive logits (multiplies the
    negative ones) of every token already in the prompt or the output; ``frequency_penalty`` subtracts itself
    times the token's count in the output; ``presence_penalty`` subtracts itself once from every token in the
    output.

    vLLM's other controls, with its meanings: ``min_tokens`` keeps EOS and ``stop_token_ids`` from being chosen
    (their logits set to -inf) and stop strings from ending the text until that many tokens were generated (a
    stop string must end after the text of those tokens). ``prompt_logprobs`` is the number of top logprobs to
    return for each prompt token (``RequestOutput.prompt_logprobs``; ``0``: only the prompt token's own); they
    are the values a decode step would give for the same tokens, bit for bit, and such a request does not read
    the prefix cache (it computes every prompt position; only choice 0 of ``n`` computes them).
    ``skip_special_tokens`` leaves special tokens out of ``text``; when they are kept,
    ``spaces_between_special_tokens`` puts a space between each special token and the text beside it (vLLM does
    that only with slow tokenizers: for its text from a fast one, pass False). ``include_stop_str_in_output``
    keeps the stop string that ended the text. ``truncate_prompt_tokens=k`` keeps only the last ``k`` prompt
    tokens (``-1``: as many as leave room to generate, ``max_model_len - 1``).

    ``structured_outputs`` (a ``StructuredOutputsParams``) constrains the output to a JSON schema, a regex, a
    choice of strings or a grammar: tokens that cannot continue a valid output are set to -inf before the choice
    (like a ``logit_bias``: logprobs stay those of the raw distribution). The allowed tokens are a function of the
    request's own output, so the guarantee holds for constrained requests too.

    vLLM's token controls (``layers/token_bans.py``): ``allowed_token_ids`` sets every other token to -inf;
    ``bad_words`` bans a word's last token where its other tokens were just generated (each word in its plain and,
    where that is another token of the same length, its leading-space form). The engine tokenizes ``bad_words``
    into ``bad_words_token_ids`` (vLLM's internal list; left None, it is filled by ``LLMEngine.add_request``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    flat_logprobs: bool = False  # vLLM's container choice: logprobs stay lists of dicts, which read the same

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (-1 or 0 disables it), got {self.top_k!r}")
        if self.top_k == 0:
            self.top_k = -1
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64), got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")

        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = stop

        stop_token_ids = list(self.stop_token_ids or [])
        for t in stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = stop_token_ids

        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < -1):
            raise ValueError(f"logprobs must be None or an int >= 0 (-1: the whole vocabulary), got {self.logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        r, (low, high) = self.repetition_penalty, REPETITION_PENALTY_RANGE
        if not _is_real(r) or not low <= r <= high:
            raise ValueError(f"repetition_penalty must be in [{low}, {high}], got {r!r}")
        bias = dict(self.logit_bias or {})
        for t, b in bias.items():
            if not _is_int(t) or t < 0 or not _is_real(b) or not -100 <= b <= 100:
                raise ValueError(
                    f"logit_bias must map token ids >= 0 to numbers in [-100, 100], got {self.logit_bias!r}"
                )
        self.logit_bias = bias or None
        self._check_output_controls()

    def _check_output_controls(self) -> None:
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        k = self.prompt_logprobs
        if k is not None and (not _is_int(k) or k < -1):
            raise ValueError(f"prompt_logprobs must be None or an int >= 0 (-1: the whole vocabulary), got {k!r}")
        for name in (
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
            "flat_logprobs",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k >= 1 or k == -1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or an int >= 1, got {k!r}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be None or a StructuredOutputsParams, got {so!r:.200}")
        self._check_token_controls()

    def _check_token_controls(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in allowed):
                raise ValueError(f"allowed_token_ids must be None or a list of token ids >= 0, got {allowed!r:.200}")
            if not allowed:
                raise ValueError(f"allowed_token_ids is not None and empty ({allowed!r}): no token could be chosen")
            self.allowed_token_ids = list(allowed)
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
                raise ValueError(f"bad_words must be None or a list of strings, got {words!r:.200}")
            self.bad_words = list(words)
        ids = self.bad_words_token_ids
        if ids is not None:
            ok = isinstance(ids, (list, tuple)) and all(
                isinstance(w, (list, tuple)) and w and all(_is_int(t) and t >= 0 for t in w) for w in ids
            )
            if not ok:
                raise ValueError(f"bad_words_token_ids must be lists of token ids, got {ids!r:.200}")
            self.bad_words_token_ids = [list(w) for w in ids]

    def for_choice(self, index: int) -> "SamplingParams":
        """The parameters of choice ``index`` run as a request of its own (``n=1``, its own seed). Only choice 0
        computes prompt logprobs: every choice would give the same bits."""
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return dataclasses.replace(self, n=1, seed=choice_seed(self.seed, index), prompt_logprobs=prompt_logprobs)

    @property
    def penalized(self) -> bool:
        """True when the logits need the request's tokens (a repetition, frequency or presence penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def token_controlled(self) -> bool:
        """True when the row's logits get vLLM's ``allowed_token_ids`` or ``bad_words`` treatment."""
        return bool(self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        """True when the argmax is taken (``temperature == 0``); top_p, top_k, min_p and seed are then irrelevant
        (penalties and biases still apply)."""
        return self.temperature == 0


@dataclass
class BeamSearchParams:
    """vLLM's beam-search parameters (``LLM.beam_search``): keep the ``beam_width`` best sequences, each step
    extending every beam by its top ``2 * beam_width`` tokens, for at most ``max_tokens`` tokens. A beam's score is
    its summed logprob over its length (prompt included, a final EOS not) to the power ``length_penalty``.
    ``ignore_eos`` keeps EOS from ending a beam. The logprobs are the raw distribution's, so ``temperature`` can
    only be 0 here (in vLLM it changes only the one sampled token that joins the candidates)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.temperature != 0:
            raise ValueError(
                f"temperature must be 0 for beam search, got {self.temperature!r}: beams are scored by the raw "
                "logprobs, which no temperature changes"
            )
        if not _is_real(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
