"""The ``lockstep`` command: ``generate`` prints a completion, ``serve`` runs the OpenAI-compatible server,
``audit`` measures how deterministic an endpoint is, ``bench latency`` / ``bench throughput`` measure speed. Each
subcommand is one ``add_<name>_parser`` +
``run_<name>`` pair registered in ``build_parser``."""

import argparse
import sys
from collections.abc import Sequence


def add_kernel_args(p: argparse.ArgumentParser) -> None:
    """The options that pick the kernels and where they run, shared by generate, serve and bench."""
    p.add_argument("--no-batch-invariant", action="store_true", help="torch's default kernels (not invariant)")
    p.add_argument("--kernels", default=None, help="a registered kernel set by name (invariant, default, torch-linear)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (on CUDA, decode replays graphs)")
    p.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="schedule and launch each step before reading the previous one's tokens back (same bits; default: on "
        "with CUDA)",
    )  # fmt: skip
    p.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
        help="shard the model over N processes (one GPU each; gloo processes on the CPU); same bits at every N",
    )  # fmt: skip
    p.add_argument(
        "--tp-invariant", action="store_true",
        help="the chunk-tree reduction at --tensor-parallel-size 1 too: the bits every TP size gives",
    )  # fmt: skip
    p.add_argument(
        "--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
        help="dummy: random weights of config.json's shape, no checkpoint read (benchmarks)",
    )  # fmt: skip
    p.add_argument(
        "--quantization", "-q", default=None, choices=["fp8"],
        help="fp8: quantize a full-precision checkpoint's linear layers to e4m3 when loading (FP8 checkpoints are "
        "read as FP8 without it)",
    )  # fmt: skip
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
        help="fp8: keep the KV cache in e4m3 (half the memory of bf16)",
    )  # fmt: skip
    p.add_argument(
        "--speculative-config", type=_json_object, default=None, metavar="JSON",
        help='speculative decoding, vLLM\'s dict: \'{"method": "ngram", "num_speculative_tokens": 3}\' or '
        '\'{"model": PATH, "num_speculative_tokens": 3}\' (a draft model) or \'{"method": "eagle3", "model": PATH, '
        '"num_speculative_tokens": 3}\' (an EAGLE-3 head, also in vLLM\'s speculators format); the same bits as '
        'without, only faster or slower',
    )  # fmt: skip


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def kernel_args(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields ``add_kernel_args`` parsed."""
    invariant = False if args.no_batch_invariant else None  # None: whatever --kernels is (default "invariant")
    return {"kernels": args.kernels, "batch_invariant": invariant, "device": args.device, "dtype": args.dtype,
            "enforce_eager": args.enforce_eager, "async_scheduling": args.async_scheduling,
            "tensor_parallel_size": args.tensor_parallel_size,
            "tp_invariant": True if args.tp_invariant else None, "load_format": args.load_format,
            "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
            "speculative_config": args.speculative_config}  # fmt: skip


def add_revision_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", default=None, help="a branch, tag or commit of a Hugging Face model id (default main)")


def add_generation_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|FOLDER",
        help="sampling defaults for requests that leave them out: 'auto' reads the model folder's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), a FOLDER "
        "another one's, 'vllm' none (OpenAI's defaults)",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's batch and cache sizes, shared by serve and bench (``engine_args`` reads them back)."""
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="tokens per step (default: 256 on CPU, 8192 on CUDA)"
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (default: from memory)")


def engine_args(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields ``add_engine_args`` parsed."""
    names = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks")
    return {name: getattr(args, name) for name in names}


def add_multimodal_args(p: argparse.ArgumentParser) -> None:
    """serve's options for vision-language models (vLLM's names)."""
    p.add_argument(
        "--limit-mm-per-prompt", default=None, metavar="JSON",
        help='the most images one prompt may hold, e.g. \'{"image": 4}\' (default: no limit)',
    )  # fmt: skip
    p.add_argument(
        "--mm-processor-kwargs", default=None, metavar="JSON",
        help='the image processor\'s min_pixels / max_pixels, e.g. \'{"max_pixels": 1003520}\'',
    )  # fmt: skip
    p.add_argument(
        "--allowed-local-media-path", default=None, metavar="FOLDER",
        help="image_url parts may name file:// images under this folder (default: no local files)",
    )  # fmt: skip
    p.add_argument(
        "--allowed-media-domains", default=None, metavar="HOSTS",
        help="comma-separated hosts that http(s) image URLs may be fetched from (default: none; nothing is fetched)",
    )  # fmt: skip
    p.add_argument(
        "--max-num-encoder-tokens-per-step", type=int, default=None,
        help="image tokens the vision encoder takes per step (default: --max-num-batched-tokens)",
    )  # fmt: skip
    p.add_argument("--max-image-pixels", type=int, default=None, help="larger images are refused before decoding")


def multimodal_args(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields ``add_multimodal_args`` parsed (those given)."""
    import json

    out: dict = {}
    for name in ("limit_mm_per_prompt", "mm_processor_kwargs"):
        value = getattr(args, name)
        if value is not None:
            try:
                out[name] = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--{name.replace('_', '-')} must be a JSON object: {e}") from None
    if args.allowed_local_media_path is not None:
        out["allowed_local_media_path"] = args.allowed_local_media_path
    if args.allowed_media_domains is not None:
        out["allowed_media_domains"] = [d.strip() for d in args.allowed_media_domains.split(",") if d.strip()]
    for name in ("max_num_encoder_tokens_per_step", "max_image_pixels"):
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    return out


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate one completion and print it",
        description="Generate a completion. Instruct models (a tokenizer with a chat template) get the prompt as "
        "a user message by default; --raw continues the text as it is.",
    )
    p.add_argument("prompt", help="the prompt text")
    p.add_argument(
        "--model", default=None, help="checkpoint folder or Hugging Face model id (default: embedded SmolLM2-135M)"
    )
    add_revision_arg(p)
    p.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    p.add_argument("--system", default=None, help="a system message (chat mode only)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="noise seed for temperature > 0 (default: drawn, printed)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--logprobs", action="store_true", help="print each token with its logprob")
    add_kernel_args(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from lockstep.llm import LLM
    from lockstep.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    with LLM(args.model, revision=args.revision, **kernel_args(args)) as llm:  # leaving it stops TP workers
        return _generate(llm, args, params)


def _generate(llm, args: argparse.Namespace, params) -> int:
    tokenizer = llm.tokenizer
    chat = not args.raw and tokenizer is not None and bool(tokenizer.chat_template)
    if chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        [out] = llm.chat(messages, params, use_tqdm=False)
    else:
        [out] = llm.generate(args.prompt, params, use_tqdm=False)
    if args.logprobs:
        for token_id, logprob in zip(out.token_ids, out.token_logprobs, strict=True):
            piece = tokenizer.decode([token_id]) if tokenizer is not None else ""
            print(f"{token_id:>8d} {logprob:12.6f} {piece!r}")
        print()
    print(out.text)
    if out.seed is not None and args.seed is None:
        print(f"(seed {out.seed})", file=sys.stderr)
    return 0


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the OpenAI API (completions, chat completions) over HTTP",
        description="An OpenAI-compatible server whose answers do not depend on how requests are batched.",
    )
    p.add_argument(
        "model", nargs="?", default=None, help="checkpoint folder or Hugging Face model id (default: embedded SmolLM2)"
    )
    add_revision_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    p.add_argument("--port", type=int, default=8000)
    key_help = "require 'Authorization: Bearer KEY' on every path but /health (shows in ps; default $LOCKSTEP_API_KEY)"
    p.add_argument("--api-key", default=None, help=key_help)
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="the API key: this file's first line")
    p.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: the model id or folder name)"
    )
    add_kernel_args(p)
    add_engine_args(p)
    add_multimodal_args(p)
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    hosts_help = "Host names to accept, comma-separated, '*' for any (default: loopback names on a loopback --host)"
    p.add_argument("--allowed-hosts", default=None, help=hosts_help)
    p.add_argument(
        "--max-connections", type=int, default=1024,
        help="connections served at once, counted when accepted; past this they get 503, but /health (default 1024)",
    )  # fmt: skip
    p.add_argument(
        "--max-connections-per-client", type=int, default=None, metavar="N",
        help="connections one peer address may hold; past this its new ones get 503, but /health (default: half of "
        "--max-connections; behind a reverse proxy every client has the proxy's address)",
    )  # fmt: skip
    p.add_argument("--header-timeout", type=float, default=10.0, help="seconds for a request's line and headers")
    p.add_argument("--body-timeout", type=float, default=60.0, help="seconds for a request's whole body (408)")
    p.add_argument(
        "--body-idle-timeout", type=float, default=10.0, help="seconds a request's body may send nothing (408)"
    )
    add_limit_args(p)
    add_grammar_limit_args(p)
    add_chat_args(p)
    add_vllm_serve_args(p)
    add_generation_config_arg(p)
    add_rl_args(p)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--no-access-log",
        "--disable-log-requests",
        dest="access_log",
        action="store_false",
        help="no log line per request (method, path, status, time, tokens; never prompts), which is on by default",
    )
    p.set_defaults(func=run_serve)


def add_rl_args(p: argparse.ArgumentParser) -> None:
    """serve's options for RL trainers (README, "TRL"): vLLM's development endpoints and sleep mode."""
    p.add_argument(
        "--dev-mode", action="store_true",
        help="serve vLLM's development endpoints (also with VLLM_SERVER_DEV_MODE=1): weight updates from a trainer "
        "(/init_weight_transfer_engine, /update_weights), /reset_prefix_cache, /sleep, /wake_up, /is_sleeping; "
        "anyone who can reach them can replace the weights: guard them with --api-key",
    )  # fmt: skip
    p.add_argument(
        "--enable-sleep-mode", action="store_true",
        help="allow /sleep (needs --dev-mode): free the KV cache and the weights for a trainer on the same GPU",
    )  # fmt: skip


def dev_mode(args: argparse.Namespace) -> bool:
    import os

    return bool(args.dev_mode or os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0"))


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """vLLM's tool-calling and reasoning options of serve."""
    from lockstep.structured.tools import REASONING_PARSERS, TOOL_PARSERS

    p.add_argument(
        "--enable-auto-tool-choice", action="store_true", help='allow tool_choice "auto" (needs --tool-call-parser)'
    )
    p.add_argument(
        "--tool-call-parser", default=None, choices=TOOL_PARSERS, help="how tool calls are found in chat replies"
    )
    p.add_argument(
        "--reasoning-parser", default=None, choices=REASONING_PARSERS, help="split <think> into reasoning_content"
    )
    p.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='name the tokens of logprobs "token_id:N" (vLLM\'s; a request can ask with return_tokens_as_token_ids)',
    )


def add_vllm_serve_args(p: argparse.ArgumentParser) -> None:
    """vLLM's serve options for what replies hold and where the server lives (``vllm_serve_args`` reads them)."""
    p.add_argument(
        "--max-logprobs", type=int, default=20,
        help="the most logprobs a request may ask for per token (logprobs, top_logprobs, prompt_logprobs; a "
        "request's -1 asks for the whole vocabulary); -1: no cap (default 20, vLLM's)",
    )  # fmt: skip
    p.add_argument(
        "--root-path", default="", help="also serve every path under this prefix (e.g. /llm: a reverse proxy's)"
    )
    p.add_argument(
        "--enable-prompt-tokens-details", action="store_true",
        help="usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache held (else null)",
    )  # fmt: skip
    p.add_argument(
        "--enable-force-include-usage", action="store_true",
        help="a stream's usage chunk even when stream_options does not ask for it",
    )  # fmt: skip
    p.add_argument(
        "--enable-tokenizer-info-endpoint", action="store_true",
        help="GET /tokenizer_info: the tokenizer's settings and chat template",
    )  # fmt: skip
    p.add_argument(
        "--enable-server-load-tracking", action="store_true",
        help="GET /load: the generation calls in flight (else it answers 0)",
    )  # fmt: skip
    p.add_argument(
        "--enable-per-request-metrics", action="store_true",
        help="a one-choice reply's timings (queue, first token, decode, tokens/s) in its metrics field (else null)",
    )  # fmt: skip


def vllm_serve_args(args: argparse.Namespace) -> tuple[dict, dict]:
    """``add_vllm_serve_args``' options: the ``ServerState`` settings and the ``EngineConfig`` fields."""
    state = {
        "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
        "enable_force_include_usage": args.enable_force_include_usage,
        "enable_tokenizer_info_endpoint": args.enable_tokenizer_info_endpoint,
        "enable_server_load_tracking": args.enable_server_load_tracking,
        "enable_per_request_metrics": args.enable_per_request_metrics,
    }
    return state, {"max_logprobs": args.max_logprobs}


def chat_args(args: argparse.Namespace) -> dict:
    """``ServerState``'s tool, reasoning and logprobs settings; --enable-auto-tool-choice without a parser is an
    error."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    return {
        "enable_auto_tool_choice": args.enable_auto_tool_choice,
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
        "return_tokens_as_token_ids": args.return_tokens_as_token_ids,
    }


def http_config(args: argparse.Namespace):
    """The serve options of the HTTP layer as an ``HTTPConfig``."""
    from lockstep.server.listener import HTTPConfig, allowed_hosts_for, read_api_key

    return HTTPConfig(
        api_key=read_api_key(args.api_key, args.api_key_file),
        allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts),
        max_body_bytes=args.max_body_bytes,
        max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        body_idle_timeout=args.body_idle_timeout,
        access_log=args.access_log,
        root_path=args.root_path,
    )


_LIMITS = {  # serve's load limits: option -> (type, help); the defaults are ServingLimits'
    "--max-queued-seqs": (int, "sequences waiting for admission before new requests get 429 (default 1024)"),
    "--max-queued-tokens": (int, "their prompt tokens, the same (default 1048576)"),
    "--max-seqs-per-request": (int, "sequences (n x prompts) one request may ask for (default 256, or fewer queued)"),
    "--request-timeout": (float, "seconds a request may take; 0: no limit (default 600)"),
    "--unread-timeout": (float, "seconds a response may go unread before its request is stopped (default 30)"),
}


def add_limit_args(p: argparse.ArgumentParser) -> None:
    for option, (kind, text) in _LIMITS.items():
        p.add_argument(option, type=kind, default=None, help=text)
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds requests in flight may take to finish before they get 503; the server answers "
        "503 meanwhile and exits 0 once they are done (default 30)",
    )


def limit_args(args: argparse.Namespace) -> dict:
    """The ``ServingLimits`` fields ``add_limit_args`` parsed (those given)."""
    limits = {}
    for option in _LIMITS:
        name = option[2:].replace("-", "_")
        value = getattr(args, name)
        if value is not None:
            limits[name] = None if name == "request_timeout" and value == 0 else value
    return limits


def add_grammar_limit_args(p: argparse.ArgumentParser) -> None:
    """How large a structured-output constraint may be, and how much memory compiled ones may keep."""
    p.add_argument(
        "--max-structured-output-bytes",
        type=int,
        default=256 << 10,
        help="a JSON schema, regex, grammar or choice list longer than this (bytes) gets 400 (default 262144)",
    )
    p.add_argument(
        "--max-structured-output-choices",
        type=int,
        default=4096,
        help="a guided_choice / structured_outputs.choice of more strings gets 400 (default 4096)",
    )
    p.add_argument(
        "--structured-output-cache-bytes",
        type=int,
        default=256 << 20,
        help="memory the compiled-constraint cache may hold, in bytes (least recently used out; default 256 MiB)",
    )


def grammar_limits(args: argparse.Namespace):
    """The structured-output options as ``GrammarLimits``."""
    from lockstep.structured.limits import GrammarLimits

    return GrammarLimits(
        max_bytes=args.max_structured_output_bytes,
        max_choices=args.max_structured_output_choices,
        cache_bytes=args.structured_output_cache_bytes,
    )


def run_serve(args: argparse.Namespace) -> int:
    from lockstep.config import check_device
    from lockstep.models.hub import resolve_model
    from lockstep.server.async_engine import ServingLimits
    from lockstep.server.listener import bind_socket
    from lockstep.server.openai_api import serve
    from lockstep.server.state import create_state

    # Bad options, a device torch cannot use and a port in use fail at once, in one line, before the model loads.
    http = http_config(args)
    limits = ServingLimits(**limit_args(args))
    grammars = grammar_limits(args)
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    vllm_state, vllm_engine = vllm_serve_args(args)
    chat = chat_args(args) | vllm_state
    multimodal = multimodal_args(args)
    if args.model is None and args.revision is not None:
        raise ValueError("--revision needs a Hugging Face model id")
    check_device(args.device)
    sock = bind_socket(args.host, args.port)
    try:
        # The server fingerprints the folder's weights: resolve a model id here, and serve it under its id (vLLM's).
        folder = None if args.model is None else resolve_model(args.model, args.revision)
        name = args.served_model_name or (args.model if folder != args.model else None)
        state = create_state(
            folder,
            http=http,
            served_model_name=name,
            generation_config=args.generation_config,
            chat=chat,
            grammar_limits=grammars,
            enable_sleep_mode=args.enable_sleep_mode,
            **kernel_args(args),
            **engine_args(args),
            **multimodal,
            **vllm_engine,
        )
        state.dev_mode = dev_mode(args)
        port = sock.getsockname()[1]  # --port 0: the one the system chose
        print(
            f"lockstep: serving {state.model_name!r} on http://{args.host}:{port}/v1 "
            f"(system_fingerprint {state.fingerprint})",
            file=sys.stderr,
            flush=True,
        )
        state.engine.limits = limits
        return serve(state, args.host, port, args.log_level, shutdown_timeout=args.shutdown_timeout, sock=sock)
    finally:
        sock.close()


def add_audit_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "audit",
        help="measure how deterministic an OpenAI-compatible endpoint is",
        description="Send one request N times at each concurrency level to any OpenAI-compatible endpoint "
        "(lockstep, vLLM, SGLang, a hosted API) and report how many different completions come back, where they "
        "first split, and how their logprobs differ. --local runs the experiment in-process, invariance on vs off.",
    )
    p.add_argument("base_url", nargs="?", default=None, help="e.g. http://127.0.0.1:8000/v1 (omit with --local)")
    p.add_argument("--local", action="store_true", help="in-process on --model or the embedded model, on vs off")
    p.add_argument("--model", default=None, help="model id (remote: default the first of /v1/models) or folder")
    p.add_argument("--prompt", default=None, help="the request's prompt (or user message with --chat)")
    p.add_argument("-n", type=int, default=None, help="requests per concurrency level (default 1000; --local 32)")
    p.add_argument(
        "--concurrency",
        default=None,
        help="comma list (default 1,8,64,256; --local 1,8,32); LEVEL:N sends N requests at that level instead of -n",
    )
    p.add_argument("--chat", action="store_true", help="chat completions instead of completions")
    p.add_argument(
        "--image", default=None, metavar="FILE",
        help="send this image with every target (a vision-language model; implies --chat); every other filler "
        "request gets an image of its own",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=None, help="default 64 (--local 32)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--filler", type=int, default=0, help="other requests mixed into each level's load")
    p.add_argument("--no-logprobs", action="store_true", help="do not ask for logprobs (for endpoints without)")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--device", default=None, help="--local only: cpu, cuda or cuda:N")
    p.add_argument("--out", default="lockstep-audit", help="folder for report.json and distinct_prefixes.png")
    p.add_argument("--expect-deterministic", action="store_true", help="exit 1 when more than one completion appears")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_audit)


def run_audit(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import os
    from pathlib import Path

    from lockstep.audit.report import plot, summary_lines
    from lockstep.audit.runner import DEFAULT_PROMPT, AuditConfig, audit_endpoint, audit_local

    if args.local == (args.base_url is not None):
        raise ValueError("give either BASE_URL or --local")
    levels = args.concurrency or ("1,8,32" if args.local else "1,8,64,256")
    try:
        pairs = [(int(x.split(":")[0]), int(x.split(":")[1]) if ":" in x else None) for x in levels.split(",")]
    except ValueError:
        raise ValueError(f"--concurrency must be a comma list of LEVEL or LEVEL:N, got {levels!r}") from None
    concurrency = tuple(level for level, _ in pairs)
    level_n = {level: n for level, n in pairs if n is not None}
    cfg = AuditConfig(
        prompt=args.prompt or DEFAULT_PROMPT,
        n=args.n or (32 if args.local else 1000),
        concurrency=concurrency,
        chat=args.chat,
        max_tokens=args.max_tokens or (32 if args.local else 64),
        temperature=args.temperature,
        seed=args.seed,
        filler=args.filler,
        logprobs=not args.no_logprobs,
        level_n=level_n,
        image=args.image,
    )
    if args.local:
        report = audit_local(args.model, cfg, device=args.device, progress=not args.quiet)
        panels = {mode: r["levels"] for mode, r in report["modes"].items()}
        overall = {mode: r["overall"] for mode, r in report["modes"].items()}
    else:
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
        report = asyncio.run(audit_endpoint(args.base_url, args.model, cfg, api_key, progress=not args.quiet))
        panels = {f"{report['model']} @ {args.base_url}": report["levels"]}
        overall = {"all levels": report["overall"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(panels, str(out / "distinct_prefixes.png"))
    for title, levels_ in panels.items():
        print(title)
        for level, rep in levels_.items():
            print("\n".join(summary_lines(f"  concurrency {level}", rep)))
        print("\n".join(summary_lines("  overall", overall.get(title, overall.get("all levels")))))
    print(f"report: {out / 'report.json'}, plot: {out / 'distinct_prefixes.png'}")
    failed = [title for title, o in overall.items() if o.get("requests") and o.get("errors") == o.get("requests")]
    if failed:
        examples = next(iter(overall.values())).get("error_examples") or [{"error": "?"}]
        print(
            f"lockstep: audit: no completion came back ({', '.join(failed)}); first error: {examples[0]['error']}",
            file=sys.stderr,
        )
        return 1
    if args.expect_deterministic:
        checked = overall.get("invariant", overall.get("all levels"))
        if checked.get("unique_completions", 0) != 1 or checked.get("errors", 0):
            print("lockstep: audit: not deterministic (expected exactly one completion, no errors)", file=sys.stderr)
            return 1
    return 0


def _int_at_least(least: int):
    """An argparse type: an int >= ``least``, else a usage error naming the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}")
        return value

    return parse


_BENCH_SIZES = {  # option: (least value, help)
    "--input-len": (1, "prompt tokens per request"),
    "--output-len": (1, "generated tokens per request"),
    "--batch-size": (1, "requests per run"),
    "--num-prompts": (1, "requests submitted at once"),
    "--num-iters-warmup": (0, "untimed runs first"),
    "--num-iters": (1, "timed runs"),
}


def add_bench_args(p: argparse.ArgumentParser, sizes: dict[str, tuple[int, int]]) -> None:
    """A benchmark's options: the model, ``sizes`` (options of ``_BENCH_SIZES`` and their defaults on CUDA and on
    the CPU), sampling, the report, and the kernel and engine options of generate and serve."""
    p.add_argument("--model", default=None, help="checkpoint folder (default: embedded SmolLM2-135M)")
    for option, (gpu, cpu) in sizes.items():
        least, text = _BENCH_SIZES[option]
        p.add_argument(option, type=_int_at_least(least), default=None, help=f"{text} (default {gpu}; {cpu} on a CPU)")
    p.set_defaults(bench_sizes=sizes)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="draws the prompts and the requests' sampling seeds (default 0)")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write every figure and the setup here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_kernel_args(p)
    add_engine_args(p)
    p.set_defaults(func=run_bench)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure latency or throughput on random prompts",
        description="Measure lockstep on your hardware, like vllm bench: random token-id prompts (seeded, special "
        "tokens left out), each generating exactly --output-len tokens (EOS ignored).",
    )
    kinds = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    latency = kinds.add_parser(
        "latency",
        help="end-to-end time of one batch of requests",
        description="Run one batch of --batch-size requests end to end --num-iters times after --num-iters-warmup "
        "untimed runs; report the time per run (mean, p50, p90, p99), time to first token (TTFT) and inter-token "
        "latency (ITL).",
    )
    # CUDA defaults are vLLM's; a CPU runs sizes that finish in minutes (1000 x 1024/128 took over an hour on 2 cores).
    sizes = {"--input-len": (32, 32), "--output-len": (128, 32), "--batch-size": (8, 8), "--num-iters-warmup": (10, 1),
             "--num-iters": (30, 5)}  # fmt: skip
    add_bench_args(latency, sizes)
    throughput = kinds.add_parser(
        "throughput",
        help="requests and tokens per second for many requests at once",
        description="Submit --num-prompts requests at once and step them to completion; report requests/s, total "
        "and output tokens/s, time to first token (TTFT) and inter-token latency (ITL). Warm-up runs send the same "
        "requests cut to 4 output tokens, to compile the kernels.",
    )
    sizes = {"--input-len": (1024, 128), "--output-len": (128, 32), "--num-prompts": (1000, 32),
             "--num-iters-warmup": (1, 1)}  # fmt: skip
    add_bench_args(throughput, sizes)


def run_bench(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from lockstep.benchmark import BenchConfig, run_benchmark, summary_lines
    from lockstep.llm import LLM

    latency = args.bench == "latency"
    llm = LLM(
        args.model,
        seed=args.seed,
        **kernel_args(args),
        **engine_args(args),
    )
    on_cpu = llm.engine.runner.device.type == "cpu"
    for option, defaults in args.bench_sizes.items():  # the sizes left unset: the device's defaults
        name = option.removeprefix("--").replace("-", "_")
        if getattr(args, name) is None:
            setattr(args, name, defaults[on_cpu])
    cfg = BenchConfig(
        kind=args.bench,
        num_requests=args.batch_size if latency else args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        num_iters=args.num_iters if latency else 1,
        num_iters_warmup=args.num_iters_warmup,
        temperature=args.temperature,
        seed=args.seed,
    )
    report = run_benchmark(llm, cfg, progress=not args.quiet)
    print("\n".join(summary_lines(report)))
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lockstep", description="LLM inference whose answers do not depend on how requests are batched."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_parser(subparsers)
    add_serve_parser(subparsers)
    add_audit_parser(subparsers)
    add_bench_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ConnectionError) as e:  # one line, no traceback: the user's to fix
        print(f"lockstep: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
