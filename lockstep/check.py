"""``check_batch_invariance``: does a function give a sample the same bits alone and inside any batch?"""

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class InvarianceReport:
    """What ``check_batch_invariance`` saw. ``print(report)`` gives a short summary."""

    trials: int
    batch_sizes: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    differing_batch_sizes: list[int] = field(default_factory=list)
    max_abs_diff: float = 0.0

    @property
    def mismatches(self) -> int:
        return len(self.differing_batch_sizes)

    @property
    def invariant(self) -> bool:
        return self.mismatches == 0

    def __str__(self) -> str:
        verdict = "batch-invariant" if self.invariant else "NOT batch-invariant"
        lines = [
            f"{verdict}: {self.mismatches}/{self.trials} batched runs differed bitwise from the run alone",
            f"  max |difference|: {self.max_abs_diff:.6g}",
            f"  batch sizes tried: {min(self.batch_sizes)}..{max(self.batch_sizes)}" if self.batch_sizes else "",
        ]
        if self.differing_batch_sizes:
            lines.append(f"  differed at batch sizes: {sorted(set(self.differing_batch_sizes))}")
        return "\n".join(line for line in lines if line)


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Compare bit patterns, so NaNs compare equal to themselves and -0.0 differs from 0.0.
    t = t.detach().contiguous()
    if t.is_floating_point():
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _random_like(sample: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if sample.is_floating_point():
        scale = sample.float().std().item() if sample.numel() > 1 else 1.0
        noise = torch.randn(sample.shape, generator=gen, dtype=torch.float32) * (scale or 1.0)
        return noise.to(sample.dtype).to(sample.device)
    low, high = int(sample.min()), int(sample.max()) + 1
    return torch.randint(low, max(high, low + 1), sample.shape, generator=gen).to(sample.dtype).to(sample.device)


def check_batch_invariance(
    fn: Callable[[torch.Tensor], torch.Tensor],
    sample: torch.Tensor,
    *,
    trials: int = 20,
    max_batch_size: int = 64,
    make_other: Callable[[torch.Generator], torch.Tensor] | None = None,
    seed: int = 0,
) -> InvarianceReport:
    """Run ``fn`` on ``sample`` alone, then inside batches of other samples, and compare the bits.

    ``fn`` maps a batch ``[B, *sample.shape]`` to outputs ``[B, ...]``. Each trial draws a batch size in
    ``2..max_batch_size`` and a position, fills the other rows with ``make_other(generator)`` (default: random
    data shaped like ``sample`` — normal with its spread, or integers in its range) and checks that
    ``fn(batch)[position]`` equals ``fn(sample[None])[0]`` bit for bit.
    """
    if trials < 1 or max_batch_size < 2:
        raise ValueError(f"need trials >= 1 and max_batch_size >= 2, got {trials} and {max_batch_size}")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    other = make_other or (lambda g: _random_like(sample, g))
    with torch.no_grad():
        alone = fn(sample[None])[0]
        report = InvarianceReport(trials=trials)
        for _ in range(trials):
            size = rng.randint(2, max_batch_size)
            position = rng.randrange(size)
            rows = [other(gen) for _ in range(size)]
            rows[position] = sample
            batched = fn(torch.stack(rows))[position]
            report.batch_sizes.append(size)
            report.positions.append(position)
            if not torch.equal(_bits(batched), _bits(alone)):
                report.differing_batch_sizes.append(size)
                diff = (batched.double() - alone.double()).abs().max().item()
                report.max_abs_diff = max(report.max_abs_diff, diff)
    return report
