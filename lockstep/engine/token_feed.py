"""Async scheduling's device-side input: a step's newest tokens taken from the previous step's samples.

When the engine schedules step N + 1 before reading step N's sampled tokens back, each sequence that sampled at
step N holds ``PENDING_TOKEN`` as its newest token, and step N + 1's input for that row must be the token step N
sampled. That token is already on the device (``PendingSample.tokens``): ``TokenFeed.plan`` finds the input rows
that take one, and ``FedRows.write`` copies the tokens into the step's input ids there, a gather on the device
ordered after step N's sampling, so the host never waits for it. The row gets the very token id a synchronous step
would have put there, so nothing downstream can tell the difference.
"""

from dataclasses import dataclass

import torch

from lockstep.engine.sequence import PENDING_TOKEN, Sequence


@dataclass
class FedRows:
    """Input rows ``dst`` of a step take ``tokens[src]``."""

    dst: list[int]
    src: list[int]
    tokens: torch.Tensor  # [samples] int64, the previous step's sampled ids, on the model's device

    def write(self, input_ids: torch.Tensor) -> None:
        """Write the fed tokens into ``input_ids: [num_tokens]`` int64 on the tokens' device."""
        index = torch.tensor([self.dst, self.src], dtype=torch.int64)
        if self.tokens.device.type == "cuda":
            index = index.pin_memory()
        index = index.to(self.tokens.device, non_blocking=True)
        input_ids[index[0]] = self.tokens[index[1]]


@dataclass
class TokenFeed:
    """The previous step's sampled ids on the device, and the sequences whose newest token is pending, each with
    its row among them (``Scheduler.advance``)."""

    tokens: torch.Tensor
    rows: dict[Sequence, int]

    def plan(self, seqs: list[Sequence], query_start_loc: list[int], input_ids: list[int]) -> FedRows | None:
        """The rows of a flattened step (``seqs`` in batch order, its ``query_start_loc`` and host ``input_ids``)
        that take a fed token. Raises RuntimeError if a pending token would reach the model unfed."""
        dst: list[int] = []
        src: list[int] = []
        for i, seq in enumerate(seqs):
            k = self.rows.get(seq)
            if k is None:
                continue
            # The pending token is the sequence's newest: the entry's last row, or the row before a verify
            # chunk's drafts (speculative decoding), which are token ids.
            row = query_start_loc[i + 1] - 1
            while row > query_start_loc[i] and input_ids[row] != PENDING_TOKEN:
                row -= 1
            if input_ids[row] != PENDING_TOKEN:
                raise RuntimeError(f"{seq.request_id!r}: the fed row {row} does not hold the pending token")
            dst.append(row)
            src.append(k)
        if input_ids.count(PENDING_TOKEN) != len(dst):
            raise RuntimeError("a step's input holds a pending token that no earlier step's sample feeds")
        return FedRows(dst, src, self.tokens) if dst else None
