"""Sleep mode: give the KV cache (and the weights) back to the device while a trainer uses it, then take them again.

vLLM's levels: level 1 discards the KV cache and offloads the weights to host memory (pinned, on CUDA); level 2
discards both, and the weights must be loaded again (``load_weights`` or a distributed update) before waking up.
Freeing works on storages, not tensors: every weight and cache tensor keeps its identity (the model's modules,
its views of stacked tensors and the runner's cache list hold them), only its storage is resized to 0 bytes and back.
Waking up restores the offloaded bytes (level 1) and zeroes the KV cache, which is what a new engine's cache holds:
the engine then answers with the bits it gave before sleeping. CUDA graphs captured the old addresses: they are
freed at sleep and captured again at wake-up (which is most of the wake-up time).

A weight loaded while asleep is allocated again on the spot (level 1: the offloaded copy of its storage is dropped),
so a trainer can push weights into a sleeping sampler and then wake it; at level 2 ``wake_up`` raises ValueError
naming the weights that were discarded and not loaded since.
"""

from dataclasses import dataclass, field

import torch

LEVELS = (1, 2)
TAGS = ("weights", "kv_cache")


@dataclass
class _Storage:
    """A weight storage while asleep: its size, its checkpoint names, and its host copy (level 1)."""

    storage: torch.UntypedStorage
    nbytes: int
    names: list[str]
    backup: torch.Tensor | None = None  # uint8 [nbytes] on the host
    loaded: set[str] = field(default_factory=set)  # names loaded while asleep (level 2)


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """The whole storage as a uint8 tensor (shares it)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


def _forget_derived(t: torch.Tensor) -> None:
    """Drop what kernels keep on a weight tensor (the CPU matmul's packed copy, expert views): it would hold the
    memory sleep frees, and it describes bytes that are about to change."""
    for key in [k for k in vars(t) if k.startswith("_lockstep_")]:
        delattr(t, key)


class SleepState:
    """The sleeping state of one rank's model and KV cache; ``level`` is None while awake."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        self.level: int | None = None
        self.kv_asleep = False
        self._weights: dict[int, _Storage] = {}  # by storage address while awake: weights that are freed
        self._by_name: dict[str, _Storage] = {}
        # The model's checkpoint views and shards, taken before the storages shrink (a view of a 0-byte storage
        # cannot be made; one made before stays valid and sees the bytes again once they are back).
        self.slots: dict[str, torch.Tensor] | None = None
        self.shards: dict | None = None

    @property
    def is_sleeping(self) -> bool:
        return self.level is not None

    def _weight_storages(self) -> dict[int, _Storage]:
        found: dict[int, _Storage] = {}
        for name, t in self.slots.items():
            s = t.untyped_storage()
            entry = found.setdefault(s.data_ptr(), _Storage(s, s.nbytes(), []))
            entry.names.append(name)
        return found

    def sleep(self, level: int) -> None:
        if level not in LEVELS:
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.is_sleeping:
            raise RuntimeError(f"the engine is already sleeping (level {self.level})")
        for p in self.model.parameters():
            _forget_derived(p)
        self.slots, self.shards = self.model.checkpoint_tensors(), self.model.checkpoint_shards()
        self._weights = self._weight_storages()
        pinned = self.device.type == "cuda"
        for entry in self._weights.values():
            if level == 1:
                entry.backup = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=pinned)
                entry.backup.copy_(_bytes_of(entry.storage, self.device))
            for name in entry.names:
                self._by_name[name] = entry
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for entry in self._weights.values():
            entry.storage.resize_(0)
        for k, v in self.kv_caches:
            k.untyped_storage().resize_(0)
            v.untyped_storage().resize_(0)
        self.level, self.kv_asleep = level, True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def materialize(self, name: str) -> None:
        """Before ``name`` is loaded while asleep: allocate its storage again (level 1: with its offloaded bytes, so
        the other tensors sharing the storage keep theirs)."""
        entry = self._by_name.get(name)
        if entry is None:
            return
        if entry.storage.nbytes() == 0:
            self._restore(entry)
        entry.loaded.add(name)

    def _restore(self, entry: _Storage) -> None:
        entry.storage.resize_(entry.nbytes)
        if entry.backup is not None:
            _bytes_of(entry.storage, self.device).copy_(entry.backup)
            entry.backup = None

    def check_wake(self, tags: list[str] | None) -> list[str]:
        """``tags`` as a list (default both); ValueError for an unknown tag, or for level-2 weights not loaded since
        the sleep when ``tags`` wakes the weights."""
        tags = list(TAGS) if tags is None else list(tags)
        bad = [t for t in tags if t not in TAGS]
        if bad:
            raise ValueError(f"wake_up tags must be among {TAGS}, got {bad}")
        if "weights" in tags and self.level == 2:
            missing = [n for e in self._weights.values() for n in e.names if n not in e.loaded]
            if missing:
                raise ValueError(
                    f"wake_up: the weights were discarded at sleep level 2 and {len(missing)} of them were not "
                    f"loaded since (first: {', '.join(missing[:3])}): load every weight (LLM.load_weights or "
                    "update_weights) before waking up, or sleep at level 1 to keep them"
                )
        return tags

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Allocate what ``tags`` names (default both) again; returns whether the engine is now fully awake.
        ValueError, with nothing changed, for what ``check_wake`` refuses."""
        tags = self.check_wake(tags)
        if not self.is_sleeping:
            return True
        if "weights" in tags and self._weights:
            for entry in self._weights.values():
                if entry.storage.nbytes() == 0:
                    self._restore(entry)
            self._weights, self._by_name = {}, {}
        if "kv_cache" in tags and self.kv_asleep:
            for k, v in self.kv_caches:
                for t in (k, v):
                    t.untyped_storage().resize_(t.numel() * t.element_size())
                    t.zero_()
            self.kv_asleep = False
        if not self._weights and not self.kv_asleep:
            self.level, self.slots, self.shards = None, None, None
        return self.level is None
