"""``make_drafter``: the drafter a ``SpeculativeConfig`` names (its own module, so that ``drafter``, the protocol
every drafter implements, imports none of them)."""

from lockstep.spec.config import SpeculativeConfig
from lockstep.spec.drafter import Drafter


def make_drafter(config: SpeculativeConfig, engine_config) -> Drafter:
    """The drafter ``config`` names; ``engine_config`` is the target engine's EngineConfig (device, dtype, ...)."""
    if config.method == "ngram":
        from lockstep.spec.ngram import NgramDrafter

        return NgramDrafter(config)
    if config.method == "draft_model":
        from lockstep.spec.draft_model import DraftModelDrafter  # another module; torch and a second model

        return DraftModelDrafter(config, engine_config)
    raise NotImplementedError(f"speculative_config: method {config.method!r} is not implemented")
