"""xgrammar vs llguidance on the numbers that decide which one lockstep uses for structured outputs.

    pip install xgrammar   # not a dependency of lockstep: only this comparison needs it
    PYTHONPATH=. python bench/grammar.py [--rounds 5]

For each tokenizer — the embedded SmolLM2's (49,152 tokens) and a 151,936-token byte-level BPE (Qwen2/3's vocab
size) trained here on the virtual environment's Python sources (no real one ships in a PyPI package; the mask's
cost follows the vocabulary's size and byte-level structure, which this one has) — and each library:

1. setup: the library's view of the tokenizer (once per model);
2. compile: one JSON schema (an object with strings, an enum, numbers, a nested array of objects), cold;
3. mask: walking a document that fits the schema, token by token, the time to fill the next-token bitmask, then
   to accept the token (median and 99th percentile over every step of ``--rounds`` walks);
4. agreement: at how many steps the two libraries allowed a different set of tokens, and that every document
   token was allowed by both.

Install sizes come from the installed packages' folders. Timings are single-threaded, on a shared 2-core
machine: compare within one run only.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
        },
        "history": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"year": {"type": "integer"}, "event": {"type": "string"}},
                "required": ["year", "event"],
            },
        },
    },
    "required": ["name", "age", "role", "tags", "address", "history"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "score": 98.25,
    "tags": ["mathematics", "analytical engine", "poetical science"],
    "address": {"street": "12 St James's Square", "city": "London"},
    "history": [
        {"year": 1833, "event": "met Charles Babbage"},
        {"year": 1843, "event": "published the notes on the Analytical Engine, with the first program"},
    ],
}


def synthetic_tokenizer(folder: Path, vocab_size: int = 151936):
    """A byte-level BPE of ``vocab_size`` tokens trained on this environment's Python sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files, total = [], 0
    for f in sorted(Path(torch.__file__).parents[1].rglob("*.py")):
        files.append(str(f))
        total += f.stat().st_size
        if total > 120e6:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.save_pretrained(folder)
    return fast


def _median_p99(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def bench_xgrammar(tok, vocab: int, ids: list[int], rounds: int) -> dict:
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
    setup = time.perf_counter() - t
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - t
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    fills, accepts, masks = [], [], []
    for r in range(rounds):
        m = xgr.GrammarMatcher(compiled)
        for token in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            fills.append(time.perf_counter() - t)
            if r == 0:
                masks.append(bitmask[0].clone())
            t = time.perf_counter()
            if not m.accept_token(token):
                raise AssertionError(f"xgrammar rejected document token {token}")
            accepts.append(time.perf_counter() - t)
        m.fill_next_token_bitmask(bitmask)
        if r == 0:
            masks.append(bitmask[0].clone())
    return dict(setup=setup, compile=compile_s, fill=_median_p99(fills), accept=_median_p99(accepts), masks=masks)


def bench_llguidance(tok, vocab: int, ids: list[int], rounds: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=tok.eos_token_id)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    first = llguidance.LLMatcher(lltok, grammar, log_level=0)
    compile_s = time.perf_counter() - t
    if first.is_error():
        raise AssertionError(first.get_error())
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    fills, accepts, masks = [], [], []
    for r in range(rounds):
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        for token in ids:
            t = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(m, bitmask)
            fills.append(time.perf_counter() - t)
            if r == 0:
                masks.append(bitmask[0].clone())
            t = time.perf_counter()
            if not m.consume_token(token):
                raise AssertionError(f"llguidance rejected document token {token}: {m.get_error()}")
            accepts.append(time.perf_counter() - t)
        llguidance.torch.fill_next_token_bitmask(m, bitmask)
        if r == 0:
            masks.append(bitmask[0].clone())
    return dict(setup=setup, compile=compile_s, fill=_median_p99(fills), accept=_median_p99(accepts), masks=masks)


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (bitmask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool()


def install_sizes() -> dict[str, float]:
    import importlib.util

    out = {}
    for name in ("xgrammar", "tvm_ffi", "llguidance"):
        spec = importlib.util.find_spec(name)
        folder = Path(spec.origin).parent
        out[name] = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="walks of the document per library (default 5)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from lockstep.models.embedded import default_model_path
    from lockstep.models.loader import load_tokenizer

    tokenizers = [("SmolLM2 (49,152)", load_tokenizer(str(default_model_path())))]
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        tokenizers.append(("byte-level BPE (151,936)", synthetic_tokenizer(Path(tmp))))
        print(f"trained the 151,936-token BPE in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    print("| tokenizer | library | setup (s) | schema compile (ms) | mask median / p99 (µs) | accept median (µs) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, tok in tokenizers:
        vocab = len(tok)
        ids = tok.encode(text, add_special_tokens=False)
        results = {
            "xgrammar": bench_xgrammar(tok, vocab, ids, args.rounds),
            "llguidance": bench_llguidance(tok, vocab, ids, args.rounds),
        }
        for lib, r in results.items():
            print(
                f"| {label} | {lib} | {r['setup']:.2f} | {r['compile'] * 1e3:.1f} | "
                f"{r['fill'][0] * 1e6:.0f} / {r['fill'][1] * 1e6:.0f} | {r['accept'][0] * 1e6:.0f} |"
            )
        a, b = results["xgrammar"]["masks"], results["llguidance"]["masks"]
        pairs = [(_allowed(x, vocab), _allowed(y, vocab)) for x, y in zip(a, b, strict=True)]
        differ = [i for i, (x, y) in enumerate(pairs) if not torch.equal(x, y)]
        detail = ", ".join(
            f"step {i}: {int(pairs[i][0].sum())} vs {int(pairs[i][1].sum())} allowed" for i in differ[:4]
        )
        print(f"{label}: {len(ids)} document tokens; the allowed sets differ at {len(differ)} of {len(a)} steps")
        print(f"  (xgrammar vs llguidance) {detail}")
    print("installed sizes (MiB):", {k: round(v, 1) for k, v in install_sizes().items()})


if __name__ == "__main__":
    main()
