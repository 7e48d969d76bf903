"""The vision ops' Triton kernels (layer_norm, vision_attention) compile for Hopper (sm_90) on this CPU machine, as
tests/ops/test_hopper_compile.py does for the text path's kernels: the other tests run them through the
interpreter, which compiles nothing. In a process of its own without ``TRITON_INTERPRET``; skips without ptxas."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lockstep.ops.layer_norm import _layer_norm_kernel
    from lockstep.ops.vision_attention import _vision_attention_kernel

    def compile_(fn, signature, constexprs):
        signature = {**signature, **{name: "constexpr" for name in constexprs}}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        options = {"launch_pdl": True} if constexprs.get("USE_PDL") else {}
        try:
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        except FileNotFoundError as e:  # no ptxas
            raise SystemExit(f"SKIP {e}")
        assert "cubin" in kernel.asm, fn
        assert ("griddepcontrol.wait" in kernel.asm["ptx"]) == bool(constexprs.get("USE_PDL")), fn

    sig = {**{p: "*bf16" for p in ("x_ptr", "w_ptr", "b_ptr", "out_ptr")},
           **{p: "i32" for p in ("M", "N", "stride_xm", "stride_om")}, "n_float": "fp32", "eps": "fp32"}
    for single, rows, block, pdl in ((True, 1, 2048, True), (False, 1, 4096, False)):
        flags = {"HAS_WEIGHT": True, "HAS_BIAS": single, "SINGLE": single, "ROWS": rows, "BLOCK": block,
                 "USE_PDL": pdl}
        compile_(_layer_norm_kernel, sig, flags)
    strides = ("qt", "qh", "kt", "kh", "vt", "vh", "ot", "oh")
    for dtype, precision, head_dim in (("bf16", "tf32", 72), ("fp32", "ieee", 80)):
        sig = {**{p: "*" + dtype for p in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}, "cu_ptr": "*i32",
               "num_segments": "i32", "search_steps": "i32", "qk_scale": "fp32",
               **{"stride_" + p: "i32" for p in strides}}
        flags = {"HEAD_DIM": head_dim, "D_PAD": 128, "BLOCK_M": 64, "TILE": 64, "UPCAST": False,
                 "PRECISION": precision, "USE_PDL": dtype == "bf16"}
        compile_(_vision_attention_kernel, sig, flags)
    print("COMPILED")
    """
)


def test_vision_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    if done.stdout.startswith("SKIP") or done.stderr.startswith("SKIP"):
        pytest.skip(done.stdout + done.stderr)
    assert done.returncode == 0 and "COMPILED" in done.stdout, done.stderr[-3000:]
