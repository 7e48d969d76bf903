"""Start-up warm-up: compile the Triton kernels a server meets before it serves, and count what compiles later.

Triton compiles a kernel the first time it sees a new specialisation: a new tile configuration (the matmul picks
its tile from a bucket of M), a new constexpr, an integer argument newly divisible by 16 or not. Decode shapes
compile when the CUDA graphs are captured; prefill shapes would compile on the first request of each size, a
stall of seconds in the middle of serving (or tens of milliseconds from the disk cache). ``warm_up`` runs one
prompt of each length in ``WARMUP_LENGTHS`` that one step can hold, greedy and sampled with the sampler's options,
through the engine's own path (the scheduler, every tensor-parallel rank, the sampler), then forgets the prefix
cache those prompts filled. Every request has its own seed, so the engine's draw of seeds is untouched, and the
K/V they leave in free blocks is never read: the bits of later requests are what a fresh engine gives. A
vision-language engine's random prompts leave out the image placeholder token, and requests with one image of each
size in ``WARMUP_IMAGE_SIZES`` that fits compile the vision tower's kernels (other image sizes may still compile
while serving: its kernels see the patch count).

``compiled_kernels`` lists the in-memory kernel-cache misses of this process through Triton's post-compile hook
(each as Triton describes it: the kernel's name, launch options and argument specialisations);
``LLMEngine.triton_compiles_after_start`` is the count since warm-up ended (0 is the goal), and
``LLMEngine.triton_kernels_compiled_after_start`` says which.
"""

import random

import triton

from lockstep.outputs import OutputKind
from lockstep.sampling_params import SamplingParams

# Prompt lengths run at start-up: around each of the matmul's M buckets (ops/matmul.py: 16, 32, 64, 128, 256,
# 512, 2048) and Triton's divisible-by-16 specialisation, up to a CUDA engine's default step budget.
WARMUP_LENGTHS = (1, 5, 16, 17, 33, 64, 100, 128, 250, 256, 500, 512, 1000, 2048, 3000, 4096, 8192)
WARMUP_OUTPUT = 3  # tokens each warm-up request generates: its prefill, then decode steps
WARMUP_IMAGE_SIZES = ((224, 224), (448, 448))  # (width, height) of a vision-language engine's warm-up images

_compiled: list[str] = []
_installed = False


def compiled_kernels() -> list[str]:
    """The Triton kernels compiled (or loaded from the disk cache) in this process since counting began, in
    order, each as Triton's hook describes it (a copy)."""
    _install_counter()
    return list(_compiled)


def _install_counter() -> None:
    """Chain a counter onto Triton's post-compile hook (once; a hook someone else set keeps running)."""
    global _installed
    if _installed:
        return
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return  # an older Triton: no hook, the count stays 0
    previous = runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        _compiled.append(str(kwargs.get("repr") or kwargs.get("fn") or "?"))
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook
    _installed = True


def warm_up(engine, lengths: tuple[int, ...] = WARMUP_LENGTHS) -> int:
    """Run the warm-up requests through ``engine`` to completion; returns how many ran. The engine must be idle."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up needs an idle engine")
    config = engine.config
    room = min(config.max_num_batched_tokens, config.max_model_len - WARMUP_OUTPUT - 1)
    # Blocks for one request at a time: a prompt that would not fit the cache is left out.
    room = min(room, config.num_kv_blocks * config.block_size - WARMUP_OUTPUT - 1)
    rng = random.Random(0)
    options = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9, top_k=20, logprobs=5),
        dict(temperature=1.0, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1),
    ]
    ran = 0
    vocab = engine.runner.vocab_size
    image_token = engine.runner.model.mm_config.image_token_id if engine.is_multimodal else None

    def add(n: int, option: int | None = None, image=None) -> None:
        nonlocal ran
        option = ran % len(options) if option is None else option
        params = SamplingParams(max_tokens=WARMUP_OUTPUT, ignore_eos=True, seed=ran, **options[option])
        prompt = [rng.randrange(vocab) for _ in range(n)]
        prompt = [(t + 1) % vocab if t == image_token else t for t in prompt]  # no placeholder without an image
        mm = None
        if image is not None:
            prompt, mm = engine.process_images(prompt + [image_token], [image])
        engine.add_request(f"lockstep-warmup-{ran}", prompt, params, output_kind=OutputKind.FINAL_ONLY, mm=mm)
        ran += 1

    def finish() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    for n in lengths:
        if n <= room:
            add(n)
            finish()
    # Several sequences in a step (Triton specialises an integer argument equal to 1, such as a one-sequence
    # step's count), and a step mixing a decode with another request's prefill.
    if room >= 3 * 40:
        add(40)
        engine.step()
        add(39)
        add(33)
        finish()
    # A step of 16 sequences (a count divisible by 16, another specialisation), all sampled with top-k and top-p
    # (16 rows in each of the sampler's kernels): their prefill together, then their decodes.
    blocks_each = -(-(8 + WARMUP_OUTPUT) // config.block_size)
    if config.max_num_batched_tokens >= 16 * 8 and config.num_kv_blocks >= 16 * blocks_each:
        for _ in range(16):
            add(8, option=1)
        finish()
    # Prefill steps whose sequences average 64 tokens or more take wider attention tiles (ops/attention/launch.py): 2
    # and 16 such sequences in one step.
    blocks_each = -(-(64 + WARMUP_OUTPUT) // config.block_size)
    for count in (2, 16):
        if config.max_num_batched_tokens >= count * 64 and config.num_kv_blocks >= count * blocks_each:
            for _ in range(count):
                add(64, option=0)
            finish()
    if image_token is not None:
        for width, height in WARMUP_IMAGE_SIZES:
            image = _noise_image(width, height)
            num_tokens = len(engine.process_images([image_token], [image])[0])
            if 4 + num_tokens <= room:
                add(4, option=0, image=image)
                finish()
    engine.scheduler.block_manager.reset_prefix_cache()
    return ran


def _noise_image(width: int, height: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))
