"""The fused Gumbel-max (ops/gumbel.py, the sampler's choice on CUDA; here through the interpreter): the sampler's
torch arithmetic and a Python-float reference give the same tokens, the edge rows, and a row's token independent of
the other rows, with a negative control showing the harness sees a choice that follows the row's position."""

import math

import pytest
import torch
from invariance import MOVES, randn

from lockstep.layers import sampler
from lockstep.ops.gumbel import greedy_argmax, gumbel_argmax

INF = float("inf")


def _keys(rows: int, salt: int = 0) -> torch.Tensor:
    return sampler._row_keys([1000 + 7 * i + salt for i in range(rows)], [13 * i % 50 for i in range(rows)], "cpu")[
        :, 0
    ]


def _torch_path(x: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's unfused path: fp64 noise for every token, the add, the exact argmax."""
    return sampler._argmax_lowest(x.double() + sampler._gumbel(keys[:, None], x.shape[-1]))


def _edge_rows(vocab: int) -> torch.Tensor:
    x = randn(8, vocab, seed=vocab, scale=3.0)
    x[1, : vocab // 2] = -INF  # half masked
    x[2] = -INF  # nothing to pick: token 0, score -inf
    x[3, vocab // 3] = float("nan")  # NaN counts as -inf
    x[4, vocab - 1] = INF  # +inf wins
    x[5] = x[5].where(torch.arange(vocab) % 997 == 5, torch.tensor(-INF))  # a top-k-like sparse row
    x[6] = float("nan")
    x[7] = 0.0  # flat: the noise alone decides
    return x


@pytest.mark.parametrize("vocab", [1, 3, 17, 2047, 2048, 2049, 5000, 17000])  # blocks of 2048, chunks of 8192
def test_same_choice_and_score_as_the_torch_path(vocab):
    x = _edge_rows(vocab)
    keys = _keys(x.shape[0])
    tokens, best = gumbel_argmax(x, keys)
    want_tokens, want_best = _torch_path(x, keys)
    assert torch.equal(tokens, want_tokens)
    assert torch.allclose(best, want_best, rtol=1e-15, atol=0, equal_nan=True)  # same ops; libm may differ by an ulp
    assert tokens[2] == 0 and best[2] == -INF and tokens[6] == 0 and best[6] == -INF
    if vocab > 3:
        assert tokens[4] == vocab - 1 and best[4] == INF
        assert tokens[3] != vocab // 3


@pytest.mark.parametrize("vocab", [1, 3, 2047, 2049, 17000])
def test_greedy_is_the_torch_argmax(vocab):
    # Without the noise: the sampler's argmax_lowest, ties (a flat row, a repeated maximum) to the lowest id.
    x = _edge_rows(vocab)
    if vocab > 3:
        x[0, [5, vocab - 2]] = x[0].max() + 1.0  # a tie at the top, across blocks (and chunks) when large
    tokens, best = greedy_argmax(x)
    want_tokens, want_best = sampler._argmax_lowest(x)
    assert torch.equal(tokens, want_tokens) and torch.equal(best, want_best.double())
    if vocab > 3:
        assert tokens[0] == 5 and tokens[7] == 0  # the lowest of the tied ids; a flat row: id 0
    t, b = greedy_argmax(x[3:5])  # rows alone give the same
    assert torch.equal(t, tokens[3:5]) and torch.equal(b, best[3:5])


def test_python_float_reference():
    # splitmix64 on Python ints and math.log: the scores token by token.
    vocab, rows = 300, 4
    x = randn(rows, vocab, seed=5, scale=2.0)
    keys = _keys(rows, salt=3)
    tokens, best = gumbel_argmax(x, keys)
    for r in range(rows):
        key = int(keys[r]) & ((1 << 64) - 1)
        scores = []
        for t in range(vocab):
            h = sampler.mix64((t * sampler._GOLDEN) ^ key)
            u = ((h >> 11) + 0.5) * 2.0**-53
            scores.append(float(x[r, t]) - math.log(-math.log(u)))
        top = max(scores)
        assert int(tokens[r]) == scores.index(top)
        assert math.isclose(float(best[r]), top, rel_tol=1e-14)


def test_rows_are_batch_invariant():
    x = randn(40, 9000, seed=6, scale=2.0)  # two chunks
    x[5, 100:] = -INF
    keys = _keys(40)
    tokens, best = gumbel_argmax(x, keys)
    for m in (1, 2, 3, 17, 40):
        t, b = gumbel_argmax(x[:m], keys[:m])
        assert torch.equal(t, tokens[:m]) and torch.equal(b, best[:m]), m
    _check_moved(gumbel_argmax, x[0], keys[0])


def _check_moved(op, row: torch.Tensor, key: torch.Tensor) -> None:
    alone = op(row[None], key[None])
    for m, pos in MOVES:
        batch = randn(m, row.shape[0], seed=200 + m, scale=2.0)
        keys = _keys(m, salt=m)
        batch[pos], keys[pos] = row, key
        t, b = op(batch, keys)
        assert t[pos] == alone[0][0] and b[pos] == alone[1][0], f"row moved to {pos} of {m} differs"


def test_negative_control_a_choice_that_follows_the_position_is_caught():
    # The same harness on a kernel fed the row's position as its key (noise that follows the batch): caught.
    def by_position(x, keys):
        return gumbel_argmax(x, torch.arange(x.shape[0], dtype=torch.int64) * 7919)

    row = randn(1, 3000, seed=7)[0] * 0.01  # flat enough that the noise decides
    with pytest.raises(AssertionError, match="differs"):
        _check_moved(by_position, row, _keys(1)[0])


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="fp32"):
        gumbel_argmax(torch.zeros(2, 5, dtype=torch.float64), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        gumbel_argmax(torch.zeros(2, 5), torch.zeros(3, dtype=torch.int64))
