"""Acceptance counters for speculative decoding, as vLLM's ``spec_decode`` metrics count them.

A verify chunk is one decoding sequence's drafts checked in one step. ``num_accepted_tokens`` counts the drafts
that equalled the token sampled at their position (each accepted chunk also adds the target's own next token,
which is not counted here); ``accepted_per_position[i]`` counts chunks whose draft ``i`` was accepted. Per request,
``tokens / steps`` is how many tokens each of its steps added (1.0 without drafting): the "accepted length".
"""

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verify chunks
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    chunks_by_accepted: list[int] = field(default_factory=list)  # [a]: verify chunks that accepted a drafts
    # Finished requests' accepted lengths: their output tokens over the steps that gave them tokens.
    num_finished: int = 0
    sum_accepted_length: float = 0.0

    def count_chunk(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        if len(self.chunks_by_accepted) <= num_accepted:
            self.chunks_by_accepted += [0] * (num_accepted + 1 - len(self.chunks_by_accepted))
        self.chunks_by_accepted[num_accepted] += 1

    def count_finished(self, num_tokens: int, num_steps: int) -> None:
        if num_steps:
            self.num_finished += 1
            self.sum_accepted_length += num_tokens / num_steps

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens (0.0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify chunk adds on average: 1 + accepted drafts per chunk (vLLM's "mean acceptance length")."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def mean_request_accepted_length(self) -> float:
        """The finished requests' mean of tokens per step that gave them tokens (1.0 before any)."""
        return self.sum_accepted_length / self.num_finished if self.num_finished else 1.0
