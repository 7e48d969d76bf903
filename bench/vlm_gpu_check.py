"""The vision-language models on a GPU: lockstep against transformers on the tests' tiny random checkpoints, and
an image's features alone against the same image among others.

    python bench/vlm_gpu_check.py [--device cuda] [--out DIR]

For each architecture of tests/tiny_vlm.py, in fp32 on the device (invariant kernels: the Triton layer_norm and
vision_attention kernels): the largest error of the image features and of the prompt's logits against
transformers' own model on the same device, relative to their largest magnitude; whether each image's features
have the same bits encoded alone and inside a batch of other images; in bf16, the same bitwise check. The CPU
tests check the same things with the CPU paths; this runs the CUDA ones. Prints a table, writes vlm_gpu_check.json.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "models")]

from paged_runner import PagedRunner  # noqa: E402
from tiny_vlm import VLM_ARCHS, hf_image_features, hf_vlm, hf_vlm_logits, mm_batch, save_tiny_vlm  # noqa: E402
from vlm_parity import CASES, grids, image_prompt  # noqa: E402

from lockstep.models.loader import load_model  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b.double().cpu()).abs().max() / b.double().abs().max().cpu()).item()


@torch.no_grad()
def check(arch: str, folder: Path, device: str) -> dict:
    hf = hf_vlm(folder).to(device)
    ours = load_model(folder, device=device, dtype=torch.float32)
    ids, pixel_values, grid_thw = image_prompt(folder, CASES["several-images"])
    feats = ours.encode_images(pixel_values.to(device), grid_thw.to(device))
    theirs = hf_image_features(hf, pixel_values.to(device), grid_thw.to(device))
    feature_err = max(rel(f.embeds, e) for f, (e, _) in zip(feats, theirs, strict=True))
    positions, _ = ours.mrope_positions(ids, grids(grid_thw))
    hidden = PagedRunner(ours).forward([("a", ids, 0)], positions=positions, mm=mm_batch(ids, feats, device))[0]
    logits = ours.compute_logits(hidden)
    ref = hf_vlm_logits(hf.cpu(), ids, pixel_values, grid_thw)  # transformers' reference on the CPU, fp32
    row = {"arch": arch, "feature_rel_err": feature_err, "logit_rel_err": rel(logits, ref)}
    for dtype in (torch.float32, torch.bfloat16):
        model = ours if dtype is torch.float32 else load_model(folder, device=device, dtype=dtype)
        pv = pixel_values.to(device, dtype)
        together = model.encode_images(pv, grid_thw.to(device))
        bounds = [0, *torch.cumsum(grid_thw.prod(-1), 0).tolist()]
        alone = [
            model.encode_images(pv[bounds[i] : bounds[i + 1]], grid_thw[i : i + 1].to(device))[0]
            for i in range(len(grid_thw))
        ]
        same = all(torch.equal(a.embeds, t.embeds) for a, t in zip(alone, together, strict=True))
        if together[0].deepstack is not None:
            same = same and all(torch.equal(a.deepstack, t.deepstack) for a, t in zip(alone, together, strict=True))
        row[f"alone_vs_batch_bitwise_{str(dtype).split('.')[-1]}"] = same
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in VLM_ARCHS:
            rows.append(check(arch, save_tiny_vlm(Path(tmp) / arch, arch), args.device))
    print(f"{'arch':14s} {'features':>10s} {'logits':>10s}  alone==batch fp32 / bf16")
    for r in rows:
        print(f"{r['arch']:14s} {r['feature_rel_err']:10.2e} {r['logit_rel_err']:10.2e}  "
              f"{r['alone_vs_batch_bitwise_float32']} / {r['alone_vs_batch_bitwise_bfloat16']}")  # fmt: skip
    Path(args.out, "vlm_gpu_check.json").write_text(json.dumps({"device": args.device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
