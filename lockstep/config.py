"""The engine's configuration: one dataclass, validated when it is built."""

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from lockstep.spec.config import SpeculativeConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other spellings
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # EngineConfig.load_format
# A step's token budget when max_num_batched_tokens is None, by device type (at least max_num_seqs). A running
# decode waits for at most one step, so one prefill chunk is the longest stall a long prompt can cause: on the
# 2-core CPU machines 256 tokens of SmolLM2-135M take 4-15 s (the attention grows with the context), on an H200
# 8192 tokens of an 8B model well under a second.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 256, "cuda": 8192}
# The most pixels an image may have before it is decoded (its header says how many): 8192 x 8192, ~200 MB as RGB.
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
MM_PROCESSOR_KWARGS = ("min_pixels", "max_pixels")  # what mm_processor_kwargs may set


def _check_int(name: str, value: object, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        none = " or None" if optional else ""
        raise ValueError(f"{name} must be an int >= {minimum}{none}, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def check_device(device: str | None) -> None:
    """Raise ValueError, in one line, when ``device`` names CUDA that this torch cannot use: a CPU-only build, no
    visible GPU, or an index past the last one. None (the default: CUDA when available) and "cpu" always pass."""
    if device is None or not device.startswith("cuda"):
        return
    import torch

    if torch.version.cuda is None:
        raise ValueError(
            f"device {device!r}: this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of torch, "
            "or use --device cpu"
        )
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    index = device.partition(":")[2]
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA GPUs (cuda:0 to cuda:N-1)")


def resolve_device(device: str | None) -> "torch.device":
    """``device`` as a ``torch.device``; None means CUDA when torch sees a GPU, else the CPU."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# "auto": the model's dtype; "fp8" (vLLM's name, also "fp8_e4m3"): e4m3 with a per-tensor scale of 1.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass
class EngineConfig:
    """Everything the engine needs to know before the first request.

    ``num_kv_blocks=None``, ``max_model_len=None`` and ``max_num_batched_tokens=None`` mean "decide later": the
    engine sizes the KV cache from free memory, reads the context length from the model and takes the token
    budget of its device from ``DEFAULT_MAX_NUM_BATCHED_TOKENS``, then builds the scheduler from
    ``dataclasses.replace(config, num_kv_blocks=..., max_model_len=..., max_num_batched_tokens=...)``.

    Every sequence in the running set is given its decode token before any prefill is scheduled, so
    ``max_num_batched_tokens >= max_num_seqs`` is required: a step always has room for all running decodes.
    """

    model: str | None = None  # a checkpoint folder or a Hugging Face model id (None: the embedded model)
    revision: str | None = None  # of a Hugging Face model id: a branch, tag or commit (default "main")
    dtype: str = "auto"
    device: str | None = None  # None: CUDA when available, else CPU
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: by device, DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # The kernel set, by registered name (layers.kernels). ``batch_invariant`` is the shorthand: True picks
    # "invariant", False "default"; after construction both are set and agree. Left unset, vLLM's environment
    # switch VLLM_BATCH_INVARIANT=0/1 sets the shorthand.
    kernels: str | None = None
    batch_invariant: bool | None = None
    seed: int | None = None  # seeds the draw of per-request seeds for sampled requests that bring none
    enforce_eager: bool = False  # True: no CUDA graphs (on CUDA, decode steps replay captured graphs)
    # True: the engine schedules and launches step N + 1 before it reads step N's sampled tokens back, feeding them
    # to step N + 1 on the device (docs/design.md, "Async scheduling"); the same bits either way. None: on CUDA (one
    # GPU or several: measured faster, docs/perf.md), off on the CPU (nothing to overlap).
    async_scheduling: bool | None = None
    # Tensor parallelism: the model sharded over this many processes (one per GPU on CUDA, gloo processes on the
    # CPU), each with its own copy of the decode graphs. ``tp_invariant`` reduces the row-parallel layers through
    # the chunk tree (ops.tp_linear), whose bits do not depend on the TP size; None: on exactly when
    # tensor_parallel_size > 1 and the kernel set is batch-invariant (then it must be on: a plain all-reduce
    # follows the batch). Set it True at TP 1 to get the bits every TP size gives.
    tensor_parallel_size: int = 1
    tp_invariant: bool | None = None
    # Sampling defaults for requests that leave them out (vLLM's): "auto" reads the model folder's
    # generation_config.json, "vllm" none, any other value is a folder whose generation_config.json to read.
    generation_config: str = "auto"
    # "auto" reads the checkpoint's weights; "dummy" draws them at random from config.json's shape (benchmarks).
    load_format: str = "auto"
    # Vision-language models (README, "Vision-language models"). Images per prompt (vLLM's {"image": N}; None: no
    # limit), the image processor's min/max pixels, image tokens the vision encoder takes per step (None: the
    # step's token budget), the folder under which requests may name local image files (None: none), the hosts
    # images may be fetched from over http(s) (None: nothing is fetched) and the pixel cap checked before decoding.
    limit_mm_per_prompt: dict[str, int] | None = None
    mm_processor_kwargs: dict[str, int] | None = None
    max_num_encoder_tokens_per_step: int | None = None
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    # FP8 (models/quantization.py, docs/design.md "FP8"): "fp8" quantizes a full-precision checkpoint's linear layers
    # online (an FP8 checkpoint is read as FP8 whatever this says); kv_cache_dtype "fp8" keeps K/V in e4m3.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    # vLLM's cap on the logprobs a request may ask for (top logprobs per token and per prompt token); -1: the whole
    # vocabulary (which is also what a request's -1 asks for).
    max_logprobs: int = 20
    # vLLM's: load no tokenizer; prompts are then token ids and outputs have no text (nor decoded logprob tokens).
    skip_tokenizer_init: bool = False
    # vLLM's: allow LLM.sleep / wake_up (engine/sleep.py), freeing the KV cache and the weights for a trainer.
    enable_sleep_mode: bool = False
    # Speculative decoding (README, "Speculative decoding"): vLLM's speculative_config dict, parsed into a
    # SpeculativeConfig. Drafting changes only how many tokens a step adds, never which. async_scheduling is off
    # with it unless set: a verify step is read back before the next is scheduled (docs/design.md).
    speculative_config: SpeculativeConfig | dict | None = None

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a path or model id string, got {self.model!r}")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision):
            raise ValueError(f"revision must be a non-empty string or None, got {self.revision!r}")
        if self.revision is not None and self.model is None:
            raise ValueError(f"revision={self.revision!r} needs a Hugging Face model id (model is None)")
        if isinstance(self.dtype, str):
            self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.device is not None and (
            not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda")
        ):
            raise ValueError(f"device must be None, 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.device is not None and self.device.startswith("cuda:") and not self.device[5:].isdigit():
            raise ValueError(f"device must be None, 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        check_device(self.device)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs one token of each step's budget"
            )
        _check_int("max_model_len", self.max_model_len, 2, optional=True)
        _check_int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size!r}")
        _check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        mem = self.gpu_memory_utilization
        if not isinstance(mem, (int, float)) or isinstance(mem, bool) or not 0 < mem <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {mem!r}")
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        _check_bool("enable_sleep_mode", self.enable_sleep_mode)
        _check_bool("enforce_eager", self.enforce_eager)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        self._check_multimodal()
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _check_int("max_logprobs", self.max_logprobs, -1)
        _check_bool("skip_tokenizer_init", self.skip_tokenizer_init)
        self._resolve_kernels()
        self._resolve_tp()
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
            if self.async_scheduling is None:  # not yet measured on a GPU with drafts: on only when asked for
                self.async_scheduling = False
        if self.async_scheduling is None:
            self.async_scheduling = resolve_device(self.device).type == "cuda"
        _check_bool("async_scheduling", self.async_scheduling)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.max_model_len is not None and self.num_kv_blocks is not None:
            capacity = self.num_kv_blocks * self.block_size
            # The longest sequence holds KV for max_model_len - 1 tokens (its last token is never fed back).
            if capacity < self.max_model_len - 1:
                raise ValueError(
                    f"num_kv_blocks * block_size = {self.num_kv_blocks} * {self.block_size} = {capacity} KV "
                    f"slots cannot hold one sequence of max_model_len={self.max_model_len} tokens"
                )

    def _check_multimodal(self) -> None:
        limits = self.limit_mm_per_prompt
        if limits is not None:
            if not isinstance(limits, dict) or set(limits) - {"image"}:
                raise ValueError(f'limit_mm_per_prompt must be a dict like {{"image": 4}}, got {limits!r}')
            for name, value in limits.items():
                _check_int(f"limit_mm_per_prompt[{name!r}]", value, 0)
        kwargs = self.mm_processor_kwargs
        if kwargs is not None:
            if not isinstance(kwargs, dict) or set(kwargs) - set(MM_PROCESSOR_KWARGS):
                raise ValueError(f"mm_processor_kwargs takes {', '.join(MM_PROCESSOR_KWARGS)}, got {kwargs!r}")
            for name, value in kwargs.items():
                _check_int(f"mm_processor_kwargs[{name!r}]", value, 1)
        _check_int("max_num_encoder_tokens_per_step", self.max_num_encoder_tokens_per_step, 1, optional=True)
        _check_int("max_image_pixels", self.max_image_pixels, 1)
        if self.allowed_local_media_path is not None and not isinstance(self.allowed_local_media_path, str):
            raise ValueError(f"allowed_local_media_path must be a folder path, got {self.allowed_local_media_path!r}")
        domains = self.allowed_media_domains
        names_ok = isinstance(domains, list) and all(isinstance(d, str) and d for d in domains)
        if domains is not None and not names_ok:
            raise ValueError(f"allowed_media_domains must be a list of host names, got {domains!r}")

    def _resolve_kernels(self) -> None:
        from lockstep.layers.kernels import get_kernels  # imports torch and the kernels: only when a config is made

        env = os.environ.get("VLLM_BATCH_INVARIANT")
        if self.batch_invariant is None and self.kernels is None and env:  # vLLM's switch, as the shorthand's value
            if env not in ("0", "1"):
                raise ValueError(f"VLLM_BATCH_INVARIANT must be 0 or 1, got {env[:50]!r}")
            self.batch_invariant = env == "1"
        if self.batch_invariant is not None:
            _check_bool("batch_invariant", self.batch_invariant)
        if self.kernels is None:
            self.kernels = "default" if self.batch_invariant is False else "invariant"
        invariant = get_kernels(self.kernels).batch_invariant
        if self.batch_invariant is not None and self.batch_invariant != invariant:
            raise ValueError(
                f"batch_invariant={self.batch_invariant} contradicts kernels={self.kernels!r}, a kernel set that is "
                f"{'' if invariant else 'not '}batch-invariant"
            )
        self.batch_invariant = invariant

    def _resolve_tp(self) -> None:
        from lockstep.ops.tp_linear import CHUNKS

        size = self.tensor_parallel_size
        _check_int("tensor_parallel_size", size, 1)
        if self.tp_invariant is not None:
            _check_bool("tp_invariant", self.tp_invariant)
        else:
            self.tp_invariant = size > 1 and self.batch_invariant
        if self.tp_invariant and not self.batch_invariant:
            raise ValueError(f"tp_invariant=True needs a batch-invariant kernel set, not kernels={self.kernels!r}")
        if size > 1 and self.batch_invariant and not self.tp_invariant:
            raise ValueError(
                f"tensor_parallel_size={size} with the batch-invariant kernel set {self.kernels!r} reduces through "
                "the chunk tree (tp_invariant=True): a plain all-reduce would make results depend on the batch; "
                "use batch_invariant=False for the non-invariant fast mode"
            )
        if self.tp_invariant and CHUNKS % size:
            raise ValueError(
                f"tensor_parallel_size={size}: the chunk tree supports tensor-parallel sizes dividing {CHUNKS} "
                "(1, 2, 4, 8)"
            )
