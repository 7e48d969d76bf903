"""The vision-language engine end to end on the Qwen3-VL-8B shape (random weights): the same image and question
alone and inside batches of other image and text requests, time to first token with a 1024 x 1024 image, and
the throughput of 256 requests of one 448 x 448 image + 64 text tokens -> 256 output tokens, invariant and fast mode.

    python bench/vlm_engine.py [--layers 36] [--modes invariant,default] [--out DIR]

The checkpoint folder is Qwen3-VL-8B's config (text: 36 layers, hidden 4096, 32/8 heads; vision: 27 blocks,
hidden 1152, DeepStack at 8/16/24) with ``load_format="dummy"`` weights, the tests' char tokenizer with the vision
special tokens, and a Qwen2VL image processor allowing up to 1024 x 1024 pixels. The needle: "Describe this
image." with one 448 x 448 image, greedy, 128 tokens; sent alone, then as one of 16, 64 and 256 requests whose
other members are other images (of other sizes) and text prompts, at several positions; the count of distinct
completions (token ids) over all copies, per mode. Writes vlm_engine.json to --out.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_vlm import (  # noqa: E402
    IMAGE_PAD,
    IMAGE_PLACEHOLDER,
    VISION_END,
    VISION_START,
    VLM_VOCAB,
    save_image_processor,
    save_vlm_tokenizer,
)

from lockstep import LLM, SamplingParams  # noqa: E402

TEXT = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20], mrope_interleaved=True),
)  # fmt: skip
VISION = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
)  # fmt: skip
NEEDLE = "Describe this image."
# --smoke: a tiny model, small batches and short outputs, to check the script on the CPU.
SMOKE_TEXT = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  rope_parameters=dict(TEXT["rope_parameters"], mrope_section=[4, 2, 2]))  # fmt: skip
SMOKE_VISION = dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=64,
                    num_position_embeddings=64, deepstack_visual_indexes=[0])  # fmt: skip
SIZES = {"full": dict(batches=(16, 64, 256), tokens=128, requests=256, out=256),
         "smoke": dict(batches=(4,), tokens=8, requests=4, out=8)}  # fmt: skip


def make_folder(root: Path, layers: int, smoke: bool, vocab_size: int | None = None) -> Path:
    """``vocab_size``: the text model's (default Qwen3-VL's 151,936; the tokenizer knows the first VLM_VOCAB ids)."""
    from transformers import Qwen3VLConfig

    folder = root / "qwen3-vl-8b-shape"
    text = dict(TEXT, **SMOKE_TEXT) if smoke else TEXT
    if vocab_size is not None:
        text = dict(text, vocab_size=vocab_size)
    vision = dict(VISION, **SMOKE_VISION) if smoke else VISION
    config = Qwen3VLConfig(
        text_config=dict(text, num_hidden_layers=layers, dtype="bfloat16"), vision_config=vision,
        image_token_id=IMAGE_PAD, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )  # fmt: skip
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    config.dtype = "bfloat16"
    config.save_pretrained(folder)
    save_vlm_tokenizer(folder)
    save_image_processor(folder, "qwen3_vl", min_pixels=64 * 64, max_pixels=1024 * 1024)
    assert VLM_VOCAB < TEXT["vocab_size"]
    return folder


def image(side: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))


def image_prompt(question: str, img) -> dict:
    return {"prompt": f"{IMAGE_PLACEHOLDER}{question}", "multi_modal_data": {"image": img}}


def fillers(n: int, seed: int) -> list:
    """Other requests: images of other sizes with other questions, and text prompts, alternating."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = "".join(chr(c) for c in rng.integers(97, 123, int(rng.integers(8, 200))))
        out.append(image_prompt(words, image(int(rng.choice([112, 224, 448, 672])), seed + i)) if i % 2 else words)
    return out


def invariance(llm: LLM, needle: dict, params: SamplingParams, batches: tuple[int, ...]) -> dict:
    """Distinct completions of the needle alone and at positions 0, middle and last of batches of other requests."""
    completions = [tuple(llm.generate(needle, params, use_tqdm=False)[0].outputs[0].token_ids)]
    for size in batches:
        others = fillers(size - 1, seed=size)
        for at in (0, size // 2, size - 1):
            batch = others[:at] + [needle] + others[at:]
            outs = llm.generate(batch, params, use_tqdm=False)
            completions.append(tuple(outs[at].outputs[0].token_ids))
    first_split = next((i for i, t in enumerate(zip(*completions, strict=False)) if len(set(t)) > 1), None)
    return {"copies": len(completions), "unique": len(set(completions)), "first_split_token": first_split}


def run_mode(folder: Path, mode: str, size: dict) -> dict:
    t0 = time.perf_counter()
    llm = LLM(str(folder), load_format="dummy", batch_invariant=mode == "invariant", max_num_seqs=256)
    row = {"mode": mode, "startup_s": time.perf_counter() - t0}
    greedy = SamplingParams(temperature=0, max_tokens=size["tokens"], ignore_eos=True)
    row["invariance"] = invariance(llm, image_prompt(NEEDLE, image(448, 0)), greedy, size["batches"])
    # Time to first token: one request with a 1024 x 1024 image, one output token (preprocessing, the tower,
    # prefill and the first sample), after one untimed run.
    ttft_req = image_prompt(NEEDLE, image(1024, 1))
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(ttft_req, one, use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(ttft_req, one, use_tqdm=False)
    row["ttft_1024px_s"] = time.perf_counter() - t0
    # Throughput: 256 x (one 448 x 448 image + 64 text tokens) -> 256 tokens each.
    rng = np.random.default_rng(7)
    reqs = [
        image_prompt("".join(chr(c) for c in rng.integers(97, 123, 64)), image(448, 100 + i))
        for i in range(size["requests"])
    ]
    params = SamplingParams(temperature=0, max_tokens=size["out"], ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=False)
    row["throughput_wall_s"] = time.perf_counter() - t0
    row["output_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
    row["output_tok_s"] = row["output_tokens"] / row["throughput_wall_s"]
    llm.close()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--modes", default="invariant,default")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="a tiny model and small batches (a CPU check)")
    args = parser.parse_args()
    size = SIZES["smoke" if args.smoke else "full"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(tmp), args.layers, args.smoke)
        rows = [run_mode(folder, mode, size) for mode in args.modes.split(",")]
    head = ("mode", "unique/copies", "split at", "TTFT 1024px", "256 x 448px wall", "out tok/s")
    print(f"{head[0]:10s} {head[1]:>14s} {head[2]:>9s} {head[3]:>12s} {head[4]:>17s} {head[5]:>10s}")
    for r in rows:
        inv = r["invariance"]
        print(f"{r['mode']:10s} {inv['unique']:>6d}/{inv['copies']:<7d} {str(inv['first_split_token']):>9s} "
              f"{r['ttft_1024px_s']:11.3f}s {r['throughput_wall_s']:16.2f}s {r['output_tok_s']:10.0f}")  # fmt: skip
    meta = {"date": str(date.today()), "torch": torch.__version__, "layers": args.layers}
    meta["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    Path(args.out, "vlm_engine.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
