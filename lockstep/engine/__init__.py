"""The engine: requests (sequence), KV blocks (block_manager), continuous batching (scheduler)."""

from lockstep.engine.block_manager import BlockManager
from lockstep.engine.scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from lockstep.engine.sequence import FinishReason, Sequence, SequenceStatus, TokenLogprobs

__all__ = [
    "BlockManager",
    "FinishReason",
    "ScheduledBatch",
    "ScheduledSeq",
    "Scheduler",
    "Sequence",
    "SequenceStatus",
    "TokenLogprobs",
]
