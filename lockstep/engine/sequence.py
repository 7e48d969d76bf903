"""One request as the engine sees it: its tokens, where its KV lives, and how far it has got."""

from enum import Enum
from typing import TYPE_CHECKING

from lockstep.layers.sampler import TokenLogprobs
from lockstep.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lockstep.engine.multimodal import MultimodalInputs

# Async scheduling: the stand-in for a sampled token the host has not read back yet (the device feeds the real one
# to the next step). Never a token id; the engine replaces it before anything reads the sequence's tokens.
PENDING_TOKEN = -1


class SequenceStatus(Enum):
    WAITING = "waiting"  # not yet admitted, or preempted: holds no KV blocks
    RUNNING = "running"  # admitted: holds KV blocks for its whole context
    FINISHED = "finished"


class FinishReason(str, Enum):
    """Why a sequence finished; the values are the OpenAI API's ``finish_reason`` strings."""

    STOP = "stop"  # EOS, a stop token id, or a stop string (the engine detects those)
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"


class Sequence:
    """A request: prompt, generated tokens, KV block table and progress counters.

    Token positions ``[0, num_computed_tokens)`` have their KV in the cache; the next step computes from
    ``num_computed_tokens`` on. A running sequence always has at least one pending token: the rest of its prompt
    while it prefills, or the last sampled token while it decodes. Equality is identity.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        block_size: int = 16,
        mm: "MultimodalInputs | None" = None,
    ) -> None:
        self.request_id = request_id
        self.params = params if params is not None else SamplingParams()
        self.block_size = block_size
        # All tokens, prompt then output; the split is num_prompt_tokens.
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        # Each output token's logprob, kept in CompletionOutput.token_logprobs's shape: a step's outputs copy the
        # list in C instead of rebuilding it in Python (O(length) per request per step). For requests that asked
        # for logprobs, each token's rank and top logprobs too (the engine turns them into vLLM's dicts).
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[TokenLogprobs] = []
        # With params.prompt_logprobs: entry j is prompt token j + 1's, from position j's logits (filled as
        # prefill chunks compute those positions; kept across preemption).
        self.computed_prompt_logprobs: list[TokenLogprobs] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, prefix-cache hits at the latest admission
        self.num_preemptions = 0
        self.arrival = -1  # set by Scheduler.add; orders FIFO admission and preemption
        # With params.structured_outputs: the request's place in its grammar (a GrammarState, set by the engine),
        # a function of output_token_ids alone, so preemption keeps it valid.
        self.grammar = None
        # A vision-language request's images and M-RoPE positions (engine/multimodal.py); None for text.
        self.mm = mm

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_prompt_tokens}"
            f"+{self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not yet computed; the step that computes the last of them samples a token."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_blocks(self) -> int:
        """KV blocks needed to compute every current token."""
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        """How many of the last block's slots the current tokens fill (1..block_size)."""
        return len(self.token_ids) - (self.num_blocks - 1) * self.block_size

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_token_ids(self, i: int) -> list[int]:
        """Token ids that block ``i`` of this sequence holds (fewer than block_size for a partial last block)."""
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    @property
    def may_draft(self) -> bool:
        """Whether drafted tokens may follow this sequence's newest token in its next step (speculative decoding):
        a text sequence's always; a vision-language one's once its prompt is computed (drafts are text, and their
        M-RoPE positions are then index + delta, as a decode step's)."""
        return self.mm is None or self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def has_pending_token(self) -> bool:
        """Whether the newest token is ``PENDING_TOKEN``: sampled by a step whose results are not read yet."""
        return self.token_ids[-1] == PENDING_TOKEN

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        """Append a sampled token, or put it in the place of the pending one that stands for it."""
        if self.token_ids[-1] == PENDING_TOKEN:
            self.token_ids[-1] = token_id
        else:
            self.token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs.logprob)
            if self.params.logprobs is not None:  # only requests that asked for top logprobs report them
                self.output_top_logprobs.append(logprobs)
