"""An experiment for issue 27 item 2 (docs/design.md, "Attention", what is still missing): keep ptxas from moving a
warpgroup's wait for tile t - 1's P @ V up to just after its wait for tile t's scores, where it leaves the softmax
overlapping nothing of its own.

The probe builds ``gluon_prefill`` with one more wait, in inline PTX, predicated on a value the softmax computes (so
it cannot be scheduled before it; never false: ``VARIANTS`` says which values), in two variants. On the CPU
machine's sm_90 compile (Triton 3.6) most or all of the softmax then sits between the two waits, with no C751x
warning. On Hopper it checks each variant's bits against the Triton kernel (``attention_check.check_gluon``'s 16
prefill cases and the timed shapes) and times them against the landed kernel and SDPA.

    python bench/gluon_wait_probe.py
"""

import importlib.util
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import attention_check  # noqa: E402

from lockstep.ops.attention import SPLIT, TILE, gluon_prefill  # noqa: E402
from lockstep.ops.attention.launch import _paged_attention_triton  # noqa: E402

ANCHOR = "        m_new, p, alpha = _p_tile(s, t, m, pos, qk_scale, cols_s, dtype, TILE)\n"
# The wait, predicated on values never equal to that NaN's bits; ``alpha`` (a row's rescale, after its max) or the
# row sums of P (after every exp2). On the sm_90 compile the first leaves 32 of the softmax's 34 exp2 between the
# two waits (213 instructions), the second all 34 (328, the sums included).
WAIT = "{ .reg .pred q; setp.ne.b32 q, $1, 0x7fc00001; @q wgmma.wait_group.sync.aligned 0; mov.b32 $0, $1; }"
VARIANTS = {
    "after alpha": f'''        alpha = gl.inline_asm_elementwise(
            "{WAIT}", "=r,r", [alpha.to(gl.int32, bitcast=True)], dtype=gl.int32, is_pure=False, pack=1
        ).to(gl.float32, bitcast=True)
''',
    "after P's row sums": f'''        row_sums = gl.convert_layout(gl.sum(p.to(gl.float32), 1), alpha.type.layout)
        row_sums = gl.inline_asm_elementwise(
            "{WAIT}", "=r,r", [row_sums.to(gl.int32, bitcast=True)], dtype=gl.int32, is_pure=False, pack=1
        )
        alpha = gl.where(row_sums == 0x7FC00001, 0.0, alpha)
''',
}


def variant(name):
    source = Path(gluon_prefill.__file__).read_text()
    if source.count(ANCHOR) != 1:
        raise SystemExit("gluon_prefill changed: the line the probe's wait follows is gone")
    path = Path(tempfile.mkdtemp()) / "gluon_prefill_wait.py"
    path.write_text(source.replace(ANCHOR, ANCHOR + VARIANTS[name]))
    spec = importlib.util.spec_from_file_location("gluon_prefill_wait", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gluon_prefill


def main():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("needs a Hopper GPU")
    landed = gluon_prefill.gluon_prefill
    probes = {name: variant(name) for name in VARIANTS}
    hq, hkv, d, scale = 32, 8, 128, 128**-0.5
    cfg = dict(hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16, page=16, scale=scale)
    for name, probe in probes.items():
        print(f"\nthe wait {name}:", end=" ")
        gluon_prefill.gluon_prefill = probe  # the launch imports it at each call
        attention_check.check_gluon(cfg, "cuda", torch.Generator().manual_seed(0))
    gluon_prefill.gluon_prefill = landed
    print("\ncausal prefill: us (TFLOP/s)")
    for seqs, n in ((1, 4096), (1, 16384), (1, 32768), (8, 1024), (4, 2048), (2, 8192)):
        k = torch.randn(seqs * n // 16, 16, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(seqs * n, hq, d, device="cuda", dtype=torch.bfloat16)
        tables = torch.randperm(seqs * n // 16, device="cuda").int().view(seqs, -1)
        lens = torch.full((seqs,), n, device="cuda", dtype=torch.int32)
        starts = torch.arange(0, seqs * n + 1, n, device="cuda", dtype=torch.int32)
        args = (q, k, v, tables, lens, starts, scale * math.log2(math.e))
        flops = seqs * 4 * n * n * hq * d / 2
        ref = _paged_attention_triton(q, k, v, tables, lens, starts, scale, gluon=False)
        qs, ks, vs = (x.view(seqs, n, -1, d).transpose(1, 2) for x in (q, k, v))
        times = {"landed": attention_check.us(lambda: landed(*args, split=SPLIT, tile=TILE))}
        for name, probe in probes.items():
            if not torch.equal(probe(*args, split=SPLIT, tile=TILE), ref):
                attention_check.FAILURES.append(f"the wait {name} at {seqs} x {n} changed bits")
            times[name] = attention_check.us(lambda probe=probe: probe(*args, split=SPLIT, tile=TILE))
        times.update(
            {
                "SDPA": attention_check.us(
                    lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
                ),
            }
        )
        print(f"  {seqs} x {n:5d}  " + "  ".join(f"{k} {t:8.1f} ({flops / t / 1e6:5.1f})" for k, t in times.items()))
    print("FAILURES: " + ("; ".join(attention_check.FAILURES) or "none"))
    sys.exit(1 if attention_check.FAILURES else 0)


if __name__ == "__main__":
    main()
