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
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from lockstep.ops.attention import gluon_prefill

    fn = gluon_prefill._gluon_prefill_kernel
    sig = {a: "*bf16" if a in ("q_ptr", "k_ptr", "v_ptr", "o_ptr") else "*i32" if a.endswith("_ptr")
           else "fp32" if a == "qk_scale" else "i32" for a in fn.arg_names}
    consts = dict(GROUP=4, BLOCK_M=128, BLOCK_Q=32, D=128, TILE=64, TILES_PER_SPLIT=8, NUM_KV_HEADS=8, STAGES=3,
                  AHEAD=1, num_warps=8)
    sig.update({k: "constexpr" for k in consts})
    aligned = [a for a in fn.arg_names if a.endswith("_ptr") or a.startswith("stride_") or a == "page_size"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    try:
        kernel = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    except FileNotFoundError as e:  # no ptxas
        raise SystemExit(f"SKIP {e}")
    ptx = kernel.asm["ptx"]
    assert "cubin" in kernel.asm
    # tile t's scores are waited for while tile t - 1's P @ V and denominator stay in flight
    assert "wgmma.wait_group.sync.aligned 2;" in ptx
    assert "cp.async" in ptx
    print("COMPILED")
    """
)


def test_gluon_prefill_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    if done.stdout.startswith("SKIP") or done.stderr.startswith("SKIP"):
        pytest.skip(done.stdout + done.stderr)
    assert done.returncode == 0 and "COMPILED" in done.stdout, done.stderr[-3000:]


def _call(dtype=torch.bfloat16, head_dim=128, cache_dtype=None, cuda=True):
    q = SimpleNamespace(is_cuda=cuda, shape=(100, 32, head_dim), dtype=dtype, device=torch.device("cuda", 0))
    return q, SimpleNamespace(dtype=cache_dtype or dtype)


def test_gluon_route_takes_hopper_prefill_walks_only(monkeypatch) -> None:
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "_gluon_device", lambda index: True)
    monkeypatch.delenv(launch.GLUON_ENV, raising=False)
    q, cache = _call()
    assert not launch._use_gluon(q, cache, decode=False, split_programs=False, block_m=128)  # opt-in
    monkeypatch.setenv(launch.GLUON_ENV, "1")
    assert launch._use_gluon(q, cache, decode=False, split_programs=False, block_m=128)
    assert not launch._use_gluon(q, cache, decode=True, split_programs=False, block_m=128)
    assert not launch._use_gluon(q, cache, decode=False, split_programs=True, block_m=128)
    assert not launch._use_gluon(q, cache, decode=False, split_programs=False, block_m=64)
    assert not launch._use_gluon(*_call(head_dim=64), decode=False, split_programs=False, block_m=128)
    assert not launch._use_gluon(*_call(dtype=torch.float32), decode=False, split_programs=False, block_m=128)
    fp8 = _call(cache_dtype=torch.float8_e4m3fn)
    assert not launch._use_gluon(*fp8, decode=False, split_programs=False, block_m=128)
    assert not launch._use_gluon(*_call(cuda=False), decode=False, split_programs=False, block_m=128)
    monkeypatch.setattr(launch, "_gluon_device", lambda index: False)  # not Hopper, another Triton, no Gluon
    assert not launch._use_gluon(q, cache, decode=False, split_programs=False, block_m=128)


def test_gluon_route_refuses_launches_it_cannot_run() -> None:
    q = torch.zeros(4, 4, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 1, 128, dtype=torch.bfloat16)
    args = (q, cache, cache, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
            torch.tensor([0, 4], dtype=torch.int32), 0.1)  # fmt: skip
    with pytest.raises(ValueError, match="BLOCK_M 128"):
        launch._paged_attention_triton(*args, gluon=True, block_m=64)
