"""Triton kernels compile for Hopper (sm_90) on this CPU machine: the sampler's and every layer kernel of a decode step,
with and without programmatic dependent launch (``LOCKSTEP_PDL``).
The other tests run kernels through the interpreter, which compiles nothing, so a kernel that only a GPU build
rejects would first fail on a GPU, on every request. The compile runs in a process of its own without
``TRITON_INTERPRET`` (the interpreter patches ``triton.language``); Triton's wheel brings ptxas, and without a
CUDA toolchain the test skips."""

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

    from lockstep.ops import gated, gumbel, matmul, top_p
    from lockstep.ops.attention import kernel, kv_cache
    from lockstep.ops.rms_norm import _rms_norm_kernel
    from lockstep.ops.rotary import _rotary_kernel
    from lockstep.ops.softmax import _softmax_kernel

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
        return kernel.asm["ptx"]

    sig = {"x_ptr": "*fp32", "keys_ptr": "*i64", "part_best_ptr": "*fp64", "part_id_ptr": "*i32", "vocab": "i32",
           "stride": "i32", "num_chunks": "i32", "golden": "u64", "m1": "u64", "m2": "u64"}
    for noise in (True, False):
        flags = {"NOISE": noise, "CHUNK": gumbel.CHUNK, "BLOCK": gumbel.BLOCK}
        compile_(gumbel._gumbel_argmax_kernel, sig, flags)
    sig = {"part_best_ptr": "*fp64", "part_id_ptr": "*i32", "token_ptr": "*i64", "best_ptr": "*fp64", "vocab": "i32",
           "num_chunks": "i32"}
    compile_(gumbel._combine_kernel, sig, {"BLOCK_C": 32})
    sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "stats_ptr": "*fp32",
           **{p: "i32" for p in ("M", "N", "stride_xm", "stride_om")}}
    for stats in (False, True):  # the sampler's vocabulary-wide log_softmax, whole or row stats
        compile_(_softmax_kernel, sig, {"LOG": True, "STATS": stats, "SINGLE": False, "ROWS": 2, "BLOCK": 1024})
    sig = {"sorted_ptr": "*fp32", "top_p_ptr": "*fp32", "cut_ptr": "*fp32", "vocab": "i32", "stride": "i32"}
    compile_(top_p._top_p_cut_kernel, sig, {"BLOCK": top_p.BLOCK})
    sig = {**{p: "*bf16" for p in ("x_ptr", "r_ptr", "w_ptr", "w2_ptr", "out_ptr", "h_ptr")}, "rstd_ptr": "*fp32",
           **{p: "i32" for p in ("M", "N", "heads", "split", "stride_xt", "stride_xm", "stride_rm", "stride_om",
                                 "stride_hm")},
           "n_float": "fp32", "eps": "fp32"}
    for residual, single, rows, block in ((False, True, 16, 128), (True, False, 1, 1024)):
        flags = {"HAS_RESIDUAL": residual, "HAS_WEIGHT": True, "TWO_WEIGHTS": single, "SINGLE": single, "ROWS": rows,
                 "BLOCK": block, "USE_PDL": residual}
        compile_(_rms_norm_kernel, sig, flags)
    strides = ("qt", "qh", "ot", "oh", "kb", "ks", "kh", "vb", "vs", "vh", "bt", "pt", "ps", "ph", "mt", "ms", "mh")
    sig = {**{p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}, "part_ptr": "*fp32", "part_ml_ptr": "*fp32",
           **{p: "*i32" for p in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")},
           **{p: "i32" for p in ("num_seqs", "search_steps", "page_size", "inline_splits")}, "qk_scale": "fp32",
           **{"stride_" + p: "i32" for p in strides}}
    for split_programs, one_per_seq in ((True, True), (False, True), (True, False), (False, False)):
        flags = {"GROUP": 4, "BLOCK_M": 16, "BLOCK_Q": 4, "HEAD_DIM": 128, "D_PAD": 128, "TILE": 64,
                 "TILES_PER_SPLIT": 8, "SPLIT_PROGRAMS": split_programs, "UPCAST": False, "PRECISION": "tf32",
                 "ONE_PER_SEQ": one_per_seq, "HEADS_INNER": split_programs, "NUM_KV_HEADS": 8, "USE_PDL": one_per_seq,
                 "COL_GROUPS": 4 if one_per_seq else 1, "COLS": 32 if one_per_seq else 128, "IDS_AHEAD": one_per_seq,
                 "SKIP_EMPTY": split_programs and one_per_seq, "KV_FP8": False}
        compile_(kernel._paged_attention_kernel, sig, flags)
    sig = {"part_ptr": "*fp32", "part_ml_ptr": "*fp32", "o_ptr": "*bf16", "seq_lens_ptr": "*i32",
           "query_start_loc_ptr": "*i32", **{p: "i32" for p in ("num_seqs", "search_steps", "inline_splits")},
           **{"stride_" + p: "i32" for p in ("pt", "ps", "ph", "mt", "ms", "mh", "ot", "oh")}}
    for pdl, heads, chunk in ((False, 32, 1), (True, 1, 4), (True, 4, 8)):
        flags = {"NUM_HEADS": 32, "HEADS": heads, "HEAD_DIM": 128, "D_PAD": 128, "SPLIT_SIZE": 512,
                 "ONE_PER_SEQ": True, "CHUNK": chunk, "USE_PDL": pdl}
        assert "fma.rn.f32" in compile_(kernel._merge_splits_kernel, sig, flags)
    sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "width": "i32", "stride_x": "i32", "stride_o": "i32"}
    for pdl in (False, True):
        compile_(gated._silu_and_mul_kernel, sig, {"BLOCK": gated.BLOCK, "LIBDEVICE": True, "USE_PDL": pdl})
    sig = {**{p: "*bf16" for p in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}, "slot_ptr": "*i32",
           **{p: "i32" for p in ("page_size", "num_heads", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                                 "stride_cb", "stride_cs", "stride_ch")}}
    for pdl in (False, True):
        compile_(kv_cache._write_kv_kernel, sig, {"HEAD_DIM": 128, "H_PAD": 8, "D_PAD": 128, "USE_PDL": pdl})
    sig = {**{p: "*bf16" for p in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "cos_ptr", "sin_ptr", "v_ptr",
                                   "v_cache_ptr")}, "slot_ptr": "*i64",
           **{p: "i32" for p in ("num_q_heads", "num_kv_heads", "stride_qt", "stride_kt", "stride_qot", "stride_kot",
                                 "stride_h", "stride_ct", "stride_vt", "page_size", "stride_cb", "stride_cs")}}
    for pdl in (False, True):
        compile_(_rotary_kernel, sig, {"HALF": 64, "QH_PAD": 32, "KH_PAD": 8, "TO_CACHE": pdl, "USE_PDL": pdl})
    sig = {**{p: "*bf16" for p in ("a_ptr", "b_ptr", "bias_ptr", "c_ptr")}, **{p: "i32" for p in ("M", "N", "K")},
           **{"stride_" + p: "i32" for p in ("ab", "am", "ak", "bb", "bk", "bn", "cb", "cm", "cn")},
           "alpha": "fp32", "beta": "fp32", "num_programs": "i32"}
    for pdl in (False, True):
        flags = {"HAS_BIAS": False, "SCALED": False, "EVEN_K": True, "UPCAST": False, "PRECISION": "tf32", "BM": 16,
                 "BN": 64, "BK": 256, "GROUP_M": 8, "FLAT": False, "USE_PDL": pdl}
        compile_(matmul._mm_kernel, sig, flags)
        compile_(matmul._mm_kernel, sig, {**flags, "FLAT": True})
    print("COMPILED")
    """
)


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    if done.stdout.startswith("SKIP") or done.stderr.startswith("SKIP"):
        pytest.skip(done.stdout + done.stderr)
    assert done.returncode == 0 and "COMPILED" in done.stdout, done.stderr[-3000:]
