"""What the server serves: the engine, the server's own tokenizer, the model's names and ``system_fingerprint``.

The fingerprint is a hash of the weights, lockstep's version, the device, the dtype and the kernel set: the key
under which a request's output is reproducible. ``create_state`` loads the model and computes it once at start.
"""

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from lockstep.server.async_engine import AsyncEngine, weights_hash
from lockstep.server.listener import HTTPConfig
from lockstep.server.metrics import Metrics
from lockstep.structured.limits import GrammarLimits


@dataclass
class ServerState:
    """Everything the routes and the middleware read; built once by ``create_state``."""

    engine: AsyncEngine
    tokenizer: object | None  # the server's own instance: the engine thread uses the engine's
    model_name: str
    model_path: str
    fingerprint: str
    fingerprint_parts: dict
    http: HTTPConfig = field(default_factory=HTTPConfig)
    # Chat: tool_choice "auto" needs both (vLLM's --enable-auto-tool-choice and --tool-call-parser); with a
    # reasoning parser, replies split <think> off into reasoning_content.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # vLLM's --return-tokens-as-token-ids: logprobs name every token "token_id:N" (as a request can ask)
    return_tokens_as_token_ids: bool = False
    # vLLM's --enable-prompt-tokens-details (usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix
    # cache held) and --enable-force-include-usage (a stream's usage chunk even without stream_options)
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    enable_tokenizer_info_endpoint: bool = False  # vLLM's: GET /tokenizer_info (it shows the chat template)
    # vLLM's --enable-server-load-tracking: GET /load says how many generation calls are in flight (else 0)
    enable_server_load_tracking: bool = False
    server_load: int = 0
    # vLLM's --enable-per-request-metrics: a one-choice reply's timings in its ``metrics`` (else null)
    enable_per_request_metrics: bool = False
    # vLLM's development endpoints (VLLM_SERVER_DEV_MODE): weight transfer, prefix-cache reset, sleep (rl_api)
    dev_mode: bool = False

    @property
    def metrics(self) -> Metrics:
        return self.engine.metrics

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @cached_property
    def workers(self) -> ThreadPoolExecutor:
        """The threads that parse bodies, tokenize, apply chat templates and render replies: off the event loop."""
        return ThreadPoolExecutor(self.http.workers, thread_name_prefix="lockstep-http")

    @cached_property
    def max_prompt_chars(self) -> int | None:
        """A text longer than this has more tokens than the context holds: ``max_model_len`` times the longest
        token's characters (special tokens included). Byte-level BPE and SentencePiece with byte fallback never
        make a token from more characters than its stored form has. Checked before tokenizing, so a huge prompt
        costs a ``len``. None without a tokenizer."""
        if self.tokenizer is None:
            return None
        tokens = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        return self.max_model_len * max(len(t) for t in tokens if t)


def make_fingerprint(parts: dict) -> str:
    blob = json.dumps(parts, sort_keys=True).encode()
    return "fp_" + hashlib.blake2b(blob, digest_size=8).hexdigest()


def create_state(
    model: str | None,
    *,
    http: HTTPConfig | None = None,
    served_model_name: str | None = None,
    chat: dict | None = None,
    grammar_limits: GrammarLimits | None = None,
    **engine_kwargs,
) -> ServerState:
    """Load ``model`` (default: the embedded SmolLM2) into an engine thread and fingerprint what it serves;
    ``http`` is how the HTTP layer admits requests, ``chat`` the ``ServerState`` tool, reasoning and logprobs
    settings (``enable_auto_tool_choice``, ``tool_call_parser``, ``reasoning_parser``,
    ``return_tokens_as_token_ids``), ``grammar_limits`` bound the
    structured-output constraints and their cache, ``engine_kwargs`` are ``EngineConfig`` fields."""
    import torch

    import lockstep
    from lockstep.config import EngineConfig
    from lockstep.engine.llm_engine import LLMEngine
    from lockstep.models.loader import load_tokenizer

    if model is None:
        from lockstep.models.embedded import default_model_path

        model = str(default_model_path())
        name = served_model_name or "SmolLM2-135M-Instruct"
    else:
        name = served_model_name or Path(model).resolve().name
    config = EngineConfig(model=model, **engine_kwargs)
    engine = LLMEngine(config)
    if grammar_limits is not None:
        engine.grammar_limits = grammar_limits
    dev = engine.runner.device
    device_name = f"cuda:{torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else "cpu"
    parts = {
        # dummy weights are drawn from config.json's shape: nothing on disk to hash, the identity says so
        "weights_blake2b": "dummy" if config.load_format == "dummy" else weights_hash(model),
        "lockstep": lockstep.__version__,
        "device": device_name,
        "dtype": str(engine.runner.model.dtype).removeprefix("torch."),
        "kernels": engine.runner.model.kernels.name,
    }
    if engine.config.tp_invariant:  # other numerics than one process's default, the same at every TP size
        parts["reduction"] = "tp-chunk-tree"
    tokenizer = load_tokenizer(model) if engine.tokenizer is not None else None
    async_engine = AsyncEngine(engine)
    async_engine.metrics.info = {k: v for k, v in parts.items() if k != "weights_blake2b"}
    async_engine.metrics.model_name = name
    fingerprint = make_fingerprint(parts)
    return ServerState(async_engine, tokenizer, name, model, fingerprint, parts, http or HTTPConfig(), **(chat or {}))
