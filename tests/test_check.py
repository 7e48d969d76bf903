"""check_batch_invariance: it passes a row-wise function, catches one that reads its neighbours (the negative
control), and compares bits, not values: -0.0 is not 0.0, and NaN is itself."""

import pytest
import torch

from lockstep import check_batch_invariance


def test_a_row_wise_function_is_invariant():
    sample = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    report = check_batch_invariance(lambda b: b * 3.0 + 1.0, sample, trials=8, max_batch_size=9)
    assert report.invariant and report.mismatches == 0 and report.max_abs_diff == 0.0
    assert len(report.batch_sizes) == len(report.positions) == 8
    assert all(
        2 <= size <= 9 and 0 <= pos < size for size, pos in zip(report.batch_sizes, report.positions, strict=True)
    )
    assert str(report).startswith("batch-invariant: 0/8 batched runs differed")


def test_negative_control_a_function_of_the_batch_is_caught():
    sample = torch.randn(4, generator=torch.Generator().manual_seed(1))
    report = check_batch_invariance(lambda b: b - b.mean(0), sample, trials=6)
    assert not report.invariant and report.mismatches == 6 and report.max_abs_diff > 0.1
    assert sorted(report.differing_batch_sizes) == sorted(report.batch_sizes)
    assert str(report).startswith("NOT batch-invariant: 6/6") and "differed at batch sizes" in str(report)


def test_bits_not_values():
    sample = torch.ones(3)
    # The same value, another sign of zero inside a batch: caught, with a difference of 0.
    signed_zero = lambda b: b * 0.0 * (-1.0 if b.shape[0] > 1 else 1.0)
    report = check_batch_invariance(signed_zero, sample, trials=3)
    assert not report.invariant and report.max_abs_diff == 0.0
    # NaN in the same place alone and batched: the same bits.
    assert check_batch_invariance(lambda b: b * float("nan"), sample, trials=3).invariant


def test_integer_samples_get_integer_neighbours_in_their_range():
    sample = torch.tensor([3, 9, 5])
    seen = []

    def record(b: torch.Tensor) -> torch.Tensor:
        seen.append(b.clone())
        return b.float()

    assert check_batch_invariance(record, sample, trials=4).invariant
    batches = torch.cat(seen[1:])
    assert batches.dtype == torch.int64 and batches.min() >= 3 and batches.max() <= 9


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="trials"):
        check_batch_invariance(lambda t: t, torch.ones(3), trials=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        check_batch_invariance(lambda t: t, torch.ones(3), max_batch_size=1)
