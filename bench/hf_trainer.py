"""The patched transformers model (lockstep.rl.hf) on a GPU: its logprobs against the engine's sampled ones, bit for
bit, per family in bf16, and its forward + backward time against the same model on transformers' own kernels.

    python bench/hf_trainer.py --check                 # bits: every family, padded left/right and packed
    python bench/hf_trainer.py --time --layers 4       # Qwen3-8B shape cut to 4 layers, 16 x 1024 tokens
    python bench/hf_trainer.py --time --profile --components   # and why: kernels by kind, pieces of a layer alone
    python bench/hf_trainer.py --time --profile --components --tiny   # the same on a tiny Qwen3, on the CPU
"""

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import torch

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                   "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}  # fmt: skip


def _save(folder: Path, family: str, seed: int = 0, **shape) -> Path:
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    kwargs = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  eos_token_id=1023, bos_token_id=None) | extra | shape  # fmt: skip
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(
                1.0 + 0.1 * noise if "norm" in name else (0.1 * noise if "bias" in name else noise / p.shape[-1] ** 0.5)
            )
    model.save_pretrained(folder)
    return folder


def check(device: str) -> bool:
    from transformers import AutoModelForCausalLM

    from lockstep import LLM, SamplingParams
    from lockstep.rl.hf import patch_model

    prefix = [(5 * j + 3) % 1000 for j in range(40)]
    prompts = [prefix + [1, 2, 3], [40], [(7 * j) % 1000 for j in range(150)], prefix[:17], prefix + [9]]
    ok = True
    for family in FAMILIES:
        with tempfile.TemporaryDirectory() as tmp:
            folder = _save(Path(tmp), family)
            llm = LLM(tmp, dtype="bfloat16", device=device, max_num_seqs=4, max_num_batched_tokens=64)
            params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True) for i in range(5)]
            outs = llm.generate(prompts, params, use_tqdm=False)
            llm.close()
            samples = [(p, o.token_ids, torch.tensor(o.token_logprobs)) for p, o in zip(prompts, outs, strict=True)]
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device)
            diffs = {}
            for name in ("unpatched", "left", "right", "packed"):
                if name == "left":
                    patch_model(model)
                diffs[name] = _max_diff(model, samples, "right" if name == "unpatched" else name, device)
            ok &= diffs["left"] == diffs["right"] == diffs["packed"] == 0.0 and diffs["unpatched"] > 0
            print(f"{family:10s} " + " ".join(f"{k} {v!r}" for k, v in diffs.items()), flush=True)
    return ok


def _max_diff(model, samples, layout: str, device: str) -> float:
    from lockstep.rl.hf import selective_log_softmax

    seqs = [p + c[:-1] for p, c, _ in samples]
    with torch.no_grad():
        if layout == "packed":
            ids = torch.tensor([sum(seqs, [])], device=device)
            pos = torch.tensor([[j for s in seqs for j in range(len(s))]], device=device)
            targets = torch.tensor([[t for p, c, _ in samples for t in p[1:] + c]], device=device)
            lp = selective_log_softmax(model(input_ids=ids, position_ids=pos).logits, targets)[0].cpu()
            rows, offset = [], 0
            for (p, _, _), s in zip(samples, seqs, strict=True):
                rows.append(lp[offset + len(p) - 1 : offset + len(s)])
                offset += len(s)
        else:
            width = max(len(s) for s in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.int64)
            mask = torch.zeros_like(ids)
            first = []
            for i, s in enumerate(seqs):
                start = width - len(s) if layout == "left" else 0
                ids[i, start : start + len(s)] = torch.tensor(s)
                mask[i, start : start + len(s)] = 1
                first.append(start)
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            rows = []
            for i, (p, c, _) in enumerate(samples):
                r = torch.arange(first[i] + len(p) - 1, first[i] + len(p) - 1 + len(c), device=device)
                rows.append(selective_log_softmax(logits[i, r], torch.tensor(c, device=device)).cpu())
    return max(float((r - want).abs().max()) for r, (_, _, want) in zip(rows, samples, strict=True))


QWEN3_8B_SHAPE = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      rms_norm_eps=1e-6)  # fmt: skip
TINY_SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6)  # fmt: skip


class _Clock:
    """Wall time of device work: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3


def _best(fn, repeats: int = 3) -> tuple[float, float]:
    """The fastest of ``repeats`` runs (after one warm-up) of ``fn() -> (forward ms, backward ms)``, by their sum."""
    fn()
    return min((fn() for _ in range(repeats)), key=sum)


def _trainer_model(device: torch.device, layers: int, tiny: bool):
    import transformers

    shape = TINY_SHAPE if tiny else QWEN3_8B_SHAPE
    config = transformers.Qwen3Config(num_hidden_layers=layers, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    return model, config


def timing(device: str, layers: int, seqs: int, seq_len: int, profile: bool = False, tiny: bool = False) -> None:
    """Forward and backward of the base model (no head), transformers' kernels (SDPA, a padded [seqs, seq_len]
    batch) against the patched model (a packed [1, seqs * seq_len] batch), each timed on its own; ``profile``: the
    kernels of one step of each, by device time, forward and backward apart."""
    from lockstep.rl.hf import is_patched, patch_model

    dev = torch.device(device)
    model, config = _trainer_model(dev, layers, tiny)
    clock = _Clock(dev)
    ids = torch.randint(0, config.vocab_size, (seqs, seq_len), device=dev)
    packed = ids.reshape(1, -1)
    pos = torch.arange(seq_len, device=dev).repeat(seqs)[None]

    def forward(patched: bool) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        if patched:
            hidden = model.model(input_ids=packed, position_ids=pos).last_hidden_state
        else:
            hidden = model.model(input_ids=ids).last_hidden_state  # sdpa, causal: the same attention work
        return hidden.float().square().mean()

    def step(patched: bool) -> tuple[float, float]:
        t0 = clock.mark()
        loss = forward(patched)
        t1 = clock.mark()
        loss.backward()
        t2 = clock.mark()
        return clock.ms(t0, t1), clock.ms(t1, t2)

    from lockstep.rl import attention

    _note_cpu_triton(dev)
    name = "tiny Qwen3" if tiny else "Qwen3-8B shape"
    print(f"{name}, {layers} layers, {seqs} x {seq_len} tokens, bf16, {dev.type}, forward + backward of the "
          "backbone (no head):", flush=True)  # fmt: skip
    base = None
    # transformers' kernels; the patched model with each attention backward (rl.attention.BACKWARD)
    for label, backward in (("transformers (SDPA)", None), ("lockstep, reference attention backward", "reference"),
                            ("lockstep, Triton attention backward", "triton")):  # fmt: skip
        patched = backward is not None
        if patched and not is_patched(model):
            patch_model(model)
        saved, attention.BACKWARD = attention.BACKWARD, backward or attention.BACKWARD
        try:
            timed = _guarded(label, lambda p=patched: _best(lambda: step(p)))
            if timed is None:
                continue
            fwd, bwd = timed
            if profile:
                _profile_step(lambda p=patched: forward(p), dev, label)
        finally:
            attention.BACKWARD = saved
        base = base or (fwd, bwd)
        print(f"  {label:<40} forward {fwd:8.1f} + backward {bwd:8.1f} = {fwd + bwd:8.1f} ms; against transformers: "
              f"forward {fwd / base[0]:.2f}, backward {bwd / base[1]:.2f}, step {(fwd + bwd) / sum(base):.2f}",
              flush=True)  # fmt: skip


# Kernel names -> what they compute (first match wins), for the profile's summary.
_KINDS = [
    ("attention", ("attention", "attn", "flash", "fmha", "sdpa", "softmax")),
    ("matmul", ("gemm", "mm", "matmul", "cutlass", "xmma", "nvjet", "linear")),
    ("norm", ("rms", "norm")),
    ("copy / index", ("copy", "memcpy", "memset", "cat", "index", "scatter", "gather", "fill", "zero")),
    ("reduce", ("reduce", "sum", "mean")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "silu", "sigmoid", "mul", "add", "rsqrt", "exp", "pow")),
]


def _kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in _KINDS if any(k in low for k in keys)), "other")


def _profile_step(forward, device: torch.device, label: str, top: int = 12) -> None:
    """One step, ``forward()`` (-> the loss) and its backward, each under a torch.profiler of its own: the device time
    of each kind of kernel and the top kernels by self device time (on the CPU: the aten ops by self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof_forward:
        loss = forward()
        if cuda:
            torch.cuda.synchronize()
    with profile(activities=activities) as prof_backward:
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
    for phase, prof in (("forward", prof_forward), ("backward", prof_backward)):
        _print_profile(prof, cuda, f"{label}, {phase}", top)


def _print_profile(prof, cuda: bool, title: str, top: int) -> None:
    from torch.autograd import DeviceType

    rows = []
    for evt in prof.key_averages():
        if cuda:
            if evt.device_type != DeviceType.CUDA:
                continue
            us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        else:
            if not evt.key.startswith("aten::"):
                continue
            us = evt.self_cpu_time_total
        if us > 0:
            rows.append((us, evt.count, evt.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows) or 1.0
    kinds: dict[str, float] = {}
    for us, _, key in rows:
        kinds[_kind(key)] = kinds.get(_kind(key), 0.0) + us
    by_time = sorted(kinds.items(), key=lambda kv: -kv[1])
    summary = ", ".join(f"{k} {v / 1e3:.1f} ms ({v / total:.0%})" for k, v in by_time)
    what = "kernels" if cuda else "aten ops, CPU self time"
    print(f"-- {title}: {total / 1e3:.1f} ms of {what}; {summary}", flush=True)
    for us, count, key in rows[:top]:
        print(f"   {us / 1e3:9.2f} ms {us / total:5.1%} x{count:<5d} [{_kind(key)}] {key[:110]}", flush=True)


def components(device: str, seqs: int, seq_len: int, tiny: bool = False) -> None:
    """Each piece of a decoder layer alone, forward and backward, at the step's token count: lockstep's trainer
    kernels (what the patched layer calls) against what transformers' layer calls, so a ratio above 1 points at the
    piece that makes the step slower."""
    import torch.nn.functional as F
    import transformers
    from torch import nn
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

    from lockstep.layers.rotary import RotaryEmbedding
    from lockstep.rl.hf.batch import PAGE, flat_layout
    from lockstep.rl.hf.layers import K, linear, stacked_linear

    dev = torch.device(device)
    shape = TINY_SHAPE if tiny else QWEN3_8B_SHAPE
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    tokens = seqs * seq_len
    dtype = torch.bfloat16
    clock = _Clock(dev)
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*size, grad: bool = True) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=dev, dtype=dtype).requires_grad_(grad)

    def lin(n: int, k: int) -> nn.Linear:
        m = nn.Linear(k, n, bias=False, device=dev, dtype=dtype)
        with torch.no_grad():
            m.weight.normal_(0, k**-0.5, generator=gen)
        return m

    q, kp, vp, o = lin(heads * head_dim, hidden), lin(kv_heads * head_dim, hidden), lin(kv_heads * head_dim, hidden), \
        lin(hidden, heads * head_dim)  # fmt: skip
    gate, up, down = lin(inter, hidden), lin(inter, hidden), lin(hidden, inter)
    x, res = rand(tokens, hidden), rand(tokens, hidden)
    act, attn_out = rand(tokens, inter), rand(tokens, heads * head_dim)
    norm = Qwen3RMSNorm(hidden, eps=1e-6).to(dev, dtype)
    qh, kh, vh = rand(tokens, heads, head_dim), rand(tokens, kv_heads, head_dim), rand(tokens, kv_heads, head_dim)
    pos = torch.arange(seq_len, device=dev).repeat(seqs)
    layout = flat_layout((1, tokens), None, pos[None], dev)
    table = RotaryEmbedding(head_dim, shape["max_position_embeddings"], 1000000.0, None, dtype, dev)
    rope = table(layout.positions)
    hf_config = transformers.Qwen3Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    hf_rope = Qwen3RotaryEmbedding(hf_config).to(dev)
    cos, sin = hf_rope(vh, pos.view(seqs, seq_len))

    def ours_attention():
        cache_shape = (layout.num_blocks, PAGE, kv_heads, head_dim)
        k_cache, v_cache = kh.new_zeros(cache_shape), vh.new_zeros(cache_shape)
        qr = K.rotary_and_write_kv(qh, kh, vh, *rope, k_cache, v_cache, layout.attn.slot_mapping)
        return K.attention(qr, k_cache, v_cache, layout.attn, head_dim**-0.5)

    def torch_attention():
        def split(t):  # [tokens, h, d] -> [seqs, h, seq_len, d]
            return t.view(seqs, seq_len, t.shape[1], head_dim).transpose(1, 2)

        qr, kr = apply_rotary_pos_emb(split(qh), split(kh), cos, sin)
        out = F.scaled_dot_product_attention(qr, kr, split(vh), is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(tokens, heads, head_dim)

    pieces = {
        "qkv projection": (lambda: stacked_linear(x, [q, kp, vp]), lambda: torch.cat([q(x), kp(x), vp(x)], -1)),
        "rotary + attention": (ours_attention, torch_attention),
        # variants (indented: not in the layer's sum), with rl.attention's settings for the row
        "  ... fp32 backward": (ours_attention, torch_attention),  # full-fp32 matmuls (the CPU's are either way)
        "  ... Triton backward": (ours_attention, torch_attention),  # ops.attention.backward
        "o_proj": (lambda: linear(attn_out, o), lambda: o(attn_out)),
        "rms_norm + residual": (lambda: K.rms_norm(x, norm.weight, 1e-6, res)[0], lambda: norm(x + res)),
        "gate_up + silu_and_mul": (
            lambda: K.silu_and_mul(stacked_linear(x, [gate, up])),
            lambda: F.silu(gate(x)) * up(x),
        ),
        "down_proj": (lambda: linear(act, down), lambda: down(act)),
    }
    print(f"{'piece':<24} {'lockstep fwd':>12} {'bwd':>8} {'torch fwd':>10} {'bwd':>8}  ratio fwd / bwd / both "
          f"({tokens} tokens, {dev.type})", flush=True)  # fmt: skip
    total = [0.0, 0.0, 0.0, 0.0]
    for name, (ours, theirs) in pieces.items():
        in_layer = not name.startswith(" ")  # an indented row: a variant of the row above, not in the sum
        row = []
        for fn in (ours, theirs):
            grad = None

            def run(fn=fn):
                nonlocal grad
                t0 = clock.mark()
                out = fn()
                t1 = clock.mark()
                if grad is None:
                    grad = torch.randn(out.shape, generator=gen, device=dev, dtype=out.dtype)
                out.backward(grad)
                t2 = clock.mark()
                return clock.ms(t0, t1), clock.ms(t1, t2)

            with _attention_settings(name):
                row += list(_guarded(name, lambda run=run: _best(run), (float("nan"),) * 2))
        for i, v in enumerate(row):
            total[i] += v if in_layer else 0.0
        print(f"{name:<24} {row[0]:>12.2f} {row[1]:>8.2f} {row[2]:>10.2f} {row[3]:>8.2f}  "
              f"{row[0] / row[2]:.2f} / {row[1] / row[3]:.2f} / {(row[0] + row[1]) / (row[2] + row[3]):.2f}",
              flush=True)  # fmt: skip
    print(f"{'a layer (sum, ms)':<24} {total[0]:>12.2f} {total[1]:>8.2f} {total[2]:>10.2f} {total[3]:>8.2f}  "
          f"{total[0] / total[2]:.2f} / {total[1] / total[3]:.2f} / {sum(total[:2]) / sum(total[2:]):.2f}",
          flush=True)  # fmt: skip
    _guarded("attention gradients", lambda: _compare_attention_backwards(ours_attention, [qh, kh, vh], dev))
    _guarded("pointwise backwards", lambda: _compare_pointwise_backwards(x, res, norm.weight, act, dev, clock))
    _weight_gradients(dev, tokens, shape, clock)


def _note_cpu_triton(device: torch.device) -> None:
    from lockstep.ops._common import interpreting

    if device.type != "cuda" and not interpreting():
        print("(on the CPU the Triton attention backward runs only under TRITON_INTERPRET=1: its rows here take the "
              "reference)", flush=True)  # fmt: skip


def _guarded(name: str, fn, failed=None):
    """``fn()``; if it raises, the error printed under ``name`` and ``failed`` returned, so that one failing piece
    (a kernel's first run on a GPU) leaves the rest of the run's figures."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - printed, and the run goes on
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return failed


def _weight_gradients(dev: torch.device, tokens: int, shape: dict, clock: _Clock) -> None:
    """The backward's weight-gradient matmuls alone, ``grad_W = x^T @ grad`` as ``ops.autograd`` computes it (the
    transposed operand read through its strides) and with that operand copied to row-major first (the copy timed
    in), against ``torch.mm`` of the same strided operands."""
    from lockstep.ops.matmul import mm

    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    q_out = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * shape["head_dim"]
    o_in = shape["num_attention_heads"] * shape["head_dim"]
    gen = torch.Generator(device=dev).manual_seed(1)
    # (name, N, K): weight [N, K]; autograd.linear takes mm(x^T, g)^T where N > K, else mm(g^T, x)
    cases = [("qkv", q_out, hidden), ("o_proj", hidden, o_in), ("gate_up", 2 * inter, hidden), ("down", hidden, inter)]
    print(f"{'grad_W matmul':<14} {'strided ms':>10} {'copied ms':>10} {'torch.mm ms':>11}  TFLOP/s strided / copied / "
          f"torch ({tokens} tokens)", flush=True)  # fmt: skip
    for name, n, k in cases:
        x = torch.randn(tokens, k, generator=gen, device=dev, dtype=torch.bfloat16)
        g = torch.randn(tokens, n, generator=gen, device=dev, dtype=torch.bfloat16)
        a, b = (x, g) if n > k else (g, x)  # the left operand transposed: [rows, tokens] with unit stride down

        def timed(fn) -> float:
            fn()
            best = float("inf")
            for _ in range(3):
                t0 = clock.mark()
                fn()
                best = min(best, clock.ms(t0, clock.mark()))
            return best

        ms = [timed(lambda: mm(a.t(), b)), timed(lambda: mm(a.t().contiguous(), b)), timed(lambda: torch.mm(a.t(), b))]
        flop = 2 * tokens * n * k
        print(f"{name:<14} {ms[0]:>10.2f} {ms[1]:>10.2f} {ms[2]:>11.2f}  "
              + " / ".join(f"{flop / t / 1e9:.1f}" for t in ms), flush=True)  # fmt: skip


@contextlib.contextmanager
def _attention_settings(row: str):
    """``rl.attention``'s backward settings for a row of the components table: the Triton backward for "... Triton
    backward", else the reference backward, with full-fp32 matmuls for "... fp32 backward"."""
    from lockstep.rl import attention

    saved = attention.BACKWARD_MATMUL_PRECISION, attention.BACKWARD
    attention.BACKWARD = "triton" if "Triton" in row else "reference"
    if "fp32" in row:
        attention.BACKWARD_MATMUL_PRECISION = "highest"
    try:
        yield
    finally:
        attention.BACKWARD_MATMUL_PRECISION, attention.BACKWARD = saved


def _compare_attention_backwards(attend, inputs: list[torch.Tensor], device: torch.device) -> None:
    """The largest difference of each input's gradient between the backward settings, relative to its largest
    magnitude under full fp32 (the reference backward without TF32), and whether a second run repeats each bit."""
    _note_cpu_triton(device)
    grads = {}
    gen = torch.Generator(device=device).manual_seed(5)
    out_grad = None
    for row in ("  ... fp32 backward", "rotary + attention", "  ... Triton backward", "  ... Triton backward again"):
        for t in inputs:
            t.grad = None
        with _attention_settings(row):
            out = attend()
            out_grad = torch.randn(out.shape, generator=gen, device=device, dtype=out.dtype) if out_grad is None \
                else out_grad  # fmt: skip
            out.backward(out_grad)
        grads[row] = [t.grad.float().clone() for t in inputs]
    ref = grads["  ... fp32 backward"]
    for row, label in (("rotary + attention", "reference TF32"), ("  ... Triton backward", "Triton")):
        errs = [float((g - r).abs().max() / r.abs().max()) for g, r in zip(grads[row], ref, strict=True)]
        print(f"attention gradients, {label} against fp32: max |diff| / max |fp32| for q, k, v: "
              + ", ".join(f"{e:.2e}" for e in errs), flush=True)  # fmt: skip
    same = all(torch.equal(a, b) for a, b in zip(grads["  ... Triton backward"], grads["  ... Triton backward again"],
                                                  strict=True))  # fmt: skip
    print(f"attention gradients, Triton: a second run gives the same bits: {same}", flush=True)


def _compare_pointwise_backwards(x, res, weight, act, dev: torch.device, clock: _Clock) -> None:
    """RMSNorm's and SiLU-and-mul's backward: the Triton passes (CUDA's path) against the torch formulas (the CPU's)
    on the step's shapes, values (max |diff| / max |formula|) and time."""
    from lockstep.ops.autograd import rms_norm_backward_reference
    from lockstep.ops.gated_backward import silu_and_mul_backward
    from lockstep.ops.rms_norm_backward import rms_norm_backward
    from lockstep.rl.policy import silu_and_mul_backward_reference

    if dev.type != "cuda":
        from lockstep.ops._common import interpreting

        if not interpreting():  # the Triton passes run on CUDA, or the interpreter
            print("pointwise backwards: Triton passes not compared (no CUDA; TRITON_INTERPRET=1 runs them)")
            return
    h = (x + res).detach()
    g = torch.randn_like(h)
    gate_up = torch.cat([act, act.flip(0)], dim=-1).detach()
    g_act = torch.randn_like(act)
    cases = {
        "rms_norm backward": (lambda: rms_norm_backward(h, weight.detach(), 1e-6, g, g)[0],
                              lambda: rms_norm_backward_reference(h, weight.detach(), 1e-6, g, g)[0]),
        "silu_and_mul backward": (lambda: silu_and_mul_backward(gate_up, g_act),
                                  lambda: silu_and_mul_backward_reference(gate_up, g_act)),
    }  # fmt: skip
    for name, (triton_fn, torch_fn) in cases.items():
        ours, ref = triton_fn(), torch_fn()
        err = float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())
        times = []
        for fn in (triton_fn, torch_fn):
            fn()
            t0 = clock.mark()
            fn()
            times.append(clock.ms(t0, clock.mark()))
        print(f"{name}: Triton {times[0]:.2f} ms, torch formula {times[1]:.2f} ms; max |diff| / max |formula| "
              f"{err:.2e}; a second run the same bits: {torch.equal(ours, triton_fn())}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true", help="with --time: each step's kernels, forward and backward")
    ap.add_argument("--components", action="store_true", help="each piece of a layer alone, lockstep vs torch")
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen3 on the CPU (checks that the bench runs)")
    args = ap.parse_args()
    if args.tiny:
        args.device, args.seqs, args.seq_len, args.layers = "cpu", 2, 48, 2
    if args.check:
        print("bits:", "all equal" if check(args.device) else "MISMATCH", flush=True)
    if args.time:
        timing(args.device, args.layers, args.seqs, args.seq_len, args.profile, args.tiny)
    if args.components:
        components(args.device, args.seqs, args.seq_len, args.tiny)


if __name__ == "__main__":
    main()
