"""The speculative-decoding configuration, parsed from vLLM's ``speculative_config`` dict.

vLLM's dict is the interface users already write (``LLM(model, speculative_config={...})``,
``--speculative-config JSON``); the keys lockstep does not implement are refused by name rather than ignored, so
a setting never silently does nothing.
"""

from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model", "eagle3")
# vLLM's defaults for n-gram lookup when neither bound is given (vllm/config/speculative.py).
DEFAULT_PROMPT_LOOKUP = 5


class NotImplementedMethod(ValueError, NotImplementedError):
    """A drafting method vLLM has and lockstep does not yet: a NotImplementedError that is also the ValueError the
    CLI and the server report in one line."""


@dataclass
class SpeculativeConfig:
    """What to draft with and how many tokens to draft per step.

    ``method`` "ngram" looks the tokens up in the sequence itself (``prompt_lookup_min`` to ``prompt_lookup_max``
    long suffix n-grams); "draft_model" runs ``model`` (a smaller checkpoint with the target's tokenizer);
    "eagle3" runs the EAGLE-3 head at ``model`` on the target's hidden states. Left out, ``method`` is read from
    ``model``'s ``config.json``, as vLLM does: "eagle3" for an EAGLE-3 head (``LlamaForCausalLMEagle3``, or vLLM's
    "speculators" format), else "draft_model" (and "ngram" when ``model`` is vLLM's "ngram"/"[ngram]" spelling).
    """

    num_speculative_tokens: int
    method: str | None = None
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an int >= 1, got {k!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config: model must be a path or model id string, got {self.model!r}")
        if self.method is None:
            if self.model in ("ngram", "[ngram]"):
                self.method, self.model = "ngram", None
            elif self.model is not None:
                self.method = "eagle3" if _is_eagle3_head(self.model) else "draft_model"
            else:
                raise ValueError('speculative_config needs "method" (ngram, draft_model, eagle3) or "model"')
        if self.method == "[ngram]":
            self.method = "ngram"
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {self.method!r}")
        if self.method in ("draft_model", "eagle3") and self.model is None:
            what = "the draft checkpoint" if self.method == "draft_model" else "the EAGLE-3 head's checkpoint"
            raise ValueError(f'speculative_config: method "{self.method}" needs "model", {what}')
        if self.method == "draft_model" and _is_eagle3_head(self.model):
            raise ValueError(
                f'speculative_config: {self.model} is an EAGLE-3 head, not a draft model: use method "eagle3" (or '
                f'leave "method" out)'
            )
        if self.method == "ngram":
            self._resolve_lookup()
        elif self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
            raise ValueError(f"speculative_config: prompt_lookup_min/max apply to method 'ngram', not {self.method!r}")

    def _resolve_lookup(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an int >= 1, got {value!r}")
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        self.prompt_lookup_min, self.prompt_lookup_max = low, high

    @classmethod
    def from_dict(cls, config: "dict | SpeculativeConfig") -> "SpeculativeConfig":
        """Parse vLLM's dict; a key this class does not take is a ValueError that names it."""
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unsupported key(s) {', '.join(map(repr, unknown))}; lockstep takes "
                f"{', '.join(sorted(known))}"
            )
        if "num_speculative_tokens" not in config:
            k = _speculators_tokens(config.get("model")) if config.get("method") in (None, "eagle3") else None
            if k is None:
                raise ValueError("speculative_config needs num_speculative_tokens")
            config = config | {"num_speculative_tokens": k}
        return cls(**config)


def _is_eagle3_head(model: str) -> bool:
    """Whether ``model``'s ``config.json`` (where there is one to read) is an EAGLE-3 head's."""
    if model in ("ngram", "[ngram]"):
        return False
    from lockstep.models.speculators import is_eagle3_head, read_checkpoint_config

    hf = read_checkpoint_config(model)
    return hf is not None and is_eagle3_head(hf)


def _speculators_tokens(model) -> int | None:
    """vLLM's default ``num_speculative_tokens`` for a head in the speculators format: its proposal method's
    ``speculative_tokens`` (None for any other checkpoint)."""
    if not isinstance(model, str):
        return None
    from lockstep.models.speculators import is_speculators, read_checkpoint_config, speculative_tokens

    hf = read_checkpoint_config(model)
    if hf is None or not is_speculators(hf):
        return None
    return speculative_tokens(hf, model)
