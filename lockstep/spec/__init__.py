"""Speculative decoding: drafters propose tokens, the engine verifies them (docs/design.md, "Speculative decoding").

A drafter only changes how many tokens one step can add, never which tokens: the engine accepts a drafted token
exactly when it equals the token plain decoding samples at that position, so the output is plain decoding's, bit
for bit, whatever the drafter proposes.
"""

from lockstep.spec.config import SpeculativeConfig
from lockstep.spec.drafter import Drafter, DraftRequest
from lockstep.spec.factory import make_drafter

__all__ = ["DraftRequest", "Drafter", "SpeculativeConfig", "make_drafter"]
