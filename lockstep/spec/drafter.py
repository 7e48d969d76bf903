"""The drafter interface: what the engine asks a drafter and what it may answer.

A drafter sees each speculating sequence's tokens so far and proposes up to ``num_tokens`` more. Its proposals are
checked token by token against what plain decoding samples, so a drafter may be wrong, slow or even random: it
changes only how many tokens a step adds. ``release`` is called when a sequence finishes, is aborted or is
preempted, so a drafter that keeps per-sequence state (a draft model's KV cache) can free it; after a preemption
the sequence may come back under the same ``seq_id`` with the same tokens.

A drafter may also define ``observe(batch, aux)``, which the engine then calls after every target forward with the
step's ``ScheduledBatch`` and the target runner's ``aux_hidden`` (the EAGLE-3 drafter reads the target's hidden
states that way, ``spec/eagle3.py``). Under async scheduling it is called as soon as the step is launched, before
its samples are read: ``aux`` is then work enqueued on the device, and ``observe`` must not wait for it (no host
read), only enqueue work of its own after it.
"""

from dataclasses import dataclass
from typing import Protocol


@dataclass
class DraftRequest:
    seq_id: int
    token_ids: list[int]  # prompt + every output token so far, newest last (never a PENDING token)
    num_tokens: int  # propose at most this many


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """One list per request, in order, each at most ``num_tokens`` long (an empty list drafts nothing)."""
        ...

    def release(self, seq_id: int) -> None:
        """The sequence finished, was aborted or was preempted: drop whatever is kept for it."""
        ...
