"""The trainer's backward kernels compile for Hopper (sm_90) on this CPU machine: the attention backward
(ops.attention.backward) at Qwen3's head_dim 128 in bf16 with the launch's 8 warps and without spilling registers
(4 warps spilled), the SiLU-and-mul backward (ops.gated_backward) and RMSNorm's (ops.rms_norm_backward). The other
tests run them through the interpreter, which compiles nothing. In a process of its own without
``TRITON_INTERPRET``; skips without ptxas."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lockstep.ops.attention import backward as B
    from lockstep.ops.gated_backward import _silu_and_mul_backward_kernel
    from lockstep.ops.rms_norm_backward import _rms_norm_backward_kernel

    CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

    def compile_(fn, pointers, ints, floats, blocks, attention=True, warps=B._WARPS, extra=None):
        signature = {**{p: "*bf16" for p in pointers}, **{i: "i32" for i in ints}, **{f: "fp32" for f in floats},
                     **(extra or {})}
        constexprs = dict(blocks)
        if attention:
            signature |= {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "blocks_ptr": "*i32"}
            constexprs |= dict(GROUP=4, HEAD_DIM=128, D_PAD=128, UPCAST=False, PRECISION="tf32")
        signature |= {name: "constexpr" for name in constexprs}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        options = {"num_warps": warps, "launch_pdl": "USE_PDL" in constexprs}
        try:
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        except FileNotFoundError as e:  # no ptxas
            raise SystemExit(f"SKIP {e}")
        assert "cubin" in kernel.asm, fn
        if os.path.exists(CUOBJDUMP):  # the registers' spill area: STACK:0
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True,
                                       text=True).stdout
            assert "STACK:0 " in usage, (fn, usage)

    strides = lambda *names: [f"stride_{n}{x}" for n in names for x in "th"]
    compile_(B._stats_kernel, ("q_ptr", "k_ptr", "o_ptr", "do_ptr"), ["total", *strides("q", "k", "o", "do")],
             ["qk_scale"], {"BLOCK_M": B._STATS_M, "BLOCK_N": B._STATS_N})
    compile_(B._dkdv_kernel, ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dk_ptr", "dv_ptr"),
             ["total", *strides("q", "k", "v", "do", "dk", "dv")], ["qk_scale", "scale"],
             {"BLOCK_M": B._DKDV_M, "BLOCK_N": B._DKDV_N})
    compile_(B._dq_kernel, ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dq_ptr"),
             ["total", *strides("q", "k", "v", "do", "dq")], ["qk_scale", "scale"],
             {"BLOCK_M": B._DQ_M, "BLOCK_N": B._DQ_N})
    compile_(_silu_and_mul_backward_kernel, ("x_ptr", "g_ptr", "out_ptr"), ["width", "stride_x", "stride_g",
             "stride_o"], [], {"BLOCK": 1024, "USE_PDL": True}, attention=False, warps=4)
    for width, has_gh in ((4096, True), (128, False)):  # the decoder's norms, Qwen3's per-head q/k norms
        compile_(_rms_norm_backward_kernel, ("h_ptr", "g_ptr", "gh_ptr", "w_ptr", "dh_ptr"), ["rows", "n"], ["eps"],
                 {"HAS_WEIGHT": True, "HAS_GH": has_gh, "ROWS": 16, "BLOCK": width}, attention=False,
                 warps=8 if width >= 2048 else 4, extra={"dw_ptr": "*fp32"})
    print("COMPILED")
    """
)


def test_trainer_backward_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    if done.stdout.startswith("SKIP") or done.stderr.startswith("SKIP"):
        pytest.skip(done.stdout + done.stderr)
    assert done.returncode == 0 and "COMPILED" in done.stdout, done.stderr[-3000:]
