"""``make_drafter``: the drafter a ``SpeculativeConfig`` names (its own module, so that ``drafter``, the protocol
every drafter implements, imports none of them)."""

from lockstep.spec.config import SpeculativeConfig
from lockstep.spec.drafter import Drafter


def make_drafter(config: SpeculativeConfig, engine_config, runner=None) -> Drafter:
    """The drafter ``config`` names; ``engine_config`` is the target engine's EngineConfig (device, dtype, ...),
    ``runner`` its ``ModelRunner`` (an EAGLE-3 head reads the target's hidden states and embedding)."""
    if config.method == "ngram":
        from lockstep.spec.ngram import NgramDrafter

        return NgramDrafter(config)
    if config.method == "draft_model":
        from lockstep.spec.draft_model import DraftModelDrafter  # another module; torch and a second model

        return DraftModelDrafter(config, engine_config)
    if config.method == "eagle3":
        from lockstep.spec.eagle3 import Eagle3Drafter

        if runner is None:
            raise ValueError("speculative_config: an EAGLE-3 drafter needs the target's ModelRunner")
        return Eagle3Drafter(config, engine_config, runner)
    raise NotImplementedError(f"speculative_config: method {config.method!r} is not implemented")
