"""lockstep: LLM inference whose answer to a request does not depend on how the server batches it."""

from lockstep import ops

__version__ = "0.1.0"

__all__ = ["ops", "__version__"]
