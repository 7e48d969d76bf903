"""Sleep mode on a GPU: how much of the sampler's memory ``LLM.sleep`` gives back, how long waking takes, and that
the answers after waking are the same bits as before (issue 29: level 2 should free >= 90%).

The sampler's memory is what the device's driver counts as used (``torch.cuda.mem_get_info``) beyond what this
process held before the engine was built (the CUDA context included there): weights, KV cache, CUDA graphs and
workspaces. Level 1 offloads the weights to pinned host memory; level 2 discards them, and the bench then loads a
host copy (what a trainer would push) before waking. Every row also checks the outputs' bits against those before
the first sleep.

    python bench/sleep_gpu.py                       # Qwen3-8B shape, 36 layers, bf16, random weights, cuda
    python bench/sleep_gpu.py --layers 4            # quicker
    python bench/sleep_gpu.py --tiny                # toy shape (also on the CPU: storage bytes instead)

Each stage prints its seconds as it ends. A first H200 run (session 12) printed its first line and then nothing within
its 60-s limit. The likeliest cost, from reading the code (not measured): the level-1 sleep page-locks a host copy
of all 16 GB of weights, one ``cudaHostAlloc`` per weight storage on one thread, rounded up to powers of two by
torch's host allocator (~22 GB), and page-locking is slow on some hosts (virtual machines); ``--pin-threads``
(default 8) has torch page-lock with ``cudaHostRegister`` on several threads instead. The KV cache is no longer
0.9 of the GPU by default but 0.5, as a sampler sharing it with a trainer would have.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import QWEN3_8B, QWEN3_TINY, bits, build_checkpoint  # noqa: E402

from lockstep import LLM, SamplingParams  # noqa: E402


def used_bytes(llm: LLM | None, device: torch.device) -> int:
    """Bytes the device has in use (CUDA: the driver's count, every process); CPU: the engine's storages."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    if llm is None:
        return 0
    runner = llm.engine.runner
    weights = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in runner.model.parameters()}
    return sum(weights.values()) + sum(t.untyped_storage().nbytes() for kv in runner.kv_caches for t in kv)


def outputs(llm: LLM, prompts: list[list[int]]) -> list:
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=32, ignore_eos=True, logprobs=1) for i in range(4)]
    return [bits(o.outputs[0]) for o in llm.generate(prompts, params, use_tqdm=False)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Stages:
    """Prints each stage's seconds as it ends (and the run's total so far), so a run cut off by a time limit still
    says where its time went."""

    def __init__(self):
        self.start = time.perf_counter()

    def run(self, name: str, fn):
        t = time.perf_counter()
        result = fn()
        now = time.perf_counter()
        print(f"  [{now - self.start:7.1f} s] {name}: {now - t:.3f} s", flush=True)
        return result, now - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="cut the depth (default: the shape's)")
    ap.add_argument("--smoke", "--tiny", action="store_true", help="a toy shape (on the CPU here)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                    help="the sampler's share of the GPU (vLLM's colocated runs use 0.3-0.5)")  # fmt: skip
    ap.add_argument("--pin-threads", type=int, default=8,
                    help="threads that page-lock level 1's host copy (torch's pinned_num_register_threads; 0: "
                         "torch's default, one cudaHostAlloc per weight on one thread)")  # fmt: skip
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and args.pin_threads and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        # Before CUDA starts: page-lock big host buffers with cudaHostRegister on several threads.
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = (
            f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{args.pin_threads}"
        )
    shape = QWEN3_TINY if args.smoke else QWEN3_8B
    stages = Stages()
    if device.type == "cuda":
        torch.zeros(1, device=device)  # the context, before the baseline
        print(f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}", flush=True)
    baseline = used_bytes(None, device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        info = build_checkpoint(Path(tmp), shape, args.layers, device, weights=False)
        dtype = "bfloat16" if device.type == "cuda" else "float32"
        llm, _ = stages.run("build the LLM (dummy weights, KV cache, CUDA graphs)", lambda: LLM(
            tmp, load_format="dummy", dtype=dtype, device=args.device, enable_sleep_mode=True,
            gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=8))  # fmt: skip
        vocab = shape["vocab_size"]
        prompts = [[(97 * i + 13 * j) % vocab for j in range(200 + 50 * i)] for i in range(4)]
        before, _ = stages.run("generate 4 x 32 tokens", lambda: outputs(llm, prompts))
        awake = used_bytes(llm, device) - baseline
        model = llm.engine.runner.model
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        kv_bytes = sum(t.numel() * t.element_size() for kv in llm.engine.runner.kv_caches for t in kv)
        print(
            f"sampler: {awake / 2**30:.2f} GiB in use ({weight_bytes / 2**30:.2f} GiB weights, "
            f"{kv_bytes / 2**30:.2f} GiB KV cache, {info['num_hidden_layers']} layers), device {device}",
            flush=True,
        )
        for level in (1, 2):
            host = None
            if level == 2:  # the trainer's copy, pushed back before waking
                host, _ = stages.run("level 2: the trainer's host copy of the weights (not part of sleep mode)",
                                     lambda: {n: t.detach().to("cpu", copy=True)
                                              for n, t in model.checkpoint_tensors().items()})  # fmt: skip
            _, t_sleep = stages.run(f"level {level}: sleep", lambda lv=level: llm.sleep(level=lv))
            asleep = used_bytes(llm, device) - baseline
            t_load = 0.0
            if host is not None:
                _, t_load = stages.run("level 2: load_weights from the host", lambda h=host: llm.load_weights(h))
            _, t_wake = stages.run(f"level {level}: wake_up", llm.wake_up)
            after, _ = stages.run(f"level {level}: generate again", lambda: outputs(llm, prompts))
            same = after == before
            freed = 1 - asleep / awake if awake else 0.0
            rows.append((level, awake, asleep, freed, t_sleep, t_load, t_wake, same))
            del host
    print(f"{'level':>5} {'in use GiB':>10} {'asleep GiB':>10} {'freed':>7} {'sleep s':>8} {'load s':>7} "
          f"{'wake s':>7}  same bits", flush=True)  # fmt: skip
    for level, awake, asleep, freed, t_sleep, t_load, t_wake, same in rows:
        print(f"{level:>5} {awake / 2**30:>10.2f} {asleep / 2**30:>10.2f} {freed:>7.1%} {t_sleep:>8.3f} "
              f"{t_load:>7.3f} {t_wake:>7.3f}  {same}", flush=True)  # fmt: skip
    ok = all(row[-1] and (row[0] != 2 or row[3] >= 0.9) for row in rows)  # same bits; level 2 frees >= 90%
    print("PASS" if ok else "FAIL (goal: same bits, level 2 frees >= 90%)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
