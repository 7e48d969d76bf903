"""The batched top-p cut (ops/top_p.py, the sampler's on CUDA; its Triton scan runs here through the interpreter):
the kept set against an fp64 reference, the edge cases, and a row's cut independent of the other rows, with a
negative control showing the harness sees a cut that follows the batch."""

import pytest
import torch
from invariance import check_moved_row, check_prefixes, randn

from lockstep.ops.top_p import top_p_mask


def _reference_kept(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """fp64: the tokens whose preceding mass (in descending probability order) is below top_p, at least one."""
    probs = torch.softmax(x.double(), -1)
    order = probs.argsort(descending=True, stable=True)
    sorted_probs = probs[order]
    before = sorted_probs.cumsum(0) - sorted_probs
    kept = max(int((before < top_p).sum()), 1)
    return probs >= sorted_probs[kept - 1]


def _midway_top_p(x: torch.Tensor, head: int) -> float:
    """A top_p halfway between the masses of the first ``head`` and ``head + 1`` tokens: far from any boundary."""
    mass = torch.softmax(x.double(), -1).sort(descending=True).values.cumsum(0)
    return float((mass[head - 1] + mass[head]) / 2)


@pytest.mark.parametrize("vocab", [7, 1000, 2500])  # 2500: several scan blocks and a ragged tail
def test_kept_tokens_match_fp64(vocab):
    x = randn(5, vocab, seed=1, scale=3.0)
    heads = [1, 2, 5, min(40, vocab - 1), vocab // 2]
    top_ps = torch.tensor([_midway_top_p(x[i], h) for i, h in enumerate(heads)], dtype=torch.float32)
    out = top_p_mask(x, top_ps)
    for i, h in enumerate(heads):
        kept = out[i] > float("-inf")
        assert torch.equal(kept, _reference_kept(x[i], float(top_ps[i]))) and int(kept.sum()) == h + 1
        assert torch.equal(out[i][kept], x[i][kept])  # kept logits untouched


def test_edges():
    x = randn(4, 300, seed=2)
    x[3, :] = 0.0  # a flat row: every token ties at the cut
    out = top_p_mask(x, torch.tensor([1.0, 1e-9, 0.5, 0.5]))
    assert torch.equal(out[0], x[0])  # top_p 1: untouched
    assert int((out[1] > float("-inf")).sum()) == 1 and out[1].argmax() == x[1].argmax()  # at least one token
    assert torch.equal(out[3], x[3])  # ties at the cut are kept


def _op(x: torch.Tensor) -> torch.Tensor:
    return top_p_mask(x, torch.full((x.shape[0],), 0.7))


def test_rows_are_batch_invariant():
    x = randn(40, 1500, seed=3, scale=2.0)
    check_prefixes(_op, x, [1, 2, 3, 17, 40])
    check_moved_row(_op, x, [(2, 1), (9, 6), (17, 16)])


def test_negative_control_a_cut_that_follows_the_batch_is_caught():
    # The same harness on a cut whose mass is summed over a batch-sized reshaping of the row, as a scan whose
    # blocking followed the number of rows would: some row's kept set changes.
    def blocked_by_rows(x):
        probs = torch.softmax(x, -1)
        sorted_probs = probs.sort(dim=-1, descending=True).values
        width = 3 if x.shape[0] < 8 else 7
        v = x.shape[1] - x.shape[1] % width
        blocks = sorted_probs[:, :v].reshape(x.shape[0], -1, width).sum(-1)
        mass = blocks.cumsum(-1).repeat_interleave(width, -1)
        kept = torch.clamp((mass - sorted_probs[:, :v] < 0.7).sum(-1), min=1)
        cuts = sorted_probs.gather(1, (kept - 1)[:, None])
        return x.masked_fill(probs < cuts, float("-inf"))

    x = randn(40, 1500, seed=3, scale=2.0)
    with pytest.raises(AssertionError, match="rows differ"):
        check_prefixes(blocked_by_rows, x, [1, 2, 3, 17, 40])


def test_same_cut_as_the_one_row_path():
    # The CPU sampler's one-row top-p (torch's sort and cumsum) keeps the same tokens away from a boundary.
    from lockstep.layers.sampler import _top_p

    x = randn(6, 2000, seed=4, scale=2.5)
    top_ps = torch.tensor([_midway_top_p(x[i], h) for i, h in enumerate([1, 3, 10, 50, 300, 1000])])
    batched = top_p_mask(x, top_ps)
    for i in range(6):
        assert torch.equal(batched[i], _top_p(x[i].clone(), float(top_ps[i])))


def test_after_top_k_the_head_alone_gives_the_same_cut():
    # The sampler passes top-k's indices: sorting only their probabilities must give the full sort's cut, ties at
    # the k-th value included (row 4: 30 tokens share it).
    x = randn(5, 3000, seed=6, scale=2.0)
    x[4, :30] = x[4].max() + 1.0
    top = x.topk(20, dim=-1)
    x = x.masked_fill(x < top.values[:, -1:], float("-inf"))  # what top-k left
    for top_ps in (torch.tensor([0.3, 0.6, 0.9, 0.99, 1.0]), torch.tensor([0.1, 0.2, 0.5, 0.7, 0.95])):
        assert torch.equal(top_p_mask(x, top_ps, head=top.indices), top_p_mask(x, top_ps))
