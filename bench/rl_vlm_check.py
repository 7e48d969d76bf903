"""The RL trainer's logprobs for image prompts against the sampler's, on a GPU: tiny random Qwen3-VL, Qwen3-VL-MoE
and Qwen2.5-VL (tests/tiny_vlm.py), bf16 and fp32.

    python bench/rl_vlm_check.py [--device cuda] [--out DIR]

For each architecture and dtype: the engine samples image and text requests in one batch with chunked prefill
cutting through the image tokens; ``lockstep.rl.token_logprobs`` recomputes them on a ``load_policy`` trainer in
micro-batches of 1 and of all; the table shows whether every logprob has the sampler's bits, the largest
difference of the torch-kernel trainer (the negative control: expected > 0), and whether a backward reaches the
vision tower. tests/rl/test_rl_vlm.py checks the same on the CPU; this runs the CUDA kernels. Writes
rl_vlm_check.json.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_vlm import IMAGE_PAD, VISION_END, VISION_START, VLM_ARCHS, save_tiny_vlm, tiny_image  # noqa: E402

from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.rl import load_policy, token_logprobs  # noqa: E402

PLACE = [VISION_START, IMAGE_PAD, VISION_END]


def text(seed: int, n: int) -> list[int]:
    return [(7 * seed + 3 * j) % 90 + 1 for j in range(n)]


def requests() -> list:
    a, b, c = tiny_image(224, 160, 1), tiny_image(128, 96, 2), tiny_image(64, 64, 3)
    return [
        {"prompt_token_ids": PLACE + text(1, 9), "multi_modal_data": {"image": a}},
        text(2, 13),
        {"prompt_token_ids": text(3, 4) + PLACE + text(4, 5) + PLACE + text(5, 3),
         "multi_modal_data": {"image": [b, c]}},
        text(6, 40),
        {"prompt_token_ids": text(7, 11) + PLACE, "multi_modal_data": {"image": [c]}},
        {"prompt_token_ids": PLACE + text(8, 20), "multi_modal_data": {"image": a}},
    ]  # fmt: skip


def max_diff(lps: list[torch.Tensor], outs: list) -> float:
    return max(
        float((lp.detach().cpu() - torch.tensor(o.token_logprobs)).abs().max()) for lp, o in zip(lps, outs, strict=True)
    )


def check(arch: str, folder: Path, device: str, dtype: str) -> dict:
    reqs = requests()
    params = [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=24, ignore_eos=True) for i in range(len(reqs))]
    llm = LLM(str(folder), device=device, dtype=dtype, max_num_batched_tokens=40, max_num_seqs=6, num_kv_blocks=256)
    outs = llm.generate(reqs, params, use_tqdm=False)
    completions = [o.token_ids for o in outs]
    policy = load_policy(folder, device=device, dtype=getattr(torch, dtype))
    row = {"arch": arch, "dtype": dtype}
    for name, packing in (("mb1", dict(micro_batch_size=1)), ("all", {})):
        lps = token_logprobs(policy, reqs, completions, **packing)
        row[f"bitwise_{name}"] = all(
            torch.equal(lp.detach().cpu(), torch.tensor(o.token_logprobs)) for lp, o in zip(lps, outs, strict=True)
        )
    torch.stack([lp.sum() for lp in lps]).sum().backward()
    grad = next(policy.model.visual.patch_embed.parameters()).grad
    row["vision_grad"] = grad is not None and bool(torch.isfinite(grad).all()) and float(grad.abs().sum()) > 0
    torch_policy = load_policy(folder, device=device, dtype=getattr(torch, dtype), batch_invariant=False)
    row["torch_trainer_max_diff"] = max_diff(token_logprobs(torch_policy, reqs, completions), outs)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in VLM_ARCHS:
            folder = save_tiny_vlm(Path(tmp) / arch, arch)
            for dtype in ("bfloat16", "float32"):
                rows.append(check(arch, folder, args.device, dtype))
    print(
        f"{'arch':14s} {'dtype':9s} {'bitwise mb=1':>12s} {'bitwise all':>12s} {'vision grad':>12s} {'torch diff':>11s}"
    )
    for r in rows:
        print(f"{r['arch']:14s} {r['dtype']:9s} {r['bitwise_mb1']!s:>12s} {r['bitwise_all']!s:>12s} "
              f"{r['vision_grad']!s:>12s} {r['torch_trainer_max_diff']:11.3e}")  # fmt: skip
    Path(args.out, "rl_vlm_check.json").write_text(json.dumps({"device": args.device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
