"""The patched transformers model (lockstep.rl.hf) on a GPU: its logprobs against the engine's sampled ones, bit for
bit, per family in bf16, and its forward + backward time against the same model on transformers' own kernels.

    python bench/hf_trainer.py --check                 # bits: every family, padded left/right and packed
    python bench/hf_trainer.py --time --layers 4       # Qwen3-8B shape cut to 4 layers, 16 x 1024 tokens
"""

import argparse
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


def timing(device: str, layers: int, seqs: int, seq_len: int, profile: bool = False) -> None:
    import transformers

    from lockstep.rl.hf import patch_model

    config = transformers.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6)  # fmt: skip
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (seqs, seq_len), device=device)
    packed = ids.reshape(1, -1)
    pos = torch.arange(seq_len, device=device).repeat(seqs)[None]

    def step(patched: bool) -> float:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        if patched:
            hidden = model.model(input_ids=packed, position_ids=pos).last_hidden_state
        else:
            hidden = model.model(input_ids=ids).last_hidden_state  # sdpa, causal: the same attention work
        hidden.float().square().mean().backward()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    results = {}
    for patched in (False, True):
        if patched:
            patch_model(model)
        step(patched)
        results[patched] = min(step(patched) for _ in range(3))
    base, ours = results[False] * 1e3, results[True] * 1e3
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
    print(f"Qwen3-8B shape, {layers} layers, {seqs} x {seq_len} tokens, bf16, forward + backward (no head): "
          f"transformers {base:.1f} ms, patched {ours:.1f} ms, ratio {ours / base:.2f}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true", help="with --time: the patched step's top kernels")
    args = ap.parse_args()
    if args.check:
        print("bits:", "all equal" if check(args.device) else "MISMATCH", flush=True)
    if args.time:
        timing(args.device, args.layers, args.seqs, args.seq_len, args.profile)


if __name__ == "__main__":
    main()
