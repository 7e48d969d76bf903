"""vLLM's ``LLM(...)`` and ``EngineArgs`` arguments, as ``lockstep.LLM`` takes them.

Each argument a vLLM script passes is, here, one of:

- an ``EngineConfig`` field of the same name and meaning (``max_model_len``, ``max_logprobs``,
  ``skip_tokenizer_init``, ...), or of another name (``RENAMED``: ``num_gpu_blocks_override`` is ``num_kv_blocks``);
- ``IGNORED``: accepted with any value and dropped, because it cannot change what lockstep computes (each entry
  says why);
- ``NEUTRAL``: accepted only at the values that change nothing (vLLM's defaults); any other value is a ValueError
  naming the argument, rather than a run that silently did something else.

Anything else is a TypeError listing what ``LLM`` takes.
"""

from typing import Any

IGNORED: dict[str, str] = {
    "disable_log_stats": "lockstep keeps no periodic stats log",
    "disable_custom_all_reduce": "no custom all-reduce kernel: sums are torch.distributed's or the chunk tree's",
    "swap_space": "a preempted sequence is recomputed, never swapped out (vLLM ignores it too)",
    "enable_chunked_prefill": "prefills are always chunked by the step's token budget, which cannot change the bits",
    "attention_config": "the kernel set (batch_invariant, kernels) decides the attention kernel",
    "kernel_config": "the kernel set (batch_invariant, kernels) decides every kernel",
    "compilation_config": "nothing is torch.compiled; decode CUDA graphs follow enforce_eager",
    "max_seq_len_to_capture": "decode CUDA graphs are captured per batch size, for every length",
    "cuda_graph_sizes": "decode CUDA graphs are captured per batch-size bucket up to max_num_seqs",
    "disable_cascade_attn": "there is no cascade attention",
    "disable_async_output_proc": "outputs are built as steps end",
    "trust_remote_code": "lockstep runs its own code for the architectures it supports; none from the checkpoint",
    "served_model_name": "the offline API has no served name",
}

NEUTRAL: dict[str, tuple] = {
    "enable_mm_embeds": (False,),  # precomputed multimodal embeddings
    "tokenizer_mode": ("auto",),
    "tokenizer": (None,),  # or the model's own folder (engine_config_args)
    "tokenizer_revision": (None,),
    "runner": ("auto", "generate"),
    "convert": ("auto", "none"),
    "task": ("auto", "generate"),
    "pooler_config": (None,),
    "hf_overrides": (None, {}),
    "hf_token": (None,),  # lockstep reads the Hugging Face cache; log in with `hf auth login` to download
    "download_dir": (None,),
    "cpu_offload_gb": (0,),
    "offload_group_size": (0,),
    "offload_num_in_group": (1,),
    "offload_prefetch_step": (1,),
    "offload_params": (None, set()),
    "kv_cache_memory_bytes": (None,),  # num_kv_blocks / num_gpu_blocks_override size the cache
    "structured_outputs_config": (None, {}),  # structured outputs always run on llguidance
    "profiler_config": (None,),
    "quantization_config": (None,),
    "logits_processors": (None, []),
    "enable_return_routed_experts": (False,),
    "pipeline_parallel_size": (1,),
    "data_parallel_size": (1,),
    "distributed_executor_backend": (None, "mp", "uni"),  # lockstep starts its own processes
    "enable_lora": (False,),
    "logprobs_mode": ("raw_logprobs",),  # lockstep's logprobs are the raw distribution's
    "enable_prompt_embeds": (False,),
    "override_generation_config": (None, {}),
    "scheduling_policy": ("fcfs",),  # no priority scheduling (outputs never depend on the order anyway)
}

RENAMED: dict[str, str] = {"num_gpu_blocks_override": "num_kv_blocks"}


def _same(a: object, b: object) -> bool:
    return type(a) is type(b) and a == b or a is None and b is None


def engine_config_args(model: str | None, args: dict[str, Any], fields: set[str]) -> dict[str, Any]:
    """``args`` (``LLM``'s keywords) as ``EngineConfig`` keywords: ``IGNORED`` ones dropped, ``NEUTRAL`` ones
    checked and dropped, ``RENAMED`` ones renamed; ValueError for a value lockstep cannot honour, TypeError for an
    unknown name (``fields``: EngineConfig's)."""
    out: dict[str, Any] = {}
    for name, value in args.items():
        if name in fields:
            out[name] = value
        elif name in RENAMED:
            if RENAMED[name] in args:
                raise ValueError(f"LLM() got both {name} and {RENAMED[name]}, which is the same setting")
            out[RENAMED[name]] = value
        elif name in IGNORED:
            continue
        elif name in NEUTRAL:
            own_tokenizer = name == "tokenizer" and model is not None and str(value) == str(model)
            if not own_tokenizer and not any(_same(value, v) for v in NEUTRAL[name]):
                allowed = " or ".join(repr(v) for v in NEUTRAL[name])
                raise ValueError(f"LLM({name}={value!r:.100}) is not supported: lockstep takes only {allowed} there")
        else:
            known = sorted(fields | set(RENAMED) | set(IGNORED) | set(NEUTRAL))
            raise TypeError(f"LLM() got an unknown argument {name!r}; it takes {', '.join(known)}")
    if out.get("allowed_local_media_path") == "":  # vLLM's default: no local files
        out["allowed_local_media_path"] = None
    return out
