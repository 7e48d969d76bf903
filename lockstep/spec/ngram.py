"""Prompt-lookup drafting: propose the tokens that followed an earlier occurrence of the sequence's own suffix.

vLLM's n-gram proposer, to the token: the longest suffix n-gram with ``prompt_lookup_min <= n <=
prompt_lookup_max`` that also occurs earlier in the sequence (an occurrence may overlap the suffix but must end
before the last token), at its earliest such occurrence; the proposal is the up to ``num_tokens`` tokens that
follow it, and none past ``max_model_len``. Input-grounded tasks (repeat, extract, edit a given text) copy long
runs of the prompt, which this finds without a second model.
"""

import numpy as np

from lockstep.spec.config import SpeculativeConfig
from lockstep.spec.drafter import DraftRequest


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int, max_model_len: int | None = None) -> list[int]:
    """The proposal for ``tokens: [T]`` int64 (at most ``k`` tokens; empty when no n-gram matches)."""
    total = len(tokens)
    if max_model_len is not None:
        k = min(k, max_model_len - total)
    if total < min_n or k <= 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # Windows tokens[s : s + n] that end before the last token: s in [0, total - 1 - n].
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
        hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n  # the earliest occurrence (vLLM's choice among equally long ones)
            return tokens[start : start + k].tolist()
    return []


class NgramDrafter:
    """``Drafter`` by prompt lookup (``lookup``); keeps no state between steps."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int | None = None) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [
            lookup(np.asarray(r.token_ids, dtype=np.int64), self.min_n, self.max_n, r.num_tokens, self.max_model_len)
            for r in requests
        ]

    def release(self, seq_id: int) -> None:
        pass
