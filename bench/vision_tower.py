"""The vision towers end to end: lockstep's (invariant and default kernels) against transformers' own (SDPA) on the
same batch of images, with random weights in the real shapes; and the first image's bits alone vs in the batch.

    python bench/vision_tower.py [--device cuda|cpu] [--dtype bfloat16|float32] [--out DIR]

Shapes: Qwen3-VL-8B's tower (27 blocks, hidden 1152, 16 heads, 16-pixel patches, DeepStack at 8/16/24) and
Qwen2.5-VL-7B's (32 blocks, hidden 1280, 14-pixel patches, 112-pixel windows, full attention at 7/15/23/31); the
decoder is cut to one small layer (only the tower is timed). Batches of 448 x 448 images (1, 16, 64), one
1024 x 1024 image and a mix of sizes. Times are medians of CUDA-event timings (wall clock on the CPU, where
``--device cpu`` runs a tiny tower as a smoke test). Writes vision_tower.json to --out.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import date

import torch

from lockstep.models.llama import ModelConfig
from lockstep.models.loader import model_class

TEXT = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, head_dim=128, max_position_embeddings=4096,
)  # fmt: skip
VISION = {
    "qwen3_vl": dict(
        depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=256, patch_size=16,
        num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
    ),
    "qwen2_5_vl": dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=256, patch_size=14,
        window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
    ),
}  # fmt: skip
TINY_VISION = {
    "qwen3_vl": dict(
        depth=2, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=256, patch_size=16,
        num_position_embeddings=64, deepstack_visual_indexes=[0],
    ),
    "qwen2_5_vl": dict(
        depth=2, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=256, patch_size=14,
        window_size=56, fullatt_block_indexes=[1],
    ),
}  # fmt: skip
ROPE = {
    "qwen3_vl": dict(rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20], mrope_interleaved=True),
    "qwen2_5_vl": dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]),
}
# Image sizes (pixels a side, rounded per tower to whole 2 x 2 patch blocks) per case.
CASES = [("1 x 448^2", [448]), ("16 x 448^2", [448] * 16), ("64 x 448^2", [448] * 64), ("1 x 1024^2", [1024])]
MIXED = ("mixed 6 sizes", [112, 448, 224, 672, 56, 336])
CPU_CASES = [("1 x 112^2", [112]), ("4 x 112^2", [112] * 4), ("mixed 3 sizes", [56, 112, 224])]


def build(arch: str, device: str, dtype: torch.dtype, tiny: bool):
    """transformers' model and lockstep's (both kernel sets) with the same random weights."""
    import transformers

    cls_config, cls_model = {
        "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration),
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
    }[arch]
    vision = (TINY_VISION if tiny else VISION)[arch]
    hf_config = cls_config(text_config=dict(TEXT, rope_parameters=ROPE[arch]), vision_config=vision)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = cls_model(hf_config).to(device, dtype).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, device=device)
            p.copy_(1 + 0.1 * noise if "norm" in name else noise / p.shape[-1] ** 0.5)
    config = ModelConfig.from_hf({**hf_config.to_dict(), "architectures": [cls_model.__name__]})
    ours = {}
    for kernels in ("invariant", "default"):
        model = model_class(config.architecture)(config, kernels=kernels, dtype=dtype, device=device)
        slots = model.checkpoint_tensors()
        with torch.no_grad():
            for name, tensor in model.released_names(hf.state_dict().items()):
                if name in slots:
                    slots[name].copy_(tensor)
        ours[kernels] = model
    return hf, ours


def images(sizes: list[int], patch: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pixel values and grids for square images of about ``sizes`` pixels a side."""
    sides = [max(1, round(s / (2 * patch))) * 2 for s in sizes]  # patches a side, whole 2 x 2 blocks
    grids = torch.tensor([[1, n, n] for n in sides])
    gen = torch.Generator().manual_seed(1)
    total = int(grids.prod(-1).sum())
    return torch.randn(total, 3 * 2 * patch * patch, generator=gen).to(device), grids.to(device)


def timed(fn, device: str, reps: int) -> float:
    """Median milliseconds of ``fn()``."""
    fn()
    runs = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            runs.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", default=".")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    device, dtype, tiny = args.device, getattr(torch, args.dtype), args.device == "cpu"
    cases = CPU_CASES if tiny else [*CASES, MIXED]
    rows = []
    for arch in ("qwen3_vl", "qwen2_5_vl"):
        hf, ours = build(arch, device, dtype, tiny)
        patch = hf.config.vision_config.patch_size
        for name, sizes in cases:
            pixel_values, grid_thw = images(sizes, patch, device)
            with torch.inference_mode():
                ref = hf.model.get_image_features(pixel_values.to(dtype), grid_thw, return_dict=True).pooler_output
                row = {"arch": arch, "case": name, "patches": pixel_values.shape[0]}
                row["hf_ms"] = timed(
                    lambda: hf.model.visual(pixel_values.to(dtype), grid_thw=grid_thw), device, args.reps
                )
                for kernels, model in ours.items():
                    feats = model.encode_images(pixel_values, grid_thw)
                    err = max(
                        ((f.embeds.double() - r.double()).abs().max() / r.double().abs().max()).item()
                        for f, r in zip(feats, ref, strict=True)
                    )
                    first = int(grid_thw[0].prod())
                    alone = model.encode_images(pixel_values[:first], grid_thw[:1])[0].embeds
                    row[f"{kernels}_ms"] = timed(
                        lambda m=model: m.encode_images(pixel_values, grid_thw), device, args.reps
                    )
                    row[f"{kernels}_rel_err_vs_hf"] = err
                    row[f"{kernels}_first_image_alone_equal"] = bool(torch.equal(alone, feats[0].embeds))
                row["invariant_vs_hf"] = row["invariant_ms"] / row["hf_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {
        "date": str(date.today()),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "argv": sys.argv,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vision_tower.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
