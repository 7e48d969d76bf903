"""The trainer's end of a weight update over ``torch.distributed``: ``WeightSender`` broadcasts in buckets.

The trainer's rank 0 hosts the rendezvous and is rank 0 of the weight-update group (``distributed.weight_group``);
the sampler (``LLM.init_weight_transfer_engine`` in another process, or a ``lockstep serve`` through
``WeightClient``) joins it with every one of its ranks. Per update the sampler is told ``update_info(named)`` and the
trainer calls ``send(named)``; both sides then walk the same buckets.

A sharded trainer (FSDP2's ``fully_shard``, or any DTensor parameters) calls ``send_sharded`` on every trainer rank:
each bucket's tensors are gathered (``DTensor.full_tensor``, a collective of the trainer's own group) just before
rank 0 broadcasts that bucket, so at most one bucket of full tensors exists at a time.

    sender = WeightSender.connect("10.0.0.1", 51216, world_size=1 + sampler_ranks, device="cuda:0")
    info = sender.update_info(model.named_parameters())      # to the sampler: llm.update_weights(info)
    sender.send(model.named_parameters())                    # at the same time
"""

import datetime
import socket
import threading
from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, wait

import httpx
import torch

from lockstep.distributed.weight_group import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT,
    TensorSpec,
    WeightGroup,
    buckets,
    dtype_name,
    pack,
)

__all__ = ["WeightClient", "WeightSender", "alongside", "local_address", "send_sharded"]


def _full_shape_and_dtype(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(t.shape), t.dtype  # a DTensor's shape and dtype are the global tensor's


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)  # DTensor (FSDP2): all-gather over the trainer's group
    return (full_tensor() if full_tensor is not None else t).detach()


class WeightSender:
    """Trainer rank 0 in a weight-update group. ``dtype``: cast every tensor before sending (e.g. an fp32 trainer
    feeding a bf16 sampler sends half the bytes; the sampler would round the same way)."""

    def __init__(self, group: WeightGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None):
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype

    @classmethod
    def connect(
        cls,
        master_address: str,
        master_port: int,
        world_size: int,
        device: torch.device | str,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> "WeightSender":
        """Host the rendezvous on ``master_port`` and join as rank 0 of ``world_size``; blocks until every sampler
        rank has joined (``LLM.init_weight_transfer_engine`` with the same ``init_info``, ``rank_offset`` 1)."""
        group = WeightGroup.join(master_address, master_port, 0, world_size, device, timeout)
        return cls(group, bucket_bytes, dtype)

    def specs(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
        out = []
        for name, t in named:
            shape, dtype = _full_shape_and_dtype(t)
            out.append(TensorSpec(name, self.dtype or dtype, shape))
        return out

    def update_info(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """What the sampler's ``update_weights`` takes for an update of ``named`` (names, dtypes, shapes, buckets)."""
        specs = self.specs(named)
        return {
            "names": [s.name for s in specs],
            "dtype_names": [dtype_name(s.dtype) for s in specs],
            "shapes": [list(s.shape) for s in specs],
            "bucket_bytes": self.bucket_bytes,
        }

    def send(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast ``named`` (the order ``update_info`` announced) bucket by bucket."""
        _send_buckets(self, list(named), self.bucket_bytes, self.dtype)

    def close(self) -> None:
        self.group.close()


def _send_buckets(
    sender: "WeightSender | None", named: list[tuple[str, torch.Tensor]], bucket_bytes: int, dtype
) -> None:
    specs = [TensorSpec(n, dtype or t.dtype, tuple(t.shape)) for n, t in named]
    plan = buckets(specs, bucket_bytes)
    device = sender.group.device if sender is not None else None
    buffer = None
    if sender is not None:
        buffer = torch.empty(max((b.nbytes for b in plan), default=0), dtype=torch.uint8, device=device)
    at = 0
    with torch.no_grad():
        for bucket in plan:
            tensors = [_full(t) for _, t in named[at : at + len(bucket.specs)]]  # collective on a sharded trainer
            at += len(bucket.specs)
            if sender is None:
                continue
            tensors = [t.to(device, dtype or t.dtype) for t in tensors]
            sender.group.broadcast(pack(bucket, tensors, buffer))


def send_sharded(
    sender: WeightSender | None,
    named: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> None:
    """Every rank of a sharded trainer calls this with its (DTensor) parameters in the same order; rank 0 passes
    its ``WeightSender`` (whose bucket size and dtype then apply), the others None. Each bucket's tensors are
    gathered on every rank, then rank 0 broadcasts the bucket to the sampler."""
    if sender is not None:
        bucket_bytes, dtype = sender.bucket_bytes, sender.dtype
    _send_buckets(sender, list(named), bucket_bytes, dtype)


def alongside(request, work):
    """Run ``request()`` (an HTTP call that makes the sampler join a collective) and ``work()`` (this side of it) at
    the same time; ``work``'s result. If either fails first, its error is raised at once: a collective left
    waiting for a sampler that refused (a 4xx) then times out on its own, in the background."""
    futures: dict[str, Future] = {"request": Future(), "work": Future()}

    def run(key: str, fn) -> None:
        try:
            futures[key].set_result(fn())
        except BaseException as e:  # noqa: BLE001 - raised below
            futures[key].set_exception(e)

    for key, fn in (("request", request), ("work", work)):
        threading.Thread(target=run, args=(key, fn), daemon=True, name=f"lockstep-weights-{key}").start()
    pending = set(futures.values())
    while pending:
        done, pending = wait(pending, return_when=FIRST_EXCEPTION)
        for f in done:
            f.result()  # raises the first failure
    return futures["work"].result()


def local_address(host: str, port: int) -> str:
    """This machine's address as ``host`` would see it (the interface that routes there): what the trainer
    announces as ``master_address``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(host), port))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class WeightClient:
    """A ``lockstep serve`` (run with ``--dev-mode``) as the sampler: the HTTP calls of vLLM's weight-transfer API
    made while this process broadcasts. ``base_url``: ``http://host:port``."""

    def __init__(self, base_url: str, headers: dict | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(headers=headers or {}, timeout=timeout)
        self.sender: WeightSender | None = None

    def _post(self, path: str, body: dict | None = None) -> dict:
        r = self.http.post(self.base_url + path, json=body or {})
        if r.status_code != 200:
            raise RuntimeError(f"POST {path} failed: {r.status_code} {r.text}")
        return r.json()

    def _while(self, path: str, body: dict, work) -> object:
        """POST ``path`` while ``work()`` runs (both ends of a collective); ``work``'s result."""
        return alongside(lambda: self._post(path, body), work)

    def world_size(self) -> int:
        r = self.http.get(self.base_url + "/get_world_size")
        if r.status_code == 404:
            raise RuntimeError(f"{self.base_url} serves no weight updates: start it with lockstep serve --dev-mode")
        r.raise_for_status()
        return int(r.json()["world_size"])

    def connect(
        self, master_port: int, device: torch.device | str, master_address: str | None = None, **sender_kwargs
    ) -> WeightSender:
        """Join the server's ranks in a new weight-update group, this process as rank 0 hosting the rendezvous on
        ``master_port`` (``master_address``: this machine's address as the server sees it, by default)."""
        world = self.world_size() + 1
        if master_address is None:
            url = httpx.URL(self.base_url)
            master_address = local_address(url.host, url.port or 80)
        init = {"master_address": master_address, "master_port": master_port, "rank_offset": 1, "world_size": world}
        self.sender = self._while(
            "/init_weight_transfer_engine",
            {"init_info": init},
            lambda: WeightSender.connect(master_address, master_port, world, device, **sender_kwargs),
        )
        return self.sender

    def update(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send one update (the server clears its prefix cache after it)."""
        named = list(named)
        info = self.sender.update_info(named)
        self._while("/update_weights", {"update_info": info}, lambda: self.sender.send(named))

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        self.http.close()
