"""vLLM's logprob shapes from the sampler's: one ``{token_id: Logprob}`` dict per position."""

from lockstep.layers.sampler import TokenLogprobs
from lockstep.outputs import Logprob


class LogprobDicts:
    """Builds vLLM's dicts for one engine: ``decoded_token`` is ``tokenizer.decode([token_id])`` (vLLM's choice,
    special tokens included), computed once per token id; None without a tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._strings: dict[int, str] = {}

    def token_str(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        s = self._strings.get(token_id)
        if s is None:
            s = self._strings[token_id] = self.tokenizer.decode([token_id])
        return s

    def entry(self, token_id: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        """``token_id`` first (its rank may be past the top N), then the top N in order, as vLLM lists them."""
        d = {token_id: Logprob(lp.logprob, lp.rank, self.token_str(token_id))}
        for rank, (t, v) in enumerate(lp.top, 1):
            if t not in d:
                d[t] = Logprob(v, rank, self.token_str(t))
        return d

    def extend(self, dicts: list[dict[int, Logprob]], token_ids: list[int], raw: list[TokenLogprobs]) -> None:
        """Append the dicts of positions ``len(dicts)..len(raw) - 1`` (``raw[i]`` is ``token_ids[i]``'s): a
        request's dicts are built once each, as its tokens arrive."""
        for i in range(len(dicts), len(raw)):
            dicts.append(self.entry(token_ids[i], raw[i]))
