"""lockstep: LLM inference whose answer to a request does not depend on how the server batches it."""

from lockstep import ops
from lockstep.check import InvarianceReport, check_batch_invariance
from lockstep.llm import LLM, CompletionOutput, RequestOutput
from lockstep.ops.mode import (
    batch_invariant_mode,
    disable_batch_invariant_mode,
    enable_batch_invariant_mode,
    is_batch_invariant_mode_enabled,
)
from lockstep.outputs import Logprob
from lockstep.sampling_params import BeamSearchParams, SamplingParams, choice_seed
from lockstep.structured import StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "InvarianceReport",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
    "batch_invariant_mode",
    "check_batch_invariance",
    "choice_seed",
    "disable_batch_invariant_mode",
    "enable_batch_invariant_mode",
    "is_batch_invariant_mode_enabled",
    "ops",
]
