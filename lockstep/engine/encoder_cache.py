"""The vision encoder's outputs kept between steps: each image is encoded once, by the step whose prefill first
reaches its tokens, and its features are sliced by every chunk that covers some of them.

The scheduler decides (``ScheduledSeq.encode`` names the images a step encodes; it counts their tokens against the
step's encoder budget), the model runner encodes and ``put``s, and the scheduler frees: an image once all its
tokens have KV in the cache, every image of a request when it finishes, is aborted or is preempted (a preempted
request encodes its images again on readmission; encoding is a pure function of the pixels, so the bits are the
same).

Features are kept by content: the image's pixel hash and grid (``ImageInput.hash``, the key the prefix cache uses),
so the same image in several running requests, in each of a prompt's ``n`` choices, or twice in one prompt is
encoded once and shared. Each ``(request_id, image index)`` that needs an image holds a reference to its content
from the step that schedules its first chunk over the image (``claim``) until it is freed; the content's features
go when the last reference does. An image's features do not depend on the batch it was encoded in (the towers'
contract), so a shared copy has the bits the request's own encoding would have had. Looked up, never iterated for
scheduling.
"""

from typing import Any

from lockstep.engine.multimodal import ImageInput
from lockstep.engine.sequence import Sequence

Key = tuple[bytes, tuple[int, int, int]]  # (pixel hash, grid_thw)


def content_key(image: ImageInput) -> Key:
    return image.hash, tuple(image.grid_thw)


class EncoderCache:
    """``ImageFeatures`` (models/multimodal.py) by image content, referenced by ``(request_id, image index)``.

    ``encoded`` counts the images whose features were ``put`` (what the encoder computed); ``shared`` the claims
    served by features another reference holds or is about to receive.
    """

    def __init__(self) -> None:
        self._refs: dict[tuple[str, int], Key] = {}  # who needs which content
        self._users: dict[Key, int] = {}  # references per content
        self._features: dict[Key, Any] = {}  # what the encoder returned, per content
        self.encoded = 0
        self.shared = 0

    def __len__(self) -> int:
        """The images whose features are held (each distinct content once)."""
        return len(self._features)

    def __contains__(self, ref: tuple[str, int]) -> bool:
        """Whether the features of image ``ref = (request_id, index)`` are here (not only claimed)."""
        key = self._refs.get(ref)
        return key is not None and key in self._features

    def keys(self) -> list[tuple[str, int]]:
        """The ``(request_id, image index)`` pairs that hold a reference, in claim order (for integrity checks)."""
        return list(self._refs)

    def holds_content(self, request_id: str, index: int, image: ImageInput) -> bool:
        """Whether ``(request_id, index)`` needs no encoding: it holds a reference, or some reference to the same
        content does (its features are here, or claimed earlier in this step and about to be ``put``)."""
        return (request_id, index) in self._refs or content_key(image) in self._users

    def claim(self, request_id: str, index: int, image: ImageInput) -> bool:
        """Take a reference to ``image``'s content for ``(request_id, index)`` (nothing new when it holds one).
        Returns whether the caller must have it encoded: False when its features are held, or another reference
        claimed them first (that claimant's encoding, earlier in the same step, will ``put`` them)."""
        ref = (request_id, index)
        key = self._refs.get(ref)
        if key is not None:
            return False
        key = content_key(image)
        self._refs[ref] = key
        users = self._users.get(key, 0)
        self._users[key] = users + 1
        if users:
            self.shared += 1
        return users == 0

    def put(self, request_id: str, index: int, features: Any) -> None:
        """Keep the features the encoder returned for ``(request_id, index)``: for its content, shared by every
        reference to it. Dropped when no reference is left (the request ended between its step's scheduling and
        the encoder's run, or never claimed it)."""
        key = self._refs.get((request_id, index))
        if key is None:
            return
        if key not in self._features:
            self.encoded += 1
        self._features[key] = features

    def get(self, request_id: str, index: int) -> Any:
        key = self._refs.get((request_id, index))
        features = None if key is None else self._features.get(key)
        if features is None:
            raise RuntimeError(f"{request_id!r}: image {index} was not encoded before a step needed its features")
        return features

    def _release(self, ref: tuple[str, int]) -> None:
        key = self._refs.pop(ref, None)
        if key is None:
            return
        users = self._users[key] - 1
        if users:
            self._users[key] = users
        else:
            del self._users[key]
            self._features.pop(key, None)

    def free_computed(self, seq: Sequence) -> None:
        """Release the images of ``seq`` whose tokens all have KV now."""
        for k, image in enumerate(seq.mm.images):
            if image.end <= seq.num_computed_tokens:
                self._release((seq.request_id, k))

    def free(self, seq: Sequence) -> None:
        """Release every image of ``seq``."""
        for k in range(len(seq.mm.images)):
            self._release((seq.request_id, k))

    def check_integrity(self) -> None:
        """Every content held or claimed has as many users as references name it."""
        counts: dict[Key, int] = {}
        for key in self._refs.values():
            counts[key] = counts.get(key, 0) + 1
        if counts != self._users or not set(self._features) <= set(self._users):
            raise AssertionError(
                f"Encoder cache integrity: {len(self._refs)} references, {len(self._users)} contents counted, "
                f"{len(self._features)} held"
            )
