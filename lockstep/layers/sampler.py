"""Turn one step's logits into tokens and logprobs, one row at a time.

Every row's result is a function of that row's logits and its request's (params, seed, position) alone:

- greedy (``temperature == 0``): the largest logit, ties to the lowest token id (an exact integer reduction);
- ``temperature > 0``: divide by the temperature, drop tokens outside top-k and top-p, then Gumbel-max: add noise
  ``-log(-log(u))`` and take the largest score. ``u`` is a counter-based hash of ``(seed, position, token id)``,
  so the noise is a pure function, never a generator shared by the batch;
- logprobs: ``lockstep.ops.log_softmax`` of the raw logits (vLLM's default "raw" logprobs), and the top ``N``
  when asked, ties to the lower id.

The temperature path works on one ``[vocab]`` row at a time, so each call it makes sees the same shape whatever
the batch: the row's bits cannot depend on its neighbours, even through a CPU kernel's vector-width tail.
"""

import torch

from lockstep import ops
from lockstep.engine.sequence import TokenLogprobs
from lockstep.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _as_signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int (the scalar reference for ``_mix64``)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    # Logical right shift of int64 bit patterns (torch's >> is arithmetic).
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    # x: int64 bit patterns; multiplication wraps modulo 2**64, so the low 64 bits match mix64.
    x = (x ^ _shr(x, 30)) * _as_signed(_M1)
    x = (x ^ _shr(x, 27)) * _as_signed(_M2)
    return x ^ _shr(x, 31)


def row_key(seed: int, position: int) -> int:
    """The 64-bit key of one sampling event: a hash of the request's seed and the sampled token's position."""
    return mix64(mix64(seed + _GOLDEN) ^ ((position + 1) * _GOLDEN))


def uniform_noise(seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``u[t]`` in (0, 1), fp64, for every token id ``t``: a pure function of ``(seed, position, t)``."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    h = _mix64((ids * _as_signed(_GOLDEN)) ^ _as_signed(row_key(seed, position)))
    # The top 53 bits, centred in their interval: never exactly 0 or 1.
    return (_shr(h, 11).double() + 0.5) * 2.0**-53


def gumbel_noise(seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Gumbel(0, 1) noise ``-log(-log(u))``, fp64 ``[vocab_size]``."""
    return -torch.log(-torch.log(uniform_noise(seed, position, vocab_size, device)))


def argmax_lowest(x: torch.Tensor) -> torch.Tensor:
    """Index of the largest value along the last dim, ties (and only ties) to the lowest index."""
    # x: [..., V] -> [...] int64. Comparisons and an integer min: exact in any order.
    ids = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    best = x.max(dim=-1, keepdim=True).values
    return torch.where(x == best, ids, x.shape[-1]).min(dim=-1).values


def _filter_top_k_top_p(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``x: [V]`` scaled logits -> the same with tokens outside top-k / top-p set to -inf (ties at the cut kept)."""
    if 0 < top_k < x.shape[0]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        probs = ops.softmax(x[None])[0]
        sorted_probs = probs.sort(descending=True, stable=True).values
        # Keep the smallest head of the sorted distribution whose mass reaches top_p (at least one token):
        # a token is kept when the mass strictly before it is below top_p.
        before = torch.cumsum(sorted_probs, 0) - sorted_probs
        num_kept = int((before < top_p).sum().clamp(min=1))
        x = x.masked_fill(probs < sorted_probs[num_kept - 1], float("-inf"))
    return x


def sample_row(logits: torch.Tensor, params: SamplingParams, seed: int | None, position: int) -> int:
    """The token for one row of fp32 logits ``[V]``. ``seed`` is required when ``params.temperature > 0``."""
    if params.greedy:
        return int(argmax_lowest(logits))
    if seed is None:
        raise ValueError("sampling with temperature > 0 needs a seed (the engine draws one per request)")
    x = _filter_top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
    scores = x.double() + gumbel_noise(seed, position, x.shape[0], x.device)
    return int(argmax_lowest(scores))


class Sampler:
    """Samples one token per logits row and reports its logprobs.

    ``__call__(logits, params, seeds, positions)`` with ``logits: [num_rows, vocab]`` fp32 and one entry per row
    in the lists; ``positions[i]`` is the index, in its sequence, of the token row ``i`` samples. Returns the
    token ids and a ``TokenLogprobs`` per row.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int | None],
        positions: list[int],
    ) -> tuple[list[int], list[TokenLogprobs]]:
        num_rows = logits.shape[0]
        if logits.dim() != 2 or not len(params) == len(seeds) == len(positions) == num_rows:
            raise ValueError(
                f"logits {tuple(logits.shape)} for {len(params)} params, {len(seeds)} seeds, {len(positions)} positions"
            )
        if num_rows == 0:
            return [], []
        logits = logits.float()
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        token_ids = [0] * num_rows
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=logits.device)
            for i, t in zip(greedy_rows, argmax_lowest(logits[rows]).tolist(), strict=True):
                token_ids[i] = t
        for i, p in enumerate(params):
            if not p.greedy:
                token_ids[i] = sample_row(logits[i], p, seeds[i], positions[i])

        logprobs = ops.log_softmax(logits)  # [num_rows, vocab] fp32
        chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device)[:, None])[:, 0].tolist()
        max_top = max((p.logprobs or 0) for p in params)
        top_ids = top_vals = None
        if max_top > 0:
            # A stable descending sort puts equal logprobs in id order: ties go to the lower id.
            top_vals, top_ids = logprobs.sort(dim=-1, descending=True, stable=True)
            top_vals, top_ids = top_vals[:, :max_top].tolist(), top_ids[:, :max_top].tolist()
        out: list[TokenLogprobs] = []
        for i, p in enumerate(params):
            n = p.logprobs or 0
            top = tuple(zip(top_ids[i][:n], top_vals[i][:n], strict=True)) if n else ()
            out.append(TokenLogprobs(chosen[i], top))
        return token_ids, out
