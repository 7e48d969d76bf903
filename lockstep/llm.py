"""The offline API, shaped like vLLM's: ``LLM(model).generate(prompts, sampling_params)``."""

import dataclasses
import os
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

from lockstep.config import EngineConfig
from lockstep.engine.llm_engine import LLMEngine
from lockstep.engine.multimodal import MultimodalInputs
from lockstep.outputs import CompletionOutput, OutputKind, RequestOutput
from lockstep.sampling_params import BeamSearchParams, SamplingParams
from lockstep.vllm_args import engine_config_args

__all__ = ["LLM", "CompletionOutput", "RequestOutput"]

# dict: vLLM's {"prompt": text} or {"prompt_token_ids": ids}, with "multi_modal_data" ({"image": images}) and
# "mm_processor_kwargs" for a vision-language model.
Prompt = str | list[int] | dict
Message = dict[str, Any]  # content: a string, or OpenAI content parts (text, image_url, image)
_Item = tuple[str | None, list[int], MultimodalInputs | None]  # a prompt's text, token ids and images
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}


def _is_token_ids(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _images_of(i: int, mm_data: object) -> list | None:
    """The images of a prompt's ``multi_modal_data`` (``{"image": image or [images]}``), or None."""
    if mm_data is None:
        return None
    if not isinstance(mm_data, dict) or set(mm_data) - {"image"}:
        kinds = sorted(mm_data) if isinstance(mm_data, dict) else type(mm_data).__name__
        raise ValueError(f'prompt {i}: multi_modal_data takes {{"image": image or list of images}}, got {kinds}')
    images = mm_data.get("image")
    if images is None:
        return None
    return (list(images) if isinstance(images, (list, tuple)) else [images]) or None


class LLM:
    """A model and an engine that batches requests without changing their answers.

    ``model`` is a Hugging Face checkpoint folder, a Hugging Face model id such as
    ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` (resolved through the local Hugging Face cache at ``revision=``,
    downloaded first where the network allows: ``models.hub``), or None for the embedded SmolLM2-135M-Instruct.
    Every other keyword is a field of ``EngineConfig`` (``max_num_seqs``, ``max_model_len``, ``dtype``,
    ``device``, ``revision``, ...), as vLLM's ``LLM`` takes its engine arguments. ``batch_invariant=False`` runs
    torch's default kernels instead (faster; results then depend on the batch); ``kernels="name"`` picks any
    registered kernel set.
    ``num_kv_blocks=None`` sizes the KV cache from free memory times ``gpu_memory_utilization`` (CUDA) or a
    fixed budget (CPU). ``seed`` makes the seeds drawn for sampled requests without one reproducible (each
    output reports the seed it used).

    Vision-language models (Qwen3-VL, Qwen2.5-VL) take images: ``generate({"prompt": ..., "multi_modal_data":
    {"image": image_or_images}})`` and ``chat`` with ``image_url`` content parts (data URLs; ``file://`` URLs under
    ``allowed_local_media_path``). ``limit_mm_per_prompt={"image": N}``, ``mm_processor_kwargs={"min_pixels": ...,
    "max_pixels": ...}``, ``max_num_encoder_tokens_per_step`` and ``max_image_pixels`` are engine arguments too.

    ``speculative_config`` is vLLM's dict (``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max":
    ..., "prompt_lookup_min": ...}``, ``{"model": path, "num_speculative_tokens": k}`` for a draft model, or
    ``{"method": "eagle3", "model": path, "num_speculative_tokens": k}`` for an EAGLE-3 head): each
    step checks drafted tokens against what plain decoding samples, so the outputs are plain decoding's, bit for
    bit; only the time changes (README, "Speculative decoding").

    ``tensor_parallel_size=N`` shards the model over N processes (one GPU each, ``cuda:0`` to ``cuda:N-1``; gloo
    processes on the CPU) that this process starts and stops: the token ids and logprobs are the same bits at
    every N (the chunk-tree reduction, ``tp_invariant``; pass ``tp_invariant=True`` at N = 1 for the same
    numerics in one process). ``close()`` (or leaving a ``with LLM(...)`` block) stops the workers; so do garbage
    collection and interpreter exit. A script that builds one must guard its entry point with
    ``if __name__ == "__main__":`` (the workers are spawned, and re-import the main module).
    """

    def __init__(self, model: str | None = None, chat_template: str | None = None, **engine_args: Any) -> None:
        fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        config_args = engine_config_args(model, engine_args, fields)  # vLLM's arguments too (lockstep.vllm_args)
        self.engine = LLMEngine(EngineConfig(model=None if model is None else str(model), **config_args))
        self.chat_template = chat_template  # vLLM's: chat()'s template when a call names none
        self._next_id = 0

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any; the LLM cannot generate afterwards. Idempotent."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass  # at interpreter exit the atexit hook has stopped the workers already

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine, under vLLM's name for it (``llm.llm_engine``)."""
        return self.engine

    def get_tokenizer(self):
        """The Hugging Face tokenizer (None for a folder without one), as vLLM's ``LLM.get_tokenizer``."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The ``SamplingParams`` used when none are given, as vLLM's: SamplingParams' defaults overridden by the
        model's ``generation_config.json`` (its temperature, top_p, top_k, min_p, repetition_penalty and
        max_new_tokens as max_tokens; ``generation_config="vllm"`` ignores the file, a folder reads another's)."""
        return SamplingParams(**self.engine.default_sampling)

    def _prompts(self, prompts: Prompt | list[Prompt]) -> list[_Item]:
        if isinstance(prompts, (str, dict)) or _is_token_ids(prompts) and prompts:
            prompts = [prompts]
        if not isinstance(prompts, SequenceABC):
            raise TypeError(f"prompts must be a prompt or a list of them, got {prompts!r}")
        out: list[_Item] = []
        for i, p in enumerate(prompts):
            mm_data = mm_kwargs = None
            if isinstance(p, dict):  # vLLM's TextPrompt / TokensPrompt
                keys = set(p)
                if keys - _PROMPT_KEYS or len(keys & {"prompt", "prompt_token_ids"}) != 1:
                    raise TypeError(
                        f"prompt {i}: a dict prompt takes 'prompt' or 'prompt_token_ids' (and 'multi_modal_data', "
                        f"'mm_processor_kwargs'), got keys {sorted(keys)}"
                    )
                mm_data, mm_kwargs = p.get("multi_modal_data"), p.get("mm_processor_kwargs")
                p = p["prompt"] if "prompt" in p else p["prompt_token_ids"]
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("this model folder has no tokenizer: pass prompts as token-id lists")
                text, ids = p, list(self.tokenizer.encode(p))
            elif _is_token_ids(p):
                text, ids = None, list(p)
            else:
                raise TypeError(f"prompt {i} must be a string or a list of token ids, got {p!r}")
            out.append(self._with_images(i, text, ids, _images_of(i, mm_data), mm_kwargs))
        return out

    def _with_images(
        self, i: int, text: str | None, ids: list[int], sources: list | None, mm_kwargs: dict | None
    ) -> _Item:
        """A prompt's item, its images loaded and processed (placeholders expanded); ValueError naming prompt ``i``
        for a bad image, an image to a text-only model, or placeholders that do not match the images."""
        if sources is None:
            return text, ids, None
        from lockstep.multimodal.media import load_image

        try:
            if not self.engine.is_multimodal:
                raise ValueError("the model is text-only: it takes no images")
            policy = self.engine.media_policy
            images = [load_image(source, policy) for source in sources]
            ids, mm = self.engine.process_images(ids, images, mm_kwargs)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        return text, ids, mm

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for ``prompts`` (text, token ids, or vLLM's ``{"prompt": ...}`` /
        ``{"prompt_token_ids": ...}`` dicts); outputs come back in input order.

        ``sampling_params`` is one ``SamplingParams`` for all prompts or a list with one per prompt (None:
        ``get_default_sampling_params()``, the model's generation config over SamplingParams' defaults). Every
        request is validated before any runs: a bad one raises ValueError naming it, and nothing is queued. With
        ``n > 1`` each choice runs as a request of its own (``SamplingParams.for_choice``) and the prompt's
        ``RequestOutput`` holds them all in ``outputs``. vLLM's ``priority`` (one per prompt) must be all 0, as under
        vLLM's default first-come-first-served policy (lockstep has no other; the order never changes an output),
        and ``lora_request`` None.
        """
        items = self._prompts(prompts)
        if lora_request is not None:
            raise ValueError("lora_request is not supported: lockstep serves no LoRA adapters (merge them first)")
        if priority is not None and (len(priority) != len(items) or any(p != 0 for p in priority)):
            raise ValueError(
                f"priority must be None or one 0 per prompt ({len(items)}): lockstep schedules first come, first "
                "served (vLLM's scheduling_policy 'fcfs', where a non-zero priority is refused too)"
            )
        return self._generate(items, sampling_params, use_tqdm)

    def beam_search(
        self,
        prompts: Prompt | list[Prompt],
        params: BeamSearchParams,
        lora_request: None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list:
        """vLLM's beam search (``lockstep.beam_search``): a ``BeamSearchOutput`` per prompt, its ``beam_width`` best
        sequences first to last, the same bits in any batch. ``concurrency_limit`` runs that many prompts at a
        time (all by default)."""
        from lockstep.beam_search import beam_search

        if lora_request is not None:
            raise ValueError("lora_request is not supported: lockstep serves no LoRA adapters (merge them first)")
        items = self._prompts(prompts)
        if any(mm is not None for _, _, mm in items):
            raise ValueError("beam search takes text prompts (no images yet)")
        ids = [list(token_ids) for _, token_ids, _ in items]
        step = concurrency_limit or max(1, len(ids))
        return [out for j in range(0, len(ids), step) for out in beam_search(self, ids[j : j + step], params, use_tqdm)]

    def _generate(
        self,
        items: list[_Item],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"{len(params)} sampling params for {len(items)} prompts")
        groups: list[list[str]] = []  # per prompt, the engine request of each of its n choices
        ids: list[str] = []
        try:
            for (text, token_ids, mm), p in zip(items, params, strict=True):
                groups.append([])
                for i in range(p.n):
                    rid = str(self._next_id)
                    self._next_id += 1
                    choice = p.for_choice(i)
                    kind = OutputKind.FINAL_ONLY
                    self.engine.add_request(rid, token_ids, choice, prompt=text, output_kind=kind, mm=mm)
                    groups[-1].append(rid)
                    ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        done = dict(zip(ids, self._run(ids, use_tqdm), strict=True))
        outputs = []
        for group in groups:
            first = done[group[0]]
            choices = [dataclasses.replace(done[rid].outputs[0], index=i) for i, rid in enumerate(group)]
            outputs.append(
                RequestOutput(
                    first.request_id,
                    first.prompt,
                    first.prompt_token_ids,
                    choices,
                    first.prompt_logprobs,
                    num_cached_tokens=first.num_cached_tokens,
                    metrics=first.metrics,
                )
            )
        return outputs

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in ids]

    def load_weights(self, weights) -> list[str]:
        """Replace model weights in place, e.g. after a training step: ``weights`` is a dict or an iterable of
        ``(name, tensor)`` with Hugging Face checkpoint names (``model.layers.0.self_attn.q_proj.weight``, ...),
        any subset of the checkpoint. Clears the prefix cache; afterwards the engine answers exactly like a fresh
        one loaded with those weights. Call it between ``generate`` calls. Returns the names loaded."""
        return self.engine.load_weights(weights)

    # -- RL: weight updates from trainer processes, the prefix cache, sleep mode (README, "TRL") ----------------

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Join a trainer's weight-update group (vLLM's weight-transfer shape): ``init_info`` is ``{"master_address",
        "master_port", "rank_offset", "world_size"}``, the trainer being rank 0 and hosting the rendezvous at
        ``master_address:master_port``, and every sampler rank (each tensor-parallel worker too) joining as
        ``rank_offset + rank``. Blocks until the trainer (``lockstep.rl.weight_sync.WeightSender.connect``) has
        joined: gloo on the CPU, NCCL on CUDA."""
        self.engine.init_weight_transfer_engine(init_info)

    def update_weights(self, update_info: dict) -> list[str]:
        """Receive one weight update the trainer broadcasts in buckets (``WeightSender.send``): ``update_info`` is
        ``{"names", "dtype_names", "shapes", "bucket_bytes"}`` in the trainer's send order
        (``WeightSender.update_info``). The engine then answers exactly as after ``load_weights`` of the same
        tensors (the prefix cache is cleared). Between ``generate`` calls; returns the names loaded."""
        return self.engine.update_weights(update_info)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (weight updates do it themselves); False, doing nothing, while requests run."""
        return self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and, at ``level=2``, the weights, so a trainer can use the memory (needs
        ``enable_sleep_mode=True``). Level 1 offloads the weights to host memory; after level 2 load every weight
        (``load_weights``, ``update_weights``) before ``wake_up``. ``generate`` raises while asleep."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Allocate the KV cache and the weights again (``tags``: ``["weights"]`` or ``["kv_cache"]`` for one of
        them); afterwards the outputs are the bits they were before sleeping."""
        self.engine.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or a list of them,
        rendered with the chat template (``chat_template``, else the ``LLM``'s, else the tokenizer's) and the
        generation prompt added (``add_generation_prompt=False``: not; ``continue_final_message=True``: the reply
        continues the final message, as vLLM's). ``tools`` (OpenAI function
        definitions) and ``chat_template_kwargs`` go to the template, as in vLLM's ``LLM.chat``. A message's content
        may be OpenAI content parts: text, and for a vision-language model ``image_url`` parts (a data URL, or a
        ``file://`` URL under ``allowed_local_media_path``) or ``{"type": "image", "image": PIL.Image}``."""
        from lockstep.multimodal.chat import has_images, split_content

        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model folder has no tokenizer")
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
        extra = dict(chat_template_kwargs or {}) | ({"tools": tools} if tools else {})
        extra |= {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        items = []
        for i, conv in enumerate(messages):
            if not isinstance(conv, list) or not all(isinstance(m, dict) for m in conv):
                raise TypeError(f"a conversation must be a list of message dicts, got {conv!r}")
            rendered, sources = [], []
            for m in conv:
                if has_images(m.get("content")):
                    content, found = split_content(m["content"])
                    m = {**m, "content": content}
                    sources += found
                rendered.append(m)
            text = self.apply_chat_template(rendered, chat_template, **extra)
            # The template already holds the special tokens it wants (vLLM does the same).
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            items.append(self._with_images(i, text, ids, sources or None, None))
        return self._generate(items, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[Message], chat_template: str | None = None, **kwargs) -> str:
        """The conversation as the prompt text; ``kwargs`` (``tools``, template variables) go to the template."""
        if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
            raise TypeError(f"a conversation must be a list of message dicts, got {conversation!r}")
        chat_template = chat_template if chat_template is not None else self.chat_template
        if chat_template is not None and os.path.isfile(chat_template):  # vLLM's: a template or a file holding one
            chat_template = Path(chat_template).read_text()
        if chat_template is None and not self.tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template; use generate() or pass chat_template")
        kwargs.setdefault("add_generation_prompt", True)
        return self.tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False, **kwargs)
