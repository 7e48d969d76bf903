"""True on-policy RL with lockstep: a GRPO-style loop whose trainer logprobs equal the sampler's bit for bit.

Each step samples a group of completions per arithmetic question with the engine (temperature 1, seeded),
rewards the ones whose first number is the right answer (a little for digits), recomputes every completion
token's logprob on the trainer side with autograd (``lockstep.rl.token_logprobs``), takes a policy-gradient step
and syncs the new weights into the engine (``LLM.load_weights``). It logs the max |sampler - trainer| logprob
difference and an estimate of KL(sampler || trainer): with lockstep both are exactly 0.0 at every step, so the
importance ratio is exactly 1 and no off-policy correction is needed. ``--no-batch-invariant`` runs the engine
and the trainer on torch's default kernels, as a usual RL stack does, and shows what changes.

``--vlm DIR`` runs the same loop on a vision-language model: a small random-weight Qwen3-VL (built once in DIR)
is asked how many squares an image shows; the engine samples with the image (``multi_modal_data``) and the
trainer recomputes the logprobs through the same vision tower, from the same prompt dicts.

    python examples/rl_true_on_policy.py                          # embedded SmolLM2-135M-Instruct on CPU
    python examples/rl_true_on_policy.py --no-batch-invariant     # the same loop on torch's kernels
    python examples/rl_true_on_policy.py --device cuda --random-qwen3 /tmp/qwen3-rl --steps 20   # GPU, random weights
    python examples/rl_true_on_policy.py --vlm /tmp/qwen3-vl-rl                   # images: a random Qwen3-VL
"""

import argparse
import hashlib
import math
import random
import re
import time
from pathlib import Path

import torch

from lockstep import LLM, SamplingParams
from lockstep.rl import load_policy, micro_batches, token_logprobs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CHARS = "".join(chr(c) for c in range(32, 127))  # one token per printable ASCII character


def build_random_qwen3(folder: Path, layers: int, vocab_size: int, seed: int = 0) -> Path:
    """Save a random-weight bf16 checkpoint with Qwen3-0.6B's shape (depth cut to ``layers``) and a tokenizer
    with one token per printable character (ids 0-94; every other id decodes as ``<id>``). Skips when present."""
    if (folder / "config.json").is_file():
        return folder
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    eos = len(_CHARS)
    config = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    _randomize(model, seed)
    model.save_pretrained(folder)
    vocab = {c: i for i, c in enumerate(_CHARS)} | {"</s>": eos}
    vocab |= {f"<{i}>": i for i in range(eos + 1, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="</s>", eos_token="</s>").save_pretrained(
        folder
    )
    return folder


def _randomize(model, seed: int) -> None:
    """Random weights, the same for a seed: norm weights near 1, every other row scaled by 1 / sqrt(its length)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else noise / p.shape[-1] ** 0.5)


# The --vlm model's vocabulary: the printable characters, EOS, then the vision special tokens.
_VLM_EOS = len(_CHARS)
_VISION_START, _IMAGE_PAD, _VISION_END, _VIDEO_PAD = range(_VLM_EOS + 1, _VLM_EOS + 5)


def build_random_qwen3_vl(folder: Path, seed: int = 0) -> Path:
    """Save a small random-weight Qwen3-VL checkpoint (2 decoder layers of width 128, a 2-block vision tower with
    DeepStack after its first block), the one-token-per-character tokenizer plus the vision special tokens, and
    the image processor (16-pixel patches merged 2 x 2: a 96 x 96 image is 9 image tokens). Skips when present."""
    if (folder / "config.json").is_file():
        return folder
    import transformers
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    text = dict(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=None,
        eos_token_id=_VLM_EOS, pad_token_id=None,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[6, 5, 5], mrope_interleaved=True),
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=16,
        temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0],
    )  # fmt: skip
    config = transformers.Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=_IMAGE_PAD, video_token_id=_VIDEO_PAD,
        vision_start_token_id=_VISION_START, vision_end_token_id=_VISION_END, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen3VLForConditionalGeneration(config).to(torch.bfloat16).eval()
    _randomize(model, seed)
    model.save_pretrained(folder)
    special = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    vocab = {c: i for i, c in enumerate(_CHARS)} | {"</s>": _VLM_EOS}
    vocab |= {name: _VISION_START + k for k, name in enumerate(special)}
    vocab |= {f"<{i}>": i for i in range(_VIDEO_PAD + 1, text["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in special])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="</s>", eos_token="</s>")
    fast.save_pretrained(folder)
    transformers.Qwen2VLImageProcessorPil(
        min_pixels=32 * 32, max_pixels=128 * 128, patch_size=16, merge_size=2, temporal_patch_size=2
    ).save_pretrained(folder)
    return folder


def squares_image(rng: random.Random, count: int):
    """A 96 x 96 image of ``count`` bright squares in a 3 x 3 grid on a dark background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (96, 96), (16, 16, 32))
    draw = ImageDraw.Draw(image)
    for cell in rng.sample(range(9), count):
        x, y = 32 * (cell % 3), 32 * (cell // 3)
        draw.rectangle((x + 6, y + 6, x + 25, y + 25), fill=(rng.randrange(128, 256), rng.randrange(128, 256), 64))
    return image


def make_vlm_prompt(llm: LLM, rng: random.Random) -> tuple[dict, int]:
    """An image prompt as ``LLM.generate`` takes it (one ``<|image_pad|>`` for the image) and its answer."""
    count = rng.randint(1, 9)
    tok = llm.tokenizer
    ids = list(tok.encode("user: ", add_special_tokens=False)) + [_VISION_START, _IMAGE_PAD, _VISION_END]
    ids += list(tok.encode("How many squares? Answer with the number.\nassistant:", add_special_tokens=False))
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": squares_image(rng, count)}}, count


def make_prompt(llm: LLM, a: int, b: int) -> list[int]:
    tok = llm.tokenizer
    if tok.chat_template:
        question = f"What is {a} + {b}? Answer with just the number."
        text = llm.apply_chat_template([{"role": "user", "content": question}])
        return list(tok.encode(text, add_special_tokens=False))
    return list(tok.encode(f"{a}+{b}="))


def reward(text: str, answer: int) -> float:
    """1 when the first number in the completion is the answer, else a little credit for answering in digits
    (0.1 times the fraction of digit characters: random-weight models get non-zero advantages too)."""
    match = re.search(r"-?\d+", text)
    if match is not None and int(match.group()) == answer:
        return 1.0
    return 0.1 * sum(c.isdigit() for c in text) / max(1, len(text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded SmolLM2)")
    ap.add_argument(
        "--random-qwen3",
        metavar="DIR",
        default=None,
        help="build (once) and use a random-weight Qwen3-shaped checkpoint in DIR",
    )
    ap.add_argument("--vlm", metavar="DIR", default=None, help="build (once) and use a random Qwen3-VL in DIR")
    ap.add_argument("--layers", type=int, default=8, help="depth of the --random-qwen3 model")
    ap.add_argument("--vocab-size", type=int, default=151936, help="vocabulary of the --random-qwen3 model")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--questions", type=int, default=2, help="questions per step")
    ap.add_argument("--group-size", type=int, default=4, help="completions per question")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--micro-batch-size", type=int, default=4, help="trainer sequences per micro-batch")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES], help="engine and trainer dtype")
    ap.add_argument("--kv-blocks", type=int, default=2048, help="engine KV cache blocks (the trainer needs the rest)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-batch-invariant", action="store_true", help="torch's default kernels in both")
    args = ap.parse_args()  # fmt: skip

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if args.random_qwen3:
        args.model = str(build_random_qwen3(Path(args.random_qwen3), args.layers, args.vocab_size))
    if args.vlm:
        args.model = str(build_random_qwen3_vl(Path(args.vlm), args.seed))
    if args.model is None:
        from lockstep.models.embedded import default_model_path

        args.model = str(default_model_path())
    invariant = not args.no_batch_invariant
    dtype = None if args.dtype == "auto" else _DTYPES[args.dtype]
    llm = LLM(
        args.model,
        batch_invariant=invariant,
        dtype=args.dtype,
        device=str(device),
        max_num_seqs=64,
        num_kv_blocks=args.kv_blocks,
    )
    policy = load_policy(args.model, batch_invariant=invariant, dtype=dtype, device=device)
    if policy.dtype != llm.engine.runner.model.dtype:
        raise SystemExit("the trainer and the engine must run in the same dtype")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    mode = "lockstep (batch-invariant)" if invariant else "torch default kernels"
    print(f"model {args.model} | {mode} | device {device} | dtype {policy.dtype}", flush=True)

    for step in range(args.steps):
        t0 = time.perf_counter()
        prompts, answers, params = [], [], []
        for q in range(args.questions):
            if args.vlm:
                prompt, answer = make_vlm_prompt(llm, rng)
            else:
                a, b = rng.randint(1, 9), rng.randint(1, 9)
                prompt, answer = make_prompt(llm, a, b), a + b
            for g in range(args.group_size):
                prompts.append(prompt)
                answers.append(answer)
                seed = (args.seed * 1_000_003 + step) * 10_000 + q * args.group_size + g
                params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=args.max_tokens))
        outs = llm.generate(prompts, params, use_tqdm=False)
        t_sample = time.perf_counter() - t0

        rewards = torch.tensor([reward(o.text, ans) for o, ans in zip(outs, answers, strict=True)])
        groups = rewards.view(args.questions, args.group_size)
        adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True, correction=0) + 1e-4)).flatten()

        # Trainer: recompute every sampled token's logprob with autograd, micro-batch by micro-batch (an image
        # prompt goes as the same dict: the trainer runs the same image processor and vision tower).
        completions = [o.token_ids for o in outs]
        sampler_lps = [torch.tensor(o.token_logprobs, dtype=torch.float32, device=device) for o in outs]
        lengths = [len(o.prompt_token_ids) + len(o.token_ids) for o in outs]  # image placeholders expanded
        max_diff, kl_sum, num_tokens = 0.0, 0.0, sum(len(c) for c in completions)
        optimizer.zero_grad(set_to_none=True)
        for idx in micro_batches(lengths, args.micro_batch_size):
            trainer_lps = token_logprobs(
                policy, [prompts[i] for i in idx], [completions[i] for i in idx], micro_batch_size=len(idx)
            )
            loss = 0.0
            for i, lp in zip(idx, trainer_lps, strict=True):
                delta = (lp.detach() - sampler_lps[i]).double()  # log(trainer / sampler) per token
                max_diff = max(max_diff, float(delta.abs().max()))
                # k3 estimate of KL(sampler || trainer) on tokens drawn from the sampler: >= 0, 0 iff equal.
                kl_sum += float((delta.exp() - 1.0 - delta).sum())
                ratio = torch.exp(lp - sampler_lps[i])  # importance ratio: exactly 1 when the bits agree
                loss = loss - (ratio * adv[i]).mean() / len(outs)
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm=1.0)
        optimizer.step()
        llm.load_weights(policy.checkpoint_tensors())  # weight sync: HF names, in-process
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        kl = kl_sum / num_tokens
        assert math.isfinite(kl)
        print(
            f"step {step}: reward {rewards.mean():.3f} | max|sampler-trainer| {max_diff!r} | kl {kl!r} | "
            f"grad-norm {float(grad_norm):.6e} | tokens {num_tokens} | sample {t_sample:.2f}s | step {dt:.2f}s",
            flush=True,
        )
    # A fingerprint of the whole run (every sample, gradient and update feeds the final weights): two runs with
    # the same arguments print the same digest when training is deterministic.
    digest = hashlib.sha256()
    for name, t in sorted(policy.checkpoint_tensors().items()):
        digest.update(name.encode())
        digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    print(f"final weights sha256 {digest.hexdigest()}")


if __name__ == "__main__":
    main()
