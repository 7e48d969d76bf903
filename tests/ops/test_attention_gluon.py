"""The Gluon prefill kernel (``ops/attention/gluon_prefill.py``): the GPU is where its bits are checked
(bench/attention_check.py on the H200 compares it with the Triton kernel launch by launch); here, that it compiles
for Hopper with its MMAs overlapped, and which calls take it."""

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from lockstep.ops.attention import launch

SCRIPT = textwrap.dedent(
    """
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from lockstep.ops.attention import gluon_prefill

    fn = gluon_prefill._gluon_prefill_kernel
    layout = gl.NVMMASharedLayout.get_default_for([16, 64], gl.bfloat16)
    sig = {a: f"tensordesc<bf16[16, 64],{layout!r}>" if a.endswith("_desc") else "*bf16" if a in ("q_ptr", "o_ptr")
           else "*i32" if a.endswith("_ptr") else "fp32" if a == "qk_scale" else "i32" for a in fn.arg_names}
    consts = dict(GROUP=4, BLOCK_Q=32, D=128, TILE=64, ROWS=16, TILES_PER_SPLIT=8, NUM_KV_HEADS=8, STAGES=3,
                  CONSUMER_REGS=240, PRODUCER_REGS=32)
    sig.update({k: "constexpr" for k in consts})
    aligned = [a for a in fn.arg_names if a.endswith("_ptr") or a.startswith("stride_") or a == "page_size"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    try:
        kernel = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except FileNotFoundError as e:  # no ptxas
        raise SystemExit(f"SKIP {e}")
    ptx = kernel.asm["ptx"]
    assert "cubin" in kernel.asm
    # two consumer warpgroups and the producer, registers moved to the consumers
    regs = re.findall(r"setmaxnreg\\.(inc|dec)\\.sync\\.aligned\\.u32\\s+(\\d+);", ptx)
    assert ".reqntid 384" in ptx and ("dec", "32") in regs and ("inc", "240") in regs, regs
    # each consumer waits for tile t's scores while tile t - 1's P @ V (two calls) and denominator stay in flight
    assert re.findall(r"wgmma\\.wait_group\\.sync\\.aligned\\s+(\\d+);", ptx).count("3") == 2
    assert "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx
    # ptxas keeps the MMAs asynchronous (it serializes them, warning C7513/C7514, where a non-MMA instruction
    # touches an MMA's registers while its batch is in flight)
    import subprocess, tempfile
    from triton.backends.nvidia import compiler
    ptxas = compiler.get_ptxas(90) if "arch" in compiler.get_ptxas.__code__.co_varnames else compiler.get_ptxas()
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        done = subprocess.run([ptxas.path, "-arch=sm_90a", "-v", f.name, "-o", f.name + ".cubin"],
                              capture_output=True, text=True)
    assert done.returncode == 0 and "Used" in done.stderr and "C751" not in done.stderr, done.stderr
    print("COMPILED")
    """
)


def test_gluon_prefill_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    if done.stdout.startswith("SKIP") or done.stderr.startswith("SKIP"):
        pytest.skip(done.stdout + done.stderr)
    assert done.returncode == 0 and "COMPILED" in done.stdout, done.stderr[-3000:]


def _tensors(head_dim=128, dtype=torch.bfloat16, cache_dtype=None, page=16, heads=(32, 8)):
    q = torch.zeros(4, heads[0], head_dim, dtype=dtype)
    cache = torch.zeros(3, page, heads[1], head_dim, dtype=cache_dtype or dtype)
    return q, cache, cache


def test_gluon_prefill_says_what_it_cannot_run() -> None:
    from lockstep.ops.attention.gluon_prefill import unsupported

    assert unsupported(*_tensors(), 64) is None
    for page in (8, 32, 64, 128, 256):
        assert unsupported(*_tensors(page=page), 64) is None
    assert "head_dim 128" in unsupported(*_tensors(head_dim=64), 64)
    assert "16-bit" in unsupported(*_tensors(dtype=torch.float32), 64)
    assert "16-bit" in unsupported(*_tensors(cache_dtype=torch.float8_e4m3fn), 64)
    assert "GQA group" in unsupported(*_tensors(heads=(24, 8)), 64)
    assert "page" in unsupported(*_tensors(page=4), 64)
    assert "page" in unsupported(*_tensors(page=48), 64)
    q, cache, _ = _tensors()
    hnd = torch.zeros(3, 8, 16, 128, dtype=torch.bfloat16).transpose(1, 2)  # heads outside the slots
    assert "evenly strided" in unsupported(q, hnd, hnd, 64)
    half_pages = torch.zeros(3, 32, 8, 128, dtype=torch.bfloat16)[:, :16]  # blocks 32 slots apart
    assert "evenly strided" in unsupported(q, cache, half_pages, 64)


def test_gluon_route_takes_hopper_prefill_walks_only(monkeypatch) -> None:
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "_gluon_device", lambda index: True)
    monkeypatch.delenv(launch.GLUON_ENV, raising=False)
    q = SimpleNamespace(is_cuda=True, shape=(100, 32, 128), dtype=torch.bfloat16, device=torch.device("cuda", 0))
    cache = torch.zeros(3, 16, 8, 128, dtype=torch.bfloat16)

    def route(q=q, cache=cache, decode=False, split_programs=False, block_m=128):
        return launch._use_gluon(q, cache, cache, decode, split_programs, block_m)

    assert route()  # on by default
    monkeypatch.setenv(launch.GLUON_ENV, "0")
    assert not route()
    monkeypatch.setenv(launch.GLUON_ENV, "1")
    assert route()
    assert not route(decode=True)
    assert not route(split_programs=True)
    assert not route(block_m=64)
    assert not route(q=SimpleNamespace(**{**vars(q), "shape": (100, 32, 64)}), cache=cache[..., :64])
    assert not route(cache=cache.to(torch.float8_e4m3fn))  # gluon_prefill.unsupported
    assert not route(q=SimpleNamespace(**{**vars(q), "is_cuda": False}))
    monkeypatch.setattr(launch, "_gluon_device", lambda index: False)  # not Hopper, another Triton, no Gluon
    assert not route()


def test_gluon_route_refuses_launches_it_cannot_run() -> None:
    q = torch.zeros(4, 4, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 1, 128, dtype=torch.bfloat16)
    args = (q, cache, cache, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
            torch.tensor([0, 4], dtype=torch.int32), 0.1)  # fmt: skip
    with pytest.raises(ValueError, match="BLOCK_M 128"):
        launch._paged_attention_triton(*args, gluon=True, block_m=64)


def test_wait_probe_builds_its_variant() -> None:
    # bench/gluon_wait_probe.py patches gluon_prefill's source at one line; if the kernel moves on, it must say so
    script = (
        "import sys; sys.path.insert(0, 'bench'); import gluon_wait_probe as g; "
        "print([g.variant(v).__name__ for v in g.VARIANTS])"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "gluon_prefill" in done.stdout, done.stderr[-2000:]
