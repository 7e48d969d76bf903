"""The vision encoder's outputs kept between steps: each image of a request is encoded once, by the step whose
prefill first reaches its tokens, and its features are sliced by every chunk that covers some of them.

The scheduler decides (``ScheduledSeq.encode`` names the images a step encodes; it counts their tokens against the
step's encoder budget), the model runner encodes and ``put``s, and the scheduler frees: an image once all its
tokens have KV in the cache, every image of a request when it finishes, is aborted or is preempted (a preempted
request encodes its images again on readmission; encoding is a pure function of the pixels, so the bits are the
same). Keyed by ``(request_id, image index)``; kept in a dict that is looked up, never iterated for scheduling.
"""

from typing import Any

from lockstep.engine.sequence import Sequence


class EncoderCache:
    """``ImageFeatures`` (models/multimodal.py) by ``(request_id, image index)``."""

    def __init__(self) -> None:
        self._features: dict[tuple[str, int], Any] = {}

    def __len__(self) -> int:
        return len(self._features)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._features

    def keys(self) -> list[tuple[str, int]]:
        """The ``(request_id, image index)`` pairs held, in insertion order (for integrity checks)."""
        return list(self._features)

    def put(self, request_id: str, index: int, features: Any) -> None:
        self._features[(request_id, index)] = features

    def get(self, request_id: str, index: int) -> Any:
        features = self._features.get((request_id, index))
        if features is None:
            raise RuntimeError(f"{request_id!r}: image {index} was not encoded before a step needed its features")
        return features

    def free_computed(self, seq: Sequence) -> None:
        """Free the images of ``seq`` whose tokens all have KV now."""
        for k, image in enumerate(seq.mm.images):
            if image.end <= seq.num_computed_tokens:
                self._features.pop((seq.request_id, k), None)

    def free(self, seq: Sequence) -> None:
        """Free every image of ``seq``."""
        for k in range(len(seq.mm.images)):
            self._features.pop((seq.request_id, k), None)
