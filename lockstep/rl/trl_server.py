"""TRL's ``GRPOTrainer(use_vllm=True, vllm_mode="server")`` against ``lockstep serve --dev-mode``.

TRL 1.16's server mode drives ``vllm serve`` through ``trl.generation.vllm_client.VLLMClient``: ``/health``,
``/v1/models``, ``/server_info``, ``/get_world_size``, ``/v1/completions`` (``return_token_ids``,
``return_tokens_as_token_ids``, ``logprobs=0``), vLLM's weight-transfer routes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) and ``/reset_prefix_cache``. A lockstep
server in dev mode answers every one of them (``server.rl_api``). Two things of the client's own need vLLM itself:

1. ``VLLMGeneration._init_vllm`` and ``VLLMClient.__init__`` raise ImportError unless the ``vllm`` package imports
   (``trl.import_utils.is_vllm_available``), although server mode calls nothing of vLLM but (2);
2. the weight broadcast: ``VLLMClient.init_communicator`` and ``update_named_params`` run vLLM's NCCL
   weight-transfer engine (``vllm.distributed.weight_transfer.nccl_common.trainer_init``,
   ``packed_tensor.packed_nccl_broadcast_producer``: vLLM's ``StatelessProcessGroup`` and ``PyNcclCommunicator``),
   and ``init_communicator`` raises NotImplementedError for a device that is not CUDA.

``use_lockstep_server()`` is the shim, called once before the trainer is built: TRL's ``VLLMGeneration`` then makes
a ``LockstepVLLMClient`` instead, which is ``VLLMClient`` with those three methods (and ``close_communicator``)
over lockstep's weight-update group (``lockstep.rl.weight_sync``: gloo on the CPU, NCCL on CUDA; the same HTTP
calls), and starts without the ``vllm`` package. Everything else (generation, the metadata walk, FSDP/PEFT
gathering, the prefix-cache reset, the mismatch metrics) is TRL's own code. ``patch_trainer(trainer)`` then puts the
trainer's model on lockstep's kernels, as ``use_lockstep`` does in process, so TRL's
``sampling/sampling_logp_difference`` reads exactly 0 against a batch-invariant server.

    use_lockstep_server()
    trainer = GRPOTrainer(model=model, args=GRPOConfig(use_vllm=True, vllm_mode="server",
                          vllm_server_base_url="http://sampler:8000"), ...)
    patch_trainer(trainer)
    trainer.train()
"""

import atexit
from contextlib import contextmanager

import torch

from lockstep.distributed.weight_group import DEFAULT_BUCKET_BYTES
from lockstep.rl.weight_sync import WeightSender, alongside, local_address

__all__ = ["patch_trainer", "use_lockstep_server"]


@contextmanager
def _vllm_not_required():
    """``VLLMClient.__init__`` checks that vLLM imports; server mode with lockstep needs nothing of it."""
    import trl.generation.vllm_client as client_module

    saved = client_module.is_vllm_available
    client_module.is_vllm_available = lambda *args, **kwargs: True
    try:
        yield
    finally:
        client_module.is_vllm_available = saved


def _client_class():
    from trl.generation.vllm_client import VLLMClient

    class LockstepVLLMClient(VLLMClient):
        """TRL's ``VLLMClient`` whose weight transfer runs over lockstep's weight-update group (gloo on the CPU,
        NCCL on CUDA) instead of vLLM's NCCL engine; the HTTP calls are TRL's. ``bucket_bytes``: the bucket size."""

        bucket_bytes = DEFAULT_BUCKET_BYTES

        def __init__(self, *args, **kwargs):
            with _vllm_not_required():
                super().__init__(*args, **kwargs)

        def init_communicator(self, device: torch.device | str | int = 0) -> None:
            device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            if device.type == "cuda" and device.index is not None:
                torch.cuda.set_device(device)
            response = self.session.get(f"{self.base_url}/get_world_size")
            if response.status_code != 200:
                raise RuntimeError(
                    f"{self.base_url} serves no weight updates ({response.status_code}): start it with "
                    "`lockstep serve --dev-mode`"
                )
            world_size = response.json()["world_size"] + 1  # the trainer is rank 0, the server's ranks follow
            port = self.server_port if hasattr(self, "server_port") else 80
            address = local_address(self.host, port)
            init_info = {"master_address": address, "master_port": self.group_port, "rank_offset": 1,
                         "world_size": world_size}  # fmt: skip
            self.communicator = alongside(
                lambda: self._post(f"{self.base_url}/init_weight_transfer_engine", json={"init_info": init_info}),
                lambda: WeightSender.connect(address, self.group_port, world_size, device, self.bucket_bytes),
            )
            atexit.register(self.close_communicator)

        def update_named_params(self, metadata, named_params) -> None:
            names, dtype_names, shapes = (list(field) for field in zip(*metadata, strict=True))
            info = {"names": names, "dtype_names": dtype_names, "shapes": shapes, "bucket_bytes": self.bucket_bytes}
            if not self._updating_weights:
                self._start_weight_update()
            alongside(
                lambda: self._post(f"{self.base_url}/update_weights", json={"update_info": info}),
                lambda: self.communicator.send(list(named_params)),
            )
            if not self._updating_weights:
                self._finish_weight_update()

        def close_communicator(self) -> None:
            if self.communicator is not None:
                self.communicator.close()
                self.communicator = None

    return LockstepVLLMClient


def use_lockstep_server(bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> type:
    """Make TRL's server mode talk to a ``lockstep serve --dev-mode`` (the module docstring says what changes);
    call it before building the trainer. Returns the client class. Idempotent."""
    import trl.generation.vllm_generation as generation

    cls = getattr(generation.VLLMClient, "_lockstep_client", None)
    if cls is None:
        cls = _client_class()
        cls._lockstep_client = cls
        generation.VLLMClient = cls
        generation.is_vllm_available = lambda *args, **kwargs: True  # the check in VLLMGeneration._init_vllm
    cls.bucket_bytes = bucket_bytes
    return cls


def patch_trainer(trainer) -> None:
    """Put a built ``GRPOTrainer``'s model (and reference model) on lockstep's kernels, with lockstep's fused LM
    head in place of TRL's, so its logprobs are the server's bits (``lockstep.rl.hf.patch_model``)."""
    from lockstep.rl.hf import patch_model
    from lockstep.rl.hf.fused_head import add_fused_lm_head
    from lockstep.rl.trl import _models, _sampling

    _sampling(trainer)  # temperature 1 (the logprobs the server reports are the raw distribution's)
    for model in _models(trainer):
        patch_model(model)
        add_fused_lm_head(model, temperature=trainer.temperature)
