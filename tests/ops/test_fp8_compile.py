"""The FP8 kernels compile for Hopper (sm_90) on this CPU machine, as tests/ops/test_hopper_compile.py does for the
others: the activation quantization, the FP8 matmul for every tile of its table (all wgmma; a 16-row tile and
max_num_imprecise_acc=0 give mma.sync), its TMA kernel (bulk tensor copies), and with the activation quantization
fused into it (still wgmma, and the quantization kernel's division and e4m3 conversion instructions), the grouped
FP8 expert matmul, and the KV paths with e4m3 caches (write_kv, the fused rotary write, attention). The
interpreter compiles nothing, so without this a kernel only a GPU build rejects would first fail on the GPU."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lockstep.ops import fp8, moe_fp8
    from lockstep.ops.attention import kernel, kv_cache
    from lockstep.ops.rotary import _rotary_kernel

    def compile_(fn, signature, constexprs, **options):
        signature = {**signature, **{name: "constexpr" for name in constexprs}}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        options = {**options, "launch_pdl": True} if constexprs.get("USE_PDL") else options
        try:
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        except FileNotFoundError as e:  # no ptxas
            raise SystemExit(f"SKIP {e}")
        assert "cubin" in kernel.asm, fn
        return kernel.asm["ptx"]

    def divisions(ptx):  # the fp32 division instructions a kernel's quantization compiles to
        return set(re.findall(r"div[.][a-z]+[.]f32", ptx))

    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
           **{p: "i32" for p in ("K", "stride_xm", "stride_qm", "stride_sm")}}
    for per_token in (True, False):
        flags = {"GROUP": 128, "GROUPS": 32 if per_token else 8, "PER_TOKEN": per_token, "USE_PDL": per_token}
        ptx = compile_(fp8._quantize_kernel, sig, flags)
    quantize_divisions = divisions(ptx)  # the per-group kernel's, which the fused matmul must share
    assert quantize_divisions, ptx[-2000:]
    sig = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "bias_ptr": "*bf16",
           "c_ptr": "*bf16", **{p: "i32" for p in ("M", "N", "K")},
           **{"stride_" + p: "i32" for p in ("am", "ak", "asm", "asg", "bk", "bn", "bsn", "bsg", "cm", "cn")},
           "num_programs": "i32"}
    def mma_rows(cfg):  # the rows the MMA computes: the tokens, or the weights' rows in a swapped tile
        return cfg.bn if cfg.swap else cfg.bm

    assert all(mma_rows(c) >= 64 for c in fp8.FP8_CONFIGS)  # the table stays on wgmma (ops.fp8.fp8_config says why)
    configs = [*fp8.FP8_CONFIGS, fp8.Fp8Config(16, 64, 64, imprecise_acc=0), fp8.Fp8Config(128, 128, imprecise_acc=0),
               fp8.Fp8Config(64, 32, blocks=4)]
    for cfg in configs:
        flags = {"HAS_BIAS": cfg.bm == 16, "UPCAST": False, "IMPRECISE_ACC": cfg.imprecise_acc, "QUANTIZE_A": False,
                 "A_ROWS": cfg.bm, "BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk, "GROUP_K": fp8.GROUP_K,
                 "GROUP_M": cfg.group_m, "BLOCKS": cfg.blocks, "SWAP": cfg.swap, "USE_PDL": True}
        ptx = compile_(fp8._fp8_mm_kernel, sig, flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        assert "e4m3" in ptx, cfg  # an e4m3 MMA, not an upcast
        # 16-row tiles run mma.sync, and so does max_num_imprecise_acc=0 (Triton's precise e4m3 dot on sm_90)
        assert ("wgmma" in ptx) == (mma_rows(cfg) >= 64 and cfg.imprecise_acc is None), cfg
    # The TMA kernel at every TMA tile of the table: an e4m3 wgmma fed by bulk tensor copies
    for cfg in (c for c in fp8.FP8_CONFIGS if c.tma):
        tma_sig = {"a_desc": f"tensordesc<fp8e4nv[{cfg.bm}, {cfg.bk}]>", "as_ptr": "*fp32",
                   "b_desc": f"tensordesc<fp8e4nv[{cfg.bn}, {cfg.bk}]>", "bs_ptr": "*fp32", "bias_ptr": "*bf16",
                   "c_desc": f"tensordesc<bf16[{cfg.bm}, {cfg.bn}]>", **{p: "i32" for p in ("M", "N", "K")},
                   **{"stride_" + p: "i32" for p in ("asm", "asg", "bsn", "bsg")}, "num_programs": "i32"}
        flags = {"HAS_BIAS": True, "UPCAST": False, "IMPRECISE_ACC": None, "BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk,
                 "GROUP_K": fp8.GROUP_K, "GROUP_M": cfg.group_m, "BLOCKS": cfg.blocks, "USE_PDL": True}
        ptx = compile_(fp8._fp8_mm_tma_kernel, tma_sig, flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        assert "wgmma" in ptx and "e4m3" in ptx and "cp.async.bulk.tensor" in ptx, cfg
    # The fused quantization (bf16 activations quantized in the A load), every table tile and a BK-64 one, whole
    # tiles and one row (M = 1): still an e4m3 wgmma, converting with the quantization kernel's instruction and
    # dividing with its divisions. One row quantizes one row: a handful of divisions, not one per element of the tile.
    for cfg in [*(c for c in fp8.FP8_CONFIGS if not c.swap), fp8.Fp8Config(64, 64, 64)]:  # a swapped tile: unfused
        for rows in (cfg.bm, 1):
            flags = {"HAS_BIAS": False, "UPCAST": False, "IMPRECISE_ACC": None, "QUANTIZE_A": True, "A_ROWS": rows,
                     "BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk, "GROUP_K": fp8.GROUP_K, "GROUP_M": cfg.group_m,
                     "BLOCKS": cfg.blocks, "SWAP": False, "USE_PDL": True}
            ptx = compile_(fp8._fp8_mm_kernel, {**sig, "a_ptr": "*bf16"}, flags, num_warps=cfg.num_warps,
                           num_stages=cfg.num_stages)
            assert "wgmma" in ptx and "e4m3" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx, (cfg, rows)
            assert divisions(ptx) == quantize_divisions, (cfg, rows, divisions(ptx), quantize_divisions)
            count = len(re.findall(r"div[.]full[.]f32", ptx))
            assert count <= 8 if rows == 1 else count >= cfg.bm * cfg.bk // (32 * cfg.num_warps), (cfg, rows, count)
    sig = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "a_rows_ptr": "*i64", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32",
           "c_ptr": "*bf16", **{p: "*i32" for p in ("tile_expert_ptr", "tile_start_ptr", "tile_end_ptr")},
           **{p: "i32" for p in ("N", "K", "num_experts")},
           **{"stride_" + p: "i32" for p in ("am", "asm", "asg", "be", "bn", "bse", "bsn", "bsg", "cm")}}
    for silu, bm in ((True, 64), (False, 128)):
        flags = {"GATHER_A": silu, "SILU_MUL": silu, "UPCAST": False, "BM": bm, "BN": 64, "BK": 64,
                 "GROUP_K": fp8.GROUP_K}
        assert "wgmma" in compile_(moe_fp8._grouped_fp8_kernel, sig, flags)
    sig = {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "slot_ptr": "*i32",
           **{p: "i32" for p in ("page_size", "num_heads", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                                 "stride_cb", "stride_cs", "stride_ch")}}
    compile_(kv_cache._write_kv_kernel, sig, {"HEAD_DIM": 128, "H_PAD": 8, "D_PAD": 128, "USE_PDL": True})
    sig = {**{p: "*bf16" for p in ("q_ptr", "k_ptr", "q_out_ptr", "cos_ptr", "sin_ptr", "v_ptr")},
           "k_out_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "slot_ptr": "*i64",
           **{p: "i32" for p in ("num_q_heads", "num_kv_heads", "stride_qt", "stride_kt", "stride_qot", "stride_kot",
                                 "stride_h", "stride_ct", "stride_vt", "page_size", "stride_cb", "stride_cs")}}
    compile_(_rotary_kernel, sig, {"HALF": 64, "QH_PAD": 32, "KH_PAD": 8, "TO_CACHE": True, "USE_PDL": True})
    strides = ("qt", "qh", "ot", "oh", "kb", "ks", "kh", "vb", "vs", "vh", "bt", "pt", "ps", "ph", "mt", "ms", "mh")
    sig = {"q_ptr": "*bf16", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "o_ptr": "*bf16", "part_ptr": "*fp32",
           "part_ml_ptr": "*fp32", **{p: "*i32" for p in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")},
           **{p: "i32" for p in ("num_seqs", "search_steps", "page_size", "inline_splits")}, "qk_scale": "fp32",
           **{"stride_" + p: "i32" for p in strides}}
    for decode in (True, False):
        flags = {"GROUP": 4, "BLOCK_M": 16 if decode else 128, "BLOCK_Q": 4 if decode else 32, "HEAD_DIM": 128,
                 "D_PAD": 128, "TILE": 64, "TILES_PER_SPLIT": 8, "SPLIT_PROGRAMS": decode, "UPCAST": False,
                 "PRECISION": "tf32", "ONE_PER_SEQ": decode, "HEADS_INNER": True, "NUM_KV_HEADS": 8,
                 "USE_PDL": True, "COL_GROUPS": 1, "COLS": 128, "IDS_AHEAD": decode, "SKIP_EMPTY": decode,
                 "KV_FP8": True}
        compile_(kernel._paged_attention_kernel, sig, flags)
    print("COMPILED")
    """
)


def test_fp8_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if done.stdout.startswith("SKIP") or done.stderr.startswith("SKIP"):
        pytest.skip(done.stdout + done.stderr)
    assert done.returncode == 0 and "COMPILED" in done.stdout, done.stderr[-3000:]
