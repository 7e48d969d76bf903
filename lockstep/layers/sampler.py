"""Turn one step's logits into tokens and logprobs.

Every row's result is a function of that row's logits and its request's (params, seed, position, tokens) alone:

- ``logit_bias`` and the repetition, frequency and presence penalties first change the row's logits, from its
  own prompt and output tokens (vLLM's ``allowed_token_ids``, ``bad_words`` and ``min_tokens`` set the tokens
  they rule out to -inf first, ``layers/token_bans.py``); a structured output's mask then sets the tokens its
  grammar does not allow to -inf (an elementwise select of the row: the mask comes from the request's own output,
  ``lockstep.structured``);
- greedy (``temperature == 0``): the largest logit, ties to the lowest token id (an exact integer reduction);
- ``temperature > 0``: divide by the temperature, drop tokens outside top-k, min-p and top-p, then Gumbel-max:
  add noise ``-log(-log(u))`` and take the largest score. ``u`` is a counter-based hash of ``(seed, position,
  token id)``, so the noise is a pure function, never a generator shared by the batch;
- logprobs: ``lockstep.ops.log_softmax`` of the raw logits (vLLM's default "raw" logprobs), and the top ``N``
  when asked, ties to the lower id.

How rows are grouped: penalties and biases go one row per call. For the temperature path on CUDA, the rows go
through together: each op is elementwise (the division, min-p's threshold: one device function per element
wherever the element sits), an exact selection (top-k's k-th value, the row max), top-p's cut, computed per row
by ``ops.top_p`` (a row-invariant softmax, an exact sort, one scan program per row), or the noise and the
argmax in ``ops.gumbel`` (the torch path's arithmetic, fused; each program reads one row), so a row's bits
cannot depend on its neighbours. Every temperature row on the CPU goes one ``[1, vocab]`` row per call (its
top-p by ``_top_p``: torch's sort and cumsum over the one row): a CPU elementwise kernel computes its
vector-width tail with scalar code, and which elements fall in the tail moves with the batch.

Faults stay in their row: NaN scores count as -inf, so a token id is always in ``[0, vocab)``; a row with no
score above -inf, or whose own adjustment or sampling raises, is reported in ``Sampled.errors`` (a group of rows
that raises is retried one row at a time, which gives the same bits, see above) and the other rows are sampled
as if it were not there.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lockstep import ops
from lockstep.layers.token_bans import bad_word_bans
from lockstep.ops.gumbel import _GOLDEN, _M1, _M2, greedy_argmax, gumbel_argmax  # _GOLDEN...: splitmix64's
from lockstep.ops.top_p import top_p_mask
from lockstep.sampling_params import SamplingParams

# Devices whose temperature rows share calls (the module docstring says why not the CPU), at most
# ROWS_PER_CALL rows a call: top-k, min-p and top-p take a few [rows, vocab] fp32 temporaries (156 MB each at
# 256 x 151936).
BATCHED_DEVICES = ("cuda",)
ROWS_PER_CALL = 256
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs for one token: its own, then the top-``n`` alternatives.

    ``top`` holds ``(token_id, logprob)`` pairs, highest logprob first, ties broken by the lower token id.
    ``rank`` is the token's place, from 1, in that order over the whole vocabulary (None when not asked for).
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass
class Sampled:
    """One step's samples: ``token_ids[i]`` and ``logprobs[i]`` for row ``i``, except for the rows in ``errors``
    (row -> why it has no token), whose entries are placeholders (-1 and a NaN logprob)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    errors: dict[int, str] = field(default_factory=dict)


class SamplingError(ValueError):
    """Raised by ``Sampler.__call__`` when some rows have no token; ``errors`` maps those rows to the reason."""

    def __init__(self, errors: dict[int, str]) -> None:
        super().__init__("; ".join(f"row {i}: {why}" for i, why in sorted(errors.items())))
        self.errors = errors


def device_tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` that does not wait for the device: on CUDA a copy from
    pageable memory waits for all the work queued before it, which would hold the host back while the step ahead
    of async scheduling runs; from pinned memory it is queued like a kernel. The same values either way."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


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


def _uniform(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``u[r, t]`` in (0, 1), fp64 ``[rows, vocab_size]``, from the signed 64-bit row keys ``keys: [rows, 1]``."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    h = _mix64((ids * _as_signed(_GOLDEN)) ^ keys)
    # The top 53 bits, centred in their interval: never exactly 0 or 1.
    return (_shr(h, 11).double() + 0.5) * 2.0**-53


def _row_keys(seeds: list[int], positions: list[int], device: torch.device | str) -> torch.Tensor:
    keys = [_as_signed(row_key(s, p)) for s, p in zip(seeds, positions, strict=True)]
    return device_tensor(keys, torch.int64, device)[:, None]


def uniform_noise(seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``u[t]`` in (0, 1), fp64, for every token id ``t``: a pure function of ``(seed, position, t)``."""
    return _uniform(_row_keys([seed], [position], device), vocab_size)[0]


def _gumbel(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``-log(-log(u))``, fp64 ``[rows, vocab_size]``, from the row keys ``[rows, 1]``."""
    return -torch.log(-torch.log(_uniform(keys, vocab_size)))


def gumbel_noise(seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Gumbel(0, 1) noise ``-log(-log(u))``, fp64 ``[vocab_size]``."""
    return _gumbel(_row_keys([seed], [position], device), vocab_size)[0]


def argmax_lowest(x: torch.Tensor) -> torch.Tensor:
    """Index of the largest value along the last dim, ties (and only ties) to the lowest index. NaN counts as
    -inf, so the index is always one of x's (0 for a row with nothing above -inf)."""
    return _argmax_lowest(x)[0]


def _argmax_lowest(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``argmax_lowest`` and the value it picked (-inf: the row had nothing to pick)."""
    # x: [..., V] -> [...] int64. A select, comparisons and an integer min: exact in any order.
    x = x.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    ids = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    best = x.max(dim=-1, keepdim=True).values
    return torch.where(x == best, ids, x.shape[-1]).min(dim=-1).values, best[..., 0]


def _greedy(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_argmax_lowest`` of ``[rows, V]`` scores: on a device whose rows share calls, one Triton pass
    (``ops.gumbel.greedy_argmax``, the same exact maximum and lowest id), else torch's four."""
    if scores.device.type in BATCHED_DEVICES:
        return greedy_argmax(scores.float())
    return _argmax_lowest(scores)


def _top_k(x: torch.Tensor, top_ks: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x: [rows, V]`` -> the same with each row's tokens below its k-th largest value set to -inf (ties at the
    cut kept); rows with ``k <= 0`` or ``k >= V`` untouched. The k-th value is a selection: exact. Also the
    indices of each row's largest ``max(k)`` tokens in descending order, when every row had a k (else None)."""
    vocab = x.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in top_ks]
    if not any(ks):
        return x, None
    top = torch.topk(x, max(ks), dim=-1)  # [rows, max k], descending
    kth = top.values.gather(1, device_tensor([max(k, 1) - 1 for k in ks], torch.int64, x.device)[:, None])
    active = device_tensor(ks, torch.int64, x.device)[:, None] > 0
    return x.masked_fill(active & (x < kth), float("-inf")), top.indices if all(ks) else None


def _min_p(x: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """``x: [rows, V]`` scaled logits -> the same with tokens less likely than ``min_p`` times the row's most
    likely one set to -inf: ``p_t < min_p * p_max`` is ``x_t < x_max + log(min_p)``, no softmax needed."""
    if not any(min_ps):
        return x
    floor = [math.log(m) if m > 0 else float("-inf") for m in min_ps]
    cut = x.max(dim=-1, keepdim=True).values + device_tensor(floor, x.dtype, x.device)[:, None]
    return x.masked_fill(x < cut, float("-inf"))


def _top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """``x: [V]`` scaled logits -> the same with tokens outside the top-p head set to -inf (ties at the cut kept)."""
    probs = ops.softmax(x[None])[0]
    sorted_probs = probs.sort(descending=True, stable=True).values
    # Keep the smallest head of the sorted distribution whose mass reaches top_p (at least one token):
    # a token is kept when the mass strictly before it is below top_p.
    before = torch.cumsum(sorted_probs, 0) - sorted_probs
    num_kept = int((before < top_p).sum().clamp(min=1))
    return x.masked_fill(probs < sorted_probs[num_kept - 1], float("-inf"))


def _gumbel_max(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens for ``logits: [rows, V]`` fp32 at temperature > 0, each row's noise from its ``params.seed``, and
    the fp64 scores that won (-inf: nothing to pick); the module docstring says which rows may share a call."""
    seeds = [p.seed for p in params]
    if any(s is None for s in seeds):
        raise ValueError("sampling with temperature > 0 needs a seed (the engine draws one per request)")
    temps = device_tensor([p.temperature for p in params], logits.dtype, logits.device)
    x, head = _top_k(logits / temps[:, None], [p.top_k for p in params])
    x = _min_p(x, [p.min_p for p in params])  # only lowers tokens at the head's end to -inf
    # Rows that share calls (the module docstring) go through Triton kernels whose rows are independent programs:
    # top-p with no host sync (ops/top_p.py), the noise and the argmax in one pass (ops/gumbel.py, the same
    # arithmetic as below). A one-row CPU call stays on torch.
    batched = x.device.type in BATCHED_DEVICES
    if any(p.top_p < 1.0 for p in params):
        if batched:
            x = top_p_mask(x, device_tensor([p.top_p for p in params], torch.float32, x.device), head)
        else:
            for i, p in enumerate(params):
                if p.top_p < 1.0:
                    x[i] = _top_p(x[i], p.top_p)
    keys = _row_keys(seeds, positions, logits.device)
    if batched:
        return gumbel_argmax(x.float(), keys[:, 0])
    return _argmax_lowest(x.double() + _gumbel(keys, logits.shape[-1]))  # [rows] int64 and [rows] fp64


@functools.lru_cache(maxsize=64)
def _allowed_mask(ids: tuple[int, ...], vocab: int, device: torch.device) -> torch.Tensor:
    """``[vocab]`` bool on ``device``, True at ``ids``: a request's ``allowed_token_ids``, made once (64 kept)."""
    if any(not 0 <= t < vocab for t in ids):
        raise ValueError(f"allowed_token_ids must be token ids in [0, {vocab})")
    keep = torch.zeros(vocab, dtype=torch.bool, device=device)
    keep[device_tensor(list(ids), torch.int64, device)] = True
    return keep


def adjust_row(logits: torch.Tensor, params: SamplingParams, token_ids: list[int], num_prompt: int) -> torch.Tensor:
    """One row's logits ``[V]`` after ``logit_bias`` and the penalties (vLLM's order and formulas), from the request's
    tokens: ``token_ids[:num_prompt]`` its prompt, the rest its output so far. ``allowed_token_ids`` and the banned
    ids (``min_tokens``, ``bad_words``) come after, for all rows at once (``Sampler._token_controls``)."""
    x = logits
    if params.logit_bias:
        ids = device_tensor(list(params.logit_bias), torch.int64, x.device)
        x = x.index_put((ids,), device_tensor(list(params.logit_bias.values()), x.dtype, x.device), True)
    if not params.penalized:
        return x
    # Integer counts, exact; neither a copy from pageable memory nor bincount (which reads its input's max back)
    # makes the host wait for the device.
    output = device_tensor(token_ids[num_prompt:], torch.int64, x.device)
    counts = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    counts = counts.scatter_add_(0, output, torch.ones_like(output)).to(x.dtype)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[device_tensor(token_ids[:num_prompt], torch.int64, x.device)] = True
        r = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if params.frequency_penalty:
        x = x - params.frequency_penalty * counts
    if params.presence_penalty:
        x = x - params.presence_penalty * (counts > 0).to(x.dtype)
    return x


def sample_row(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token for one row of fp32 logits ``[V]`` (already adjusted: penalties and bias are ``Sampler``'s work).
    ``params.seed`` is required when ``params.temperature > 0``."""
    if params.greedy:
        return int(argmax_lowest(logits))
    return int(_gumbel_max(logits[None], [params], [position])[0][0])


class Sampler:
    """Samples one token per logits row and reports its logprobs.

    ``sample(logits, params, positions, histories)`` with ``logits: [num_rows, vocab]`` fp32 and one entry per
    row in the lists; a sampled row's noise comes from ``params[i].seed``; ``positions[i]`` is the index, in its
    sequence, of the token row ``i`` samples; ``histories[i]`` is ``(token_ids, num_prompt_tokens)`` of row
    ``i``'s sequence (needed only when a row has penalties); ``allowed`` is ``(rows, mask)`` with ``mask: [len(rows),
    vocab]`` bool on the logits' device, the tokens each of those rows may choose (structured outputs; the other
    rows choose from all). Returns a ``Sampled``: the token ids and a
    ``TokenLogprobs`` per row, and the rows that could not be sampled. Calling the sampler is ``sample`` that
    raises ``SamplingError`` for such rows. Logprobs come from ``log_softmax`` (the kernel set's; default
    ``ops.log_softmax``); a step whose rows want no ranks or top tokens takes ``log_softmax_at`` instead when given
    (``ops.log_softmax_at``: the same bits for the sampled tokens, without the ``[rows, vocab]`` result).
    """

    def __init__(
        self,
        log_softmax: Callable[[torch.Tensor], torch.Tensor] = ops.log_softmax,
        log_softmax_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.log_softmax = log_softmax
        if log_softmax_at is None and log_softmax is ops.log_softmax:
            log_softmax_at = ops.log_softmax_at
        self.log_softmax_at = log_softmax_at
        self.eos_token_ids: tuple[int, ...] = ()  # held back with stop_token_ids until min_tokens (set by the engine)

    def min_tokens_banned(self, params: SamplingParams, history: tuple[list[int], int], vocab: int) -> list[int]:
        """The ids a row may not choose yet: until ``min_tokens`` outputs exist, EOS (unless ``ignore_eos``) and
        ``stop_token_ids``, as vLLM's min-tokens logits processor."""
        token_ids, num_prompt = history
        if len(token_ids) - num_prompt >= params.min_tokens:
            return []
        ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
        return sorted({t for t in ids if t < vocab})

    def banned(self, params: SamplingParams, history: tuple[list[int], int], vocab: int) -> list[int]:
        """Every id the row may not choose at this step: ``min_tokens_banned`` and the last tokens of the bad words
        whose other tokens were just generated (``token_bans.bad_word_bans``)."""
        banned = self.min_tokens_banned(params, history, vocab)
        if params.bad_words_token_ids:
            banned += bad_word_bans(params.bad_words_token_ids, *history)
        return sorted({t for t in banned if t < vocab})

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        histories: list[tuple[list[int], int]] | None = None,
        allowed: tuple[list[int], torch.Tensor] | None = None,
    ) -> tuple[list[int], list[TokenLogprobs]]:
        sampled = self.sample(logits, params, positions, histories, allowed)
        if sampled.errors:
            raise SamplingError(sampled.errors)
        return sampled.token_ids, sampled.logprobs

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        histories: list[tuple[list[int], int]] | None = None,
        allowed: tuple[list[int], torch.Tensor] | None = None,
    ) -> Sampled:
        return self.launch(logits, params, positions, histories, allowed).result()

    def launch(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        histories: list[tuple[list[int], int]] | None = None,
        allowed: tuple[list[int], torch.Tensor] | None = None,
    ) -> "PendingSample":
        """``sample``'s device work, enqueued; the host reads the results back in ``PendingSample.result``. The
        sampled ids are on the device at once (``PendingSample.tokens``), for a following step's input. On the CPU,
        rows with top-p wait for the device on the way (their cut-off is a count taken back to the host)."""
        num_rows = logits.shape[0]
        if logits.dim() != 2 or not len(params) == len(positions) == num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} for {len(params)} params, {len(positions)} positions")
        if num_rows == 0:
            return PendingSample(torch.zeros(0, dtype=torch.int64, device=logits.device), None, {})
        logits = logits.float()
        errors: dict[int, str] = {}
        scores = logits  # what the choice is made from; logprobs stay raw
        adjusted = [i for i, p in enumerate(params) if p.logit_bias or p.penalized]
        banning = [i for i, p in enumerate(params) if p.min_tokens or p.bad_words_token_ids]
        limited = [i for i, p in enumerate(params) if p.allowed_token_ids]
        if adjusted or banning or limited:
            if histories is None and (adjusted or banning):
                raise ValueError("penalties need each row's (token ids, number of prompt tokens)")
            scores = logits.clone()
            for i in adjusted:
                try:
                    scores[i] = adjust_row(logits[i], params[i], *histories[i])
                except Exception as e:  # this row's fault: reported with it
                    errors[i] = _describe(e)
            self._token_controls(scores, params, histories, limited, banning, errors)
        if allowed is not None and allowed[0]:
            masked_rows, mask = allowed
            if mask.shape != (len(masked_rows), logits.shape[-1]):
                raise ValueError(f"a mask {tuple(mask.shape)} for {len(masked_rows)} rows of {logits.shape[-1]} tokens")
            if scores is logits:
                scores = logits.clone()
            index = device_tensor(masked_rows, torch.int64, logits.device)
            scores[index] = scores[index].masked_fill(~mask, float("-inf"))
            # Rows whose grammar allows no token at all, told apart from other dead ends (same copy to the host).
            empty_mask = torch.zeros(num_rows, dtype=torch.bool, device=logits.device)
            empty_mask[index] = ~mask.any(dim=-1)
        # Tokens stay on the device until one copy brings them back with their logprobs: one sync a step.
        # best: the winning score, per row (-inf: nothing could be sampled).
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy_rows) == num_rows:  # the usual greedy step: one call, nothing to scatter
            tokens, best = _greedy(scores)
        else:
            tokens = torch.zeros(num_rows, dtype=torch.int64, device=logits.device)
            best = torch.zeros(num_rows, dtype=torch.float64, device=logits.device)
            if greedy_rows:
                rows = device_tensor(greedy_rows, torch.int64, logits.device)
                greedy_tokens, greedy_best = _greedy(scores[rows])
                tokens[rows], best[rows] = greedy_tokens, greedy_best.double()
        batched = logits.device.type in BATCHED_DEVICES
        together: list[int] = []
        alone: list[list[int]] = []
        for i, p in enumerate(params):
            if p.greedy or i in errors:
                continue
            if batched:
                together.append(i)
            else:
                alone.append([i])
        chunks = [together[j : j + ROWS_PER_CALL] for j in range(0, len(together), ROWS_PER_CALL)]
        for rows in chunks + alone:
            try:
                self._gumbel_rows(scores, params, positions, rows, tokens, best)
            except Exception as e:  # whose? Alone, each row answers for itself
                if len(rows) == 1:
                    errors[rows[0]] = _describe(e)
                    continue
                for i in rows:
                    try:
                        self._gumbel_rows(scores, params, positions, [i], tokens, best)
                    except Exception as e_i:
                        errors[i] = _describe(e_i)

        extra = [best] if allowed is None or not allowed[0] else [best, empty_mask]
        num_top = [p.logprobs for p in params]
        if self.log_softmax_at is not None and all(n is None for n in num_top):
            chosen = self.log_softmax_at(logits, tokens)  # [num_rows] fp32, the sampled tokens' only
            pending = launch_gather_logprobs(None, tokens, num_top, extra=extra, chosen=chosen)
        else:
            logprobs = self.log_softmax(logits)  # [num_rows, vocab] fp32
            pending = launch_gather_logprobs(logprobs, tokens, num_top, extra=extra)
        return PendingSample(tokens, pending, errors)

    def _token_controls(
        self,
        scores: torch.Tensor,
        params: list[SamplingParams],
        histories: list[tuple[list[int], int]] | None,
        limited: list[int],
        banning: list[int],
        errors: dict[int, str],
    ) -> None:
        """``allowed_token_ids`` (rows ``limited``) and the banned ids of ``min_tokens`` and ``bad_words`` (rows
        ``banning``) as -inf in ``scores``, in place: one masked fill and one indexed write for all the rows, after
        the bias and the penalties. The same bits as applying them first, row by row, as ``adjust_row`` does: a -inf
        stays -inf through a bias and every penalty, and no other entry is touched. (Per row, each took a pinned
        host copy and a fill over the vocabulary: 91 ms at 256 rows on the H200, against 6 ms unconstrained.)"""
        vocab, device = scores.shape[-1], scores.device
        rows, masks = [], []
        for i in limited:
            try:
                masks.append(_allowed_mask(tuple(params[i].allowed_token_ids), vocab, device))
                rows.append(i)
            except Exception as e:  # this row's fault: reported with it
                errors[i] = _describe(e)
        if rows:
            index = device_tensor(rows, torch.int64, device)
            scores[index] = scores[index].masked_fill(~torch.stack(masks), float("-inf"))
        pairs: list[list[int]] = [[], []]  # (row, token) of every ban
        for i in banning:
            if i in errors:
                continue
            try:
                banned = self.banned(params[i], histories[i], vocab)
            except Exception as e:
                errors[i] = _describe(e)
                continue
            pairs[0] += [i] * len(banned)
            pairs[1] += banned
        if pairs[1]:
            at = device_tensor(pairs, torch.int64, device)
            scores.index_put_((at[0], at[1]), torch.tensor(float("-inf"), device=device))

    @staticmethod
    def _gumbel_rows(
        scores: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        rows: list[int],
        tokens: torch.Tensor,
        best: torch.Tensor,
    ) -> None:
        row_params, row_positions = [params[i] for i in rows], [positions[i] for i in rows]
        if len(rows) == scores.shape[0]:  # every row, in order (rows are sorted): no gather and scatter
            tokens[:], best[:] = _gumbel_max(scores, row_params, row_positions)
            return
        index = device_tensor(rows, torch.int64, scores.device)
        tokens[index], best[index] = _gumbel_max(scores[index], row_params, row_positions)


def _describe(e: Exception) -> str:
    return f"sampling failed: {type(e).__name__}: {e}"


@dataclass
class PendingSample:
    """A launched ``Sampler.launch``: ``tokens: [rows]`` int64 on the logits' device (valid ids, also in rows
    that turn out to have none: those show in ``result``), and the copy to the host still under way."""

    tokens: torch.Tensor
    logprobs: "PendingLogprobs | None"
    errors: dict[int, str]

    def result(self) -> Sampled:
        """Wait for the copy (a step's one sync) and return what ``Sampler.sample`` returns."""
        if self.logprobs is None:
            return Sampled([], [])
        errors = self.errors
        token_ids, out, back = self.logprobs.result()
        for i, score in enumerate(back[0]):
            if score == -math.inf and i not in errors:
                if len(back) > 1 and back[1][i]:
                    errors[i] = "no token can be sampled: the structured output's grammar allows none here"
                else:
                    errors[i] = "no token can be sampled: every score is NaN or -inf"
        for i in errors:
            token_ids[i] = -1
            out[i] = TokenLogprobs(math.nan)
        return Sampled(token_ids, out, errors)


class _HostCopy:
    """Device tensors on their way to the host. On CUDA each is copied without blocking into pinned memory and an
    event marks the end; ``lists`` waits for that event alone (not for work enqueued after it, such as the next
    step's forward). Elsewhere the tensors are already where the host can read them."""

    def __init__(self, tensors: list[torch.Tensor | None]) -> None:
        self.event = None
        if any(t is not None and t.device.type == "cuda" for t in tensors):
            host: list[torch.Tensor | None] = []
            for t in tensors:
                if t is None:
                    host.append(None)
                    continue
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t.contiguous(), non_blocking=True)
                host.append(h)
            self.event = torch.cuda.Event()
            self.event.record()
            tensors = host
        self.tensors = tensors

    def lists(self) -> list[list | None]:
        if self.event is not None:
            self.event.synchronize()
        return [t.tolist() if t is not None else None for t in self.tensors]


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int | None], extra: list[torch.Tensor] = ()
) -> tuple[list[int], list[TokenLogprobs], list[list[float]]]:
    """Row ``i``'s logprob of token ``token_ids[i]`` (``logprobs: [rows, vocab]``, ``token_ids: [rows]`` int64 on
    the same device) and, where ``num_top[i]`` is not None, the token's rank and the ``num_top[i]`` highest
    ``(token id, logprob)`` pairs. Every value is a gather, a comparison count or a stable sort of the row alone,
    so it is exact whatever the other rows. Returns the token ids as ints, one ``TokenLogprobs`` per row, and the
    ``extra`` per-row tensors as lists (they ride along in the same single copy to the host)."""
    return launch_gather_logprobs(logprobs, token_ids, num_top, extra).result()


@dataclass
class PendingLogprobs:
    """``gather_logprobs`` launched: its device work enqueued, its copy to the host under way."""

    copy: _HostCopy
    num_top: list[int | None]
    num_extra: int

    def result(self) -> tuple[list[int], list[TokenLogprobs], list[list[float]]]:
        back, top_vals, top_ids = self.copy.lists()
        out: list[TokenLogprobs] = []
        for i, n in enumerate(self.num_top):
            top = tuple(zip(top_ids[i][:n], top_vals[i][:n], strict=True)) if n else ()
            out.append(TokenLogprobs(back[1][i], top, int(back[-1][i]) if n is not None else None))
        return [int(t) for t in back[0]], out, back[2 : 2 + self.num_extra]


def launch_gather_logprobs(
    logprobs: torch.Tensor | None,
    token_ids: torch.Tensor,
    num_top: list[int | None],
    extra: list[torch.Tensor] = (),
    chosen: torch.Tensor | None = None,
) -> PendingLogprobs:
    """``gather_logprobs`` without waiting for the device: ``result()`` on the answer waits and returns it.
    ``chosen: [rows]``, the tokens' logprobs already picked out, stands in for ``logprobs`` when no row wants
    ranks or top tokens."""
    ranked = any(n is not None for n in num_top)
    if chosen is None:
        chosen = logprobs.gather(1, token_ids[:, None])[:, 0]
    elif ranked:
        raise ValueError("ranks and top logprobs need the whole logprobs")
    columns = [token_ids.double(), chosen.double(), *(x.double() for x in extra)]  # fp64 holds them exactly
    if ranked:
        # The place in a stable descending sort: the tokens above it, and the lower ids level with it.
        ids = torch.arange(logprobs.shape[-1], device=logprobs.device)
        ahead = (logprobs > chosen[:, None]) | ((logprobs == chosen[:, None]) & (ids < token_ids[:, None]))
        columns.append(ahead.sum(dim=-1).double() + 1)  # an integer count, exact in fp64
    back = torch.stack(columns)
    max_top = max((n or 0) for n in num_top) if num_top else 0
    top_ids = top_vals = None
    if max_top > 0:
        # A stable descending sort puts equal logprobs in id order: ties go to the lower id.
        top_vals, top_ids = logprobs.sort(dim=-1, descending=True, stable=True)
        top_vals, top_ids = top_vals[:, :max_top], top_ids[:, :max_top]
    return PendingLogprobs(_HostCopy([back, top_vals, top_ids]), list(num_top), len(extra))
