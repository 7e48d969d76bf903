"""Host time of the vision tower's launch paths: microseconds of Python per op call at Qwen3-VL-8B's tower shapes,
and the Python calls and host milliseconds of one whole tower call.

    python bench/vision_host.py [--device cuda|cpu] [--reps N]

On CUDA the GPU is kept busy (``torch.cuda._sleep``) while the calls are enqueued, so the wall time of N calls is
the host's alone: lockstep's wrapper plus Triton's launcher (or torch's dispatcher for the reference ops); a whole
tower call (hundreds of launches, more than the launch queue holds) is timed to its return, host-bound at one
image (the GPU is busy ~7 ms of a ~60 ms call, docs/perf.md). On the CPU the Triton kernels are replaced by stubs
and each op's CUDA launch path is called directly on CPU tensors: that times lockstep's own wrapper (configs,
checks, descriptors), not Triton's launcher, in this thread's CPU time; the tower is the CPU path at a tiny size.
Prints one line per measurement.
"""

import argparse
import cProfile
import importlib
import pstats
import sys
import time

import torch

OP_FILES = ("layer_norm", "matmul", "vision_attention")
M, HIDDEN, HEADS, HEAD_DIM, INTER = 784, 1152, 16, 72, 4304  # one 448 x 448 image through Qwen3-VL-8B's tower


def host_us(fn, reps: int, device: str, busy: bool = True) -> float:
    """The host microseconds per call of ``fn``, the least of 5 rounds: on CUDA with the GPU kept busy meanwhile
    (``busy``; for a few hundred launches, which the launch queue holds) or, without, the wall time to the last
    call's return (a call of many launches: the queue would fill while the GPU sleeps)."""
    fn()
    # On the CPU, this thread's CPU time: the machines are shared, and time spent waiting for a core is not host work.
    clock = time.perf_counter if device == "cuda" else time.thread_time
    rounds = []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time: the calls below only enqueue
        t0 = clock()
        for _ in range(reps):
            fn()
        rounds.append((clock() - t0) / reps * 1e6)
        if device == "cuda":
            torch.cuda.synchronize()
    return min(rounds)


class _Stub:
    """A Triton kernel that launches nothing: ``kernel[grid](*args, **meta)`` returns at once."""

    def __getitem__(self, grid):
        return lambda *args, **meta: None


def stub_kernels() -> None:
    layer_norm, matmul, vision_attention = (importlib.import_module(f"lockstep.ops.{name}") for name in OP_FILES)
    matmul._mm_kernel = matmul._mm_tma_kernel = _Stub()
    layer_norm._layer_norm_kernel = _Stub()
    vision_attention._vision_attention_kernel = _Stub()


def op_calls(device: str, dtype: torch.dtype) -> dict:
    """The tower's ops at their real shapes; on the CPU their CUDA launch paths (with stubbed kernels)."""
    import torch.nn.functional as F

    from lockstep import ops

    layer_norm, matmul, vision_attention = (importlib.import_module(f"lockstep.ops.{name}") for name in OP_FILES)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    x, w_qkv, b_qkv, w_fc2 = randn(M, HIDDEN), randn(3 * HIDDEN, HIDDEN), randn(3 * HIDDEN), randn(HIDDEN, INTER)
    h, ln_w, ln_b = randn(M, INTER), randn(HIDDEN), randn(HIDDEN)
    q = randn(M, HEADS, HEAD_DIM)
    cu = torch.tensor([0, M], dtype=torch.int32, device=device)
    if device == "cuda":
        calls = {
            "linear qkv (784 x 1152 -> 3456)": lambda: ops.linear(x, w_qkv, b_qkv),
            "linear fc2 (784 x 4304 -> 1152)": lambda: ops.linear(h, w_fc2, None),
            "linear 16 rows (1152 -> 3456)": lambda: ops.linear(x[:16], w_qkv, b_qkv),
            "layer_norm (784 x 1152)": lambda: ops.layer_norm(x, ln_w, ln_b, 1e-6),
            "vision_attention (1 x 784, 16 x 72)": lambda: ops.vision_attention(q, q, q, cu, HEAD_DIM**-0.5),
            "reference F.linear qkv": lambda: F.linear(x, w_qkv, b_qkv),
            "reference F.layer_norm": lambda: F.layer_norm(x, (HIDDEN,), ln_w, ln_b, 1e-6),
        }
    else:

        def cuda_linear(a, w, b):  # linear's CUDA branch (_addmm's checks, then the launch path)
            bt = w.t()
            matmul._check(a, bt, batched=False)
            matmul._check_bias(b, bt.shape[1])
            kwargs = {"weight": w} if "weight" in matmul._bmm_triton.__code__.co_varnames else {}
            return matmul._bmm_triton(a[None], bt[None], b, 1.0, 1.0, **kwargs)[0]

        calls = {
            "linear qkv (784 x 1152 -> 3456)": lambda: cuda_linear(x, w_qkv, b_qkv),
            "linear fc2 (784 x 4304 -> 1152)": lambda: cuda_linear(h, w_fc2, None),
            "linear 16 rows (1152 -> 3456)": lambda: cuda_linear(x[:16], w_qkv, b_qkv),
            "layer_norm (784 x 1152)": lambda: layer_norm._layer_norm_triton(x, ln_w, ln_b, 1e-6),
            "vision_attention (1 x 784, 16 x 72)": lambda: vision_attention._vision_attention_triton(
                q, q, q, cu, HEAD_DIM**-0.5
            ),
        }
    return calls


def tower(device: str, dtype: torch.dtype, reps: int) -> None:
    """One Qwen3-VL tower call (the real shape on CUDA, bench/vision_tower.py's tiny one on the CPU)."""
    sys.path.insert(0, "bench")
    import vision_tower

    tiny = device == "cpu"
    hf, ours = vision_tower.build("qwen3_vl", device, dtype, tiny)
    pixel_values, grid_thw = vision_tower.images([112, 112] if tiny else [448], hf.config.vision_config.patch_size,
                                                 device)  # fmt: skip
    calls = {"hf": lambda: hf.model.visual(pixel_values.to(dtype), grid_thw=grid_thw)}
    calls |= {name: (lambda m=m: m.encode_images(pixel_values, grid_thw)) for name, m in ours.items()}
    with torch.inference_mode():
        for name, fn in calls.items():
            fn()
            profiler = cProfile.Profile()
            profiler.enable()
            fn()
            profiler.disable()
            python_calls = pstats.Stats(profiler).total_calls
            ms = host_us(fn, reps, device, busy=False) / 1e3
            print(f"tower {name:10s}: {python_calls:6d} Python calls, {ms:8.2f} ms host per call", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    tower(args.device, dtype if args.device == "cuda" else torch.float32, max(1, args.reps // 20))
    if args.device == "cpu":
        stub_kernels()
    torch.manual_seed(0)
    for name, fn in op_calls(args.device, dtype).items():
        print(f"{name:40s} {host_us(fn, args.reps, args.device):8.1f} us host per call", flush=True)


if __name__ == "__main__":
    main()
