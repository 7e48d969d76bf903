"""The determinism audit: send one request many times at several concurrency levels and compare the answers.

``audit_endpoint`` drives any OpenAI-compatible endpoint through the official ``openai`` client (AsyncOpenAI):
for each concurrency level it sends ``n`` identical requests (plus ``filler`` different ones, shuffled in, so
the server batches the target with other work), at most ``concurrency`` in flight at once. ``audit_local``
runs the same experiment in-process on an ``LLM``, with batch invariance on and off: requests go through the
engine in waves of ``concurrency``, so a wave is one batch.

With ``image`` (a vision-language model) every target is a chat message holding that image and the prompt, and
every other filler request holds an image of its own (random pixels of the same size): the same image described
among other image and text requests.
"""

import asyncio
import base64
import io
import random
from dataclasses import dataclass, field
from pathlib import Path

from lockstep.audit.report import Sample, analyze

DEFAULT_PROMPT = "Tell me about Richard Feynman."
FILLER_TOPICS = (
    "the history of Rome",
    "how a transistor works",
    "a recipe for bread",
    "the rules of chess",
    "black holes",
    "the French revolution",
    "photosynthesis",
    "the stock market",
    "volcanoes",
    "jazz",
)


@dataclass
class AuditConfig:
    prompt: str = DEFAULT_PROMPT
    n: int = 1000
    concurrency: tuple[int, ...] = (1, 8, 64, 256)
    chat: bool = False
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None
    filler: int = 0
    logprobs: bool = True
    level_n: dict[int, int] = field(default_factory=dict)  # a different request count for some levels
    image: str | None = None  # an image file sent with every target (chat completions)

    def n_at(self, level: int) -> int:
        return self.level_n.get(level, self.n)

    def __post_init__(self) -> None:
        if self.n < 1 or self.filler < 0 or not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("n and every concurrency level must be >= 1, filler >= 0")
        self.image_url: str | None = None
        self.image_size: tuple[int, int] | None = None
        if self.image is not None:
            from PIL import Image

            data = Path(self.image).read_bytes()
            self.image_size = Image.open(io.BytesIO(data)).size
            self.image_url = "data:image/png;base64," + base64.b64encode(_as_png(data)).decode()
            self.chat = True

    def params(self) -> dict:
        keys = ("prompt", "n", "chat", "max_tokens", "temperature", "seed", "filler", "image")
        return {k: getattr(self, k) for k in keys} | {"requests_per_level": {c: self.n_at(c) for c in self.concurrency}}


def filler_prompts(count: int) -> list[str]:
    rng = random.Random(0)
    words = (10, 40, 120)
    return [f"Write {rng.choice(words)} words about {rng.choice(FILLER_TOPICS)} (#{i})." for i in range(count)]


def _as_png(data: bytes) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def filler_image_url(i: int, size: tuple[int, int]) -> str:
    """Filler ``i``'s image: random pixels of ``size``, the same every run."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(i).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _content(prompt: str, image_url: str | None) -> str | list[dict]:
    if image_url is None:
        return prompt
    return [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": prompt}]


def _schedule(cfg: AuditConfig, level: int) -> list[tuple[bool, str | list[dict]]]:
    """(is_target, prompt or chat content) in send order: the targets with the fillers shuffled in (fixed per
    level). With an image, the targets hold it and every other filler an image of its own."""
    fillers = filler_prompts(cfg.filler)
    if cfg.image_url is not None:
        fillers = [_content(p, filler_image_url(i, cfg.image_size) if i % 2 else None) for i, p in enumerate(fillers)]
    items = [(True, _content(cfg.prompt, cfg.image_url))] * cfg.n_at(level) + [(False, p) for p in fillers]
    random.Random(level).shuffle(items)
    return items


# -- a remote endpoint -------------------------------------------------------------------------------------------


async def _one(client, model: str, cfg: AuditConfig, prompt: str | list[dict], want: bool) -> Sample:
    kw = {"model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
    if cfg.seed is not None:
        kw["seed"] = cfg.seed
    try:
        if cfg.chat:
            if want and cfg.logprobs:
                kw["logprobs"] = True
            r = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
            c = r.choices[0]
            sample = Sample(c.message.content or "", finish_reason=c.finish_reason, fingerprint=r.system_fingerprint)
            if c.logprobs is not None and c.logprobs.content is not None:
                sample.tokens = [t.token for t in c.logprobs.content]
                sample.logprobs = [t.logprob for t in c.logprobs.content]
        else:
            if want and cfg.logprobs:
                kw["logprobs"] = 0
            r = await client.completions.create(prompt=prompt, **kw)
            c = r.choices[0]
            sample = Sample(c.text, finish_reason=c.finish_reason, fingerprint=r.system_fingerprint)
            if c.logprobs is not None and c.logprobs.tokens is not None:
                sample.tokens = list(c.logprobs.tokens)
                sample.logprobs = [float(x) for x in c.logprobs.token_logprobs]
        return sample
    except Exception as e:  # counted per level; an audit reports errors, it does not stop at them
        return Sample(error=f"{type(e).__name__}: {e}")


class EndpointError(ConnectionError):
    """The endpoint cannot be audited: unreachable, the key refused, or no model to name. Its message is one line."""


async def _probe(client, base_url: str, model: str | None) -> str:
    """The model to audit, after checking that ``base_url`` answers: ``/models`` must be reachable and accept the
    key; without ``model`` it must list one (with it, an endpoint that has no ``/models`` still passes)."""
    import openai

    try:
        models = await client.models.list()
    except openai.APIConnectionError as e:
        cause = e.__cause__ or e
        raise EndpointError(f"cannot reach {base_url}: {type(cause).__name__}: {cause}") from None
    except openai.AuthenticationError:
        raise EndpointError(
            f"{base_url} refused the API key (401): pass it with --api-key or $OPENAI_API_KEY"
        ) from None
    except openai.APIStatusError as e:
        if model is not None:
            return model
        raise EndpointError(f"{base_url}/models answered {e.status_code}: name the model with --model") from None
    if model is None:
        if not models.data:
            raise EndpointError(f"{base_url}/models lists no model: name one with --model")
        model = models.data[0].id
    return model


async def audit_endpoint(
    base_url: str, model: str | None, cfg: AuditConfig, api_key: str | None = None, progress: bool = True
) -> dict:
    """Audit ``base_url`` (e.g. ``http://127.0.0.1:8000/v1``); returns the report (see ``analyze``). Raises
    ``EndpointError`` before sending anything when the endpoint cannot be reached (``_probe``)."""
    from openai import AsyncOpenAI
    from tqdm.auto import tqdm

    client = AsyncOpenAI(base_url=base_url, api_key=api_key or "EMPTY", max_retries=0, timeout=600.0)
    try:
        model = await _probe(client, base_url, model)
        levels: dict[str, dict] = {}
        everything: list[Sample] = []
        for level in cfg.concurrency:
            items = _schedule(cfg, level)
            gate = asyncio.Semaphore(level)
            bar = tqdm(
                total=len(items), desc=f"concurrency {level}", unit="req", dynamic_ncols=True, disable=not progress
            )

            async def send(target: bool, prompt: str | list[dict], gate=gate, bar=bar) -> Sample | None:
                async with gate:
                    sample = await _one(client, model, cfg, prompt, target)
                bar.update(1)
                return sample if target else None

            results = await asyncio.gather(*(send(t, p) for t, p in items))
            bar.close()
            samples = [s for s in results if s is not None]
            levels[str(level)] = analyze(samples)
            everything += samples
    finally:
        await client.close()
    return {
        "target": base_url,
        "model": model,
        "params": cfg.params(),
        "levels": levels,
        "overall": _overall(everything),
    }


def _overall(samples: list[Sample]) -> dict:
    rep = analyze(samples)
    rep.pop("distinct_prefixes", None)
    return rep


# -- in-process, invariance on vs off ----------------------------------------------------------------------------


def audit_local(model: str | None, cfg: AuditConfig, device: str | None = None, progress: bool = True) -> dict:
    """The same experiment on an in-process ``LLM`` (``model`` None: the embedded SmolLM2), once with the
    batch-invariant kernels and once with torch's defaults."""
    import gc

    from tqdm.auto import tqdm

    from lockstep.llm import LLM
    from lockstep.sampling_params import SamplingParams

    modes: dict[str, dict] = {}
    for invariant in (True, False):
        llm = LLM(model, batch_invariant=invariant, device=device, max_num_seqs=max(cfg.concurrency))
        name = llm.engine.runner.model.kernels.name
        params = SamplingParams(
            temperature=cfg.temperature, seed=cfg.seed, max_tokens=cfg.max_tokens, logprobs=0 if cfg.logprobs else None
        )
        tok = llm.tokenizer
        levels: dict[str, dict] = {}
        everything: list[Sample] = []
        for level in cfg.concurrency:
            items = _schedule(cfg, level)
            samples: list[Sample] = []
            bar = tqdm(total=len(items), desc=f"{name} concurrency {level}", unit="req", disable=not progress)
            for start in range(0, len(items), level):
                wave = items[start : start + level]
                prompts = [p for _, p in wave]
                if cfg.chat:
                    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
                else:
                    outs = llm.generate(prompts, params, use_tqdm=False)
                for (target, _), out in zip(wave, outs, strict=True):
                    if target:
                        tokens = [tok.decode([t]) for t in out.token_ids] if tok is not None else None
                        samples.append(Sample(out.text, tokens, out.token_logprobs, out.finish_reason))
                bar.update(len(wave))
            bar.close()
            levels[str(level)] = analyze(samples)
            everything += samples
        modes[name] = {"levels": levels, "overall": _overall(everything)}
        del llm
        gc.collect()
    return {
        "target": "local",
        "model": model or "embedded SmolLM2-135M-Instruct",
        "params": cfg.params(),
        "modes": modes,
    }
