"""Speculative decoding's invariance matrix on a GPU: every case gives plain decoding's bits (issue 31).

    python bench/spec_matrix.py                 # H200: Qwen3-8B shape, 36 layers, random bf16 weights (~4 min: an
                                                # estimate from the step costs, not yet measured)
    python bench/spec_matrix.py --layers 4      # the same, shallower
    python bench/spec_matrix.py --tiny          # a tiny Qwen3 on the CPU (fp32), < 1 min

One engine (``load_format="dummy"``: the engine draws the weights; a tokenizer with a token for each printable
ASCII character, then ``<i>`` words, so prompts are text and a JSON schema can be followed) runs plain decoding
of the request set of ``lockstep/spec/invariance.py`` (greedy with top logprobs; seeded T=0.8 with top-k, top-p
and min-p; penalties; a logit bias; a JSON schema; prompt logprobs; vLLM's token controls; a stop string first
seen mid-way; a stop token held back by min_tokens), then each case on a fresh scheduler over the same weights
and KV cache tensors (``bench/engine.py``'s ``fresh_scheduler``):

- ngram k = 1, 3, 7 (the n-gram drafter vLLM's config names);
- oracle k = 3, 7: plain decoding's own continuation is drafted, so every draft is accepted (asserted);
- garbage: random ids, some not token ids at all;
- mixed: per sequence the oracle, garbage, or half of each, so the rows of one step accept different lengths;
  then one request alone with the same drafter;
- chunked prefill: a small token budget and a long prompt arriving late, so verify chunks share steps with its
  prefill chunks (plain decoding of the same schedule is the reference; such steps are counted and required);
- preemption: a KV cache too small for the batch (preemptions counted and required);
- n = 2 through ``LLM.generate`` (plain vs ngram k = 3; the two choices must differ from each other);
- negative control: every row of a verify chunk sampled with its first row's noise
  (``invariance.one_noise_per_chunk``): the sampled requests must differ;
- fast kernels (``--fast-control``, on by default on CUDA): a second engine on ``kernels="default"`` (cuBLAS, a
  batch-dependent attention split), speculative vs its own plain decoding: verify rows are k + 1 query rows where
  plain decoding runs 1, which must change bits on a GPU (on the CPU it is reported, not required).

Each row: case, requests, same bits (token ids, logprob bits, top logprob bits with ranks, text, finish reason,
prompt logprob bits), draft and accepted tokens, seconds. Exit status 1 when any case differs, a case's premise
fails (no drafts, no preemption, ...), or a negative control does not differ. JSON: ``--out``/spec_matrix.json.
The JSON-schema request needs llguidance (``--no-json`` leaves it out; without llguidance and without the flag the
run says so and exits 1).
"""

import argparse
import importlib.util
import math
import os
import string
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import QWEN3_8B, QWEN3_TINY, build_checkpoint, fresh_scheduler, write_report  # noqa: E402

from lockstep import LLM, SamplingParams  # noqa: E402
from lockstep.spec import invariance as inv  # noqa: E402
from lockstep.spec.factory import make_drafter  # noqa: E402
from lockstep.spec.stats import SpecDecodeStats  # noqa: E402

CHARS = string.printable[:95]  # ids 0..94, as the tests' tokenizer (tests/tiny_models.py)
CASES = ("ngram_k1", "ngram_k3", "ngram_k7", "oracle_k3", "oracle_k7", "garbage", "mixed", "alone", "chunked",
         "preemption", "n2", "negative", "fast")  # fmt: skip
LONG = "the quick brown fox jumps over the lazy dog "


def save_char_tokenizer(folder: Path, vocab_size: int, eos: int) -> None:
    """Replace the folder's tokenizer: one token per printable ASCII character (ids 0..94), then words ``<i>``
    (what a random model mostly writes); the unknown token is ``<95>``, EOS ``<eos>``'s word."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS)} | {f"<{i}>": i for i in range(len(CHARS), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=f"<{len(CHARS)}>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=f"<{len(CHARS)}>", eos_token=f"<{eos}>")
    fast.save_pretrained(folder)


def encode(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


class Watch:
    """Counts, per run, the steps that verified drafts, those that also held a prefill chunk, and preemptions."""

    def __init__(self, engine) -> None:
        self.verify_steps = self.prefill_with_verify = self.preempted = 0
        real = engine.scheduler.schedule

        def schedule(*a, **kw):
            batch = real(*a, **kw)
            if batch.has_drafts:
                self.verify_steps += 1
                self.prefill_with_verify += any(e.start < e.seq.num_prompt_tokens for e in batch.entries)
            self.preempted += len(batch.preempted)
            return batch

        engine.scheduler.schedule = schedule


def use(llm: LLM, spec: dict | None, drafter=None, **overrides) -> Watch:
    """A fresh scheduler (``overrides`` its settings; whatever a failed case left is aborted first), ``spec``'s
    drafter (or ``drafter``), zeroed counters."""
    engine = llm.engine
    for rid in list(engine._requests):
        engine.abort(rid)
    fresh_scheduler(llm, speculative_config=spec, **overrides)
    if spec is None:
        engine.drafter = None
    else:
        engine.drafter = drafter or make_drafter(engine.config.speculative_config, engine.config, engine.runner)
    engine._observe = None
    engine.spec_stats = SpecDecodeStats()
    return Watch(engine)


def diffs(got: dict, want: dict) -> list[str]:
    return [rid for rid in sorted(set(got) | set(want)) if got.get(rid) != want.get(rid)]


class Matrix:
    """The cases over one loaded engine. Each case method returns ``(label, requests, differing ids, premise,
    extra)``: ``premise`` False when what the case is meant to exercise did not happen (no drafts, no preemption)."""

    def __init__(self, llm: LLM, args, vocab: int, json: bool) -> None:
        self.llm, self.engine, self.args, self.vocab = llm, llm.engine, args, vocab
        decode = lambda ids: self.engine.tokenizer.decode(ids, skip_special_tokens=True)
        use(llm, None)
        probe = inv.run(self.engine, inv.probe_requests(encode))
        self.reqs = inv.requests(encode, decode, probe, max_tokens=args.max_tokens, json=json)
        self.reference = inv.run(self.engine, self.reqs)
        self.want = inv.all_bits(self.reference)

    def oracle(self, strict: bool = True) -> inv.Oracle:
        return inv.Oracle(self.reference, self.reqs, strict)

    def spec_run(self, label: str, k: int, drafter=None, premise=None, **overrides) -> tuple:
        spec = (inv.NGRAM if drafter is None else {"method": "ngram"}) | {"num_speculative_tokens": k}
        watch = use(self.llm, spec, drafter, **overrides)
        got = inv.all_bits(inv.run(self.engine, self.reqs))
        stats = self.engine.spec_stats
        ok = (premise or (lambda s, w: s.num_draft_tokens > 0))(stats, watch)
        return label, len(self.reqs), diffs(got, self.want), ok, {"preemptions": watch.preempted}

    def ngram(self, k: int) -> tuple:
        return self.spec_run(f"ngram k={k}", k)

    def oracle_run(self, k: int) -> tuple:
        every = lambda s, w: s.num_accepted_tokens == s.num_draft_tokens > 0
        return self.spec_run(f"oracle k={k} (every draft accepted)", k, self.oracle(), every)

    def garbage(self) -> tuple:
        return self.spec_run("garbage drafter k=4", 4, inv.Garbage(self.vocab))

    def mixed(self) -> tuple:
        some_rejected = lambda s, w: 0 < s.num_accepted_tokens < s.num_draft_tokens
        return self.spec_run("mixed acceptance k=5", 5, inv.Mixed(self.oracle(), self.vocab), some_rejected)

    def alone(self) -> tuple:
        rid = "sampled"
        use(self.llm, {"method": "ngram", "num_speculative_tokens": 5}, inv.Mixed(self.oracle(), self.vocab))
        got = inv.all_bits(inv.run(self.engine, {rid: self.reqs[rid]}))
        return "alone (sampled, mixed k=5)", 1, diffs(got, {rid: self.want[rid]}), self.drafted(), {}

    def chunked(self) -> tuple:
        # Verify chunks share steps with a late long prompt's prefill chunks, and the budget squeezes drafts.
        budget = {"max_num_batched_tokens": self.args.chunk_budget, "max_num_seqs": 8}
        late = {"long": (encode(LONG * self.args.long_repeats), SamplingParams(seed=21, max_tokens=8, logprobs=1))}
        use(self.llm, None, **budget)
        plain = inv.run(self.engine, self.reqs, late=late)
        expected = inv.all_bits(plain)
        plain_same = not diffs({r: b for r, b in expected.items() if r in self.want}, self.want)
        mixed = inv.Mixed(inv.Oracle(plain, self.reqs | late), self.vocab)
        watch = use(self.llm, {"method": "ngram", "num_speculative_tokens": 3}, mixed, **budget)
        got = inv.all_bits(inv.run(self.engine, self.reqs, late=late))
        premise = watch.prefill_with_verify > 0 and self.engine.spec_stats.num_accepted_tokens > 0 and plain_same
        extra = {"prefill_with_verify_steps": watch.prefill_with_verify, "plain_same_as_reference": plain_same}
        label = f"chunked prefill (budget {budget['max_num_batched_tokens']})"
        return label, len(late) + len(self.reqs), diffs(got, expected), premise, extra

    def preemption(self) -> tuple:
        block = self.engine.config.block_size
        biggest = max(len(p) + s.max_tokens for p, s in self.reqs.values())
        blocks = 2 * math.ceil(biggest / block) + 2  # room for the largest request twice: the batch takes turns
        cache = {"num_kv_blocks": blocks, "max_model_len": min(self.engine.config.max_model_len, blocks * block + 1)}
        preempted = lambda s, w: w.preempted > 0 and s.num_accepted_tokens > 0
        label = f"preemption ({blocks} KV blocks)"
        return self.spec_run(label, 4, inv.Mixed(self.oracle(), self.vocab), preempted, **cache)

    def n2(self) -> tuple:
        # Two choices a prompt, each a request of its own with its own seed; the drafter proposes plain decoding's
        # continuation, half of it or garbage (Mixed), so the choices accept different lengths.
        n = self.args.max_tokens
        params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=n, logprobs=1, ignore_eos=True)
        prompts = [encode("abcabcabc"), encode("zzzz")]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        use(self.llm, None)
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        plain = [[inv.choice_bits(c) for c in o.outputs] for o in outs]
        oracle = inv.Oracle.of([p + list(c.token_ids) for p, o in zip(prompts, outs, strict=True) for c in o.outputs])
        use(self.llm, {"method": "ngram", "num_speculative_tokens": 3}, inv.Mixed(oracle, self.vocab))
        got = [[inv.choice_bits(c) for c in o.outputs] for o in self.llm.generate(inputs, params, use_tqdm=False)]
        different = [f"{i}.{j}" for i in range(2) for j in range(2) if got[i][j] != plain[i][j]]
        premise = self.engine.spec_stats.num_accepted_tokens > 0 and plain[0][0] != plain[0][1]
        return "n=2 (LLM.generate, mixed k=3)", 4, different, premise, {}

    def negative(self) -> tuple:
        ids = ("greedy", "sampled", "penalised")
        use(self.llm, {"method": "ngram", "num_speculative_tokens": 3}, self.oracle(strict=False))
        with inv.one_noise_per_chunk():
            got = inv.all_bits(inv.run(self.engine, {rid: self.reqs[rid] for rid in ids}))
        # Greedy has no noise: only the sampled requests' tokens may change, and both must.
        premise = got["greedy"] == self.want["greedy"] and all(got[r][0] != self.want[r][0] for r in ids[1:])
        return "negative: one noise per chunk", len(ids), diffs(got, {r: self.want[r] for r in ids}), premise, {}

    def drafted(self) -> bool:
        return self.engine.spec_stats.num_draft_tokens > 0


def make_row(engine, run, expect: str = "same") -> dict:
    """Time ``run`` (a case method) and judge it: ``expect`` "same" (plain decoding's bits), "differ" (a negative
    control) or "any" (reported only, premise included: on a CPU whether the fast kernels' plain decoding even
    repeats itself depends on the host's BLAS); an exception is a failed row that says what it was."""
    t0 = time.perf_counter()
    try:
        label, n, different, premise, extra = run()
        error = None
    except Exception as e:  # noqa: BLE001 - a case that crashes is reported, the others still run
        label, n, different, premise, extra = getattr(run, "__name__", "case"), 0, ["(error)"], False, {}
        error = f"{type(e).__name__}: {e}"
    stats = engine.spec_stats
    r = {"case": label, "requests": n, "same": not different, "differing": different,
         "draft_tokens": stats.num_draft_tokens, "accepted_tokens": stats.num_accepted_tokens,
         "seconds": round(time.perf_counter() - t0, 2), "expect": expect, "premise": bool(premise),
         "error": error} | extra  # fmt: skip
    judged = {"same": r["premise"] and not different, "differ": r["premise"] and bool(different), "any": True}
    r["ok"] = error is None and judged[expect]
    print_row(r)
    return r


def run_cases(llm: LLM, args, vocab: int, report: dict) -> list[dict]:
    wanted = set(args.cases.split(",")) if args.cases else set(CASES)
    made: list[Matrix] = []

    def reference() -> tuple:
        made.append(Matrix(llm, args, vocab, args.json))
        return "plain (reference)", len(made[0].reqs), [], True, {}

    rows = [make_row(llm.engine, reference)]
    if not made:
        raise SystemExit(f"plain decoding of the matrix's requests failed: {rows[0]['error']}")
    m = made[0]
    report["reference"] = {rid: {"tokens": len(o.outputs[0].token_ids), "finish": o.outputs[0].finish_reason,
                                 "text": o.outputs[0].text[:80]} for rid, o in sorted(m.reference.items())}  # fmt: skip
    cases = {f"ngram_k{k}": lambda k=k: m.ngram(k) for k in (1, 3, 7)}
    cases |= {f"oracle_k{k}": lambda k=k: m.oracle_run(k) for k in (3, 7)}
    cases |= {"garbage": m.garbage, "mixed": m.mixed, "alone": m.alone, "chunked": m.chunked,
              "preemption": m.preemption, "n2": m.n2}  # fmt: skip
    for name, run in cases.items():
        if name in wanted:
            rows.append(make_row(llm.engine, run))
    if "negative" in wanted:
        rows.append(make_row(llm.engine, m.negative, expect="differ"))
    return rows


def fast_control(model: str, llm_kwargs: dict, args, vocab: int, required: bool) -> dict:
    """Speculative vs plain decoding on the fast kernels (``kernels="default"``): must differ on a GPU, where plain
    decoding run twice must not."""
    with LLM(model, kernels="default", **llm_kwargs) as llm:

        def run() -> tuple:
            m = Matrix(llm, args, vocab, json=False)
            use(llm, None)
            repeatable = not diffs(inv.all_bits(inv.run(llm.engine, m.reqs)), m.want)
            use(llm, {"method": "ngram", "num_speculative_tokens": 3}, m.oracle(strict=False))
            different = diffs(inv.all_bits(inv.run(llm.engine, m.reqs)), m.want)
            # Only a difference that plain decoding run twice does not show is the verify rows' doing.
            premise = repeatable and m.drafted()
            return "negative: fast kernels verify", len(m.reqs), different, premise, {"plain_repeatable": repeatable}

        return make_row(llm.engine, run, expect="differ" if required else "any")


HEADER = f"{'case':<40} {'requests':>8} {'same bits':>9} {'drafted':>8} {'accepted':>8} {'seconds':>8}  verdict"


def print_row(r: dict) -> None:
    expect = {"same": "", "differ": " (must differ)", "any": " (reported only)"}[r["expect"]]
    verdict = ("ok" if r["ok"] else "FAIL") + expect
    notes = [f"{k.replace('_', ' ')} {r[k]}" for k in ("preemptions", "prefill_with_verify_steps") if r.get(k)]
    flags = ("plain_same_as_reference", "plain_repeatable")
    notes += [f"{k.replace('_', ' ')}: {'yes' if r[k] else 'NO'}" for k in flags if k in r]
    if not r["premise"] and r["error"] is None:
        notes.append("its premise did not hold")
    if r["differing"]:
        notes.append(f"differ: {','.join(r['differing'])}")
    if r["error"]:
        notes.append(r["error"][:200])
    same = "yes" if r["same"] else "no"
    print(f"{r['case']:<40} {r['requests']:>8} {same:>9} {r['draft_tokens']:>8} {r['accepted_tokens']:>8} "
          f"{r['seconds']:>8.2f}  {verdict}{'; ' + '; '.join(notes) if notes else ''}", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen3 on the CPU (fp32)")
    ap.add_argument("--layers", type=int, default=None, help="depth (default: the shape's, 36 for Qwen3-8B)")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens a request (default 40; --tiny 20)")
    ap.add_argument("--cases", default="", help=f"comma list of {','.join(CASES)} (default: all)")
    ap.add_argument("--no-json", dest="json", action="store_false", help="leave out the JSON-schema request")
    ap.add_argument("--fast-control", action=argparse.BooleanOptionalAction, default=None,
                    help="the fast-kernels negative control (default: on)")  # fmt: skip
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    cuda = not args.tiny
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    shape = QWEN3_TINY if args.tiny else QWEN3_8B
    vocab = shape["vocab_size"]
    args.max_tokens = args.max_tokens or (20 if args.tiny else 40)
    args.chunk_budget = 12 if args.tiny else 24
    args.long_repeats = 2 if args.tiny else 5
    wanted = set(args.cases.split(",")) if args.cases else set(CASES)
    if wanted - set(CASES):
        raise SystemExit(f"unknown cases: {sorted(wanted - set(CASES))}")
    if args.fast_control is None:
        args.fast_control = "fast" in wanted
    problems = []
    if args.json and importlib.util.find_spec("llguidance") is None:
        problems.append("the JSON-schema request needs llguidance, which is not installed (or pass --no-json)")
        print(f"NOTE: {problems[-1]}; running without it", flush=True)
        args.json = False

    workdir = Path(tempfile.mkdtemp(prefix="lockstep-specmx-"))
    t_start = time.perf_counter()
    info = build_checkpoint(workdir, shape, args.layers, device, weights=False)  # load_format="dummy"
    save_char_tokenizer(workdir, vocab, shape["eos_token_id"])
    llm_kwargs = dict(
        device=str(device), dtype="bfloat16" if cuda else "float32", load_format="dummy", seed=0,
        block_size=16 if cuda else 4, num_kv_blocks=1024 if cuda else 512, max_model_len=1024,
        max_num_seqs=96 if cuda else 16,  # CUDA graphs for up to 96 rows: a verify step of 11 sequences at k = 7
    )  # fmt: skip
    info["shape"] = "qwen3-tiny" if args.tiny else "qwen3-8b"
    report = {"args": vars(args), "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "torch": torch.__version__, "model": info}  # fmt: skip
    llm = LLM(str(workdir), **llm_kwargs)
    report["startup_s"] = round(time.perf_counter() - t_start, 1)
    print(f"{report['device']}, {info['num_hidden_layers']} layers, started in {report['startup_s']} s\n")
    print(HEADER, flush=True)
    rows = run_cases(llm, args, vocab, report)
    llm.close()
    del llm
    if args.fast_control:
        if cuda:
            torch.cuda.empty_cache()
        rows.append(fast_control(str(workdir), llm_kwargs, args, vocab, required=cuda))
    report["rows"] = rows
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    failed = [r["case"] for r in rows if not r["ok"]]
    report["ok"] = not failed and not problems
    report["problems"] = problems + [f"case failed: {c}" for c in failed]
    print(f"\n{'all cases ok' if report['ok'] else 'FAILED: ' + '; '.join(report['problems'])} "
          f"({report['seconds']} s in all)")  # fmt: skip
    write_report(report, args.out, "spec_matrix.json")
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
