"""Speculative decoding on the CPU, the embedded SmolLM2: n-gram drafting against plain decoding, side by side.

    PYTHONPATH=. python bench/spec_cpu.py [--task repeat|proofread] [--k 3 5] [--rounds 3] [--max-tokens 160]

The task is input-grounded, where prompt lookup has something to find: the chat-templated request "Repeat the
following passage exactly" with a passage of a few sentences (``repeat``), or "Correct the spelling mistakes" in
the same passage with seven typos in it (``proofread``: the output mostly copies the input, not everywhere);
greedy, up to ``--max-tokens`` new tokens (the model's own EOS ends it). Three (or more) engines over the same
converted folder, each with its invariant kernels: plain decoding (``LLM()``) and
``LLM(speculative_config={"method": "ngram", "num_speculative_tokens": k, ...})`` for each ``--k``. One warm-up
call each, then ``--rounds`` rounds run them in turn; the median of each is printed as tok/s = new tokens / wall
time of the call (prefill included), and as decode tok/s = the tokens after the first over the call's time less a
``max_tokens=1`` call's (the prefill), with the acceptance of its drafts. Every engine's token ids and logprob bits
are asserted equal to plain decoding's: the speed-up is all that may change.

The 2-core CPU machines are shared, so only figures from one run are comparable (the script prints the load
average before and after). OMP_WAIT_POLICY defaults to PASSIVE, as in bench/cpu_decode.py.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

PASSAGE = (
    "The lighthouse stood at the end of a narrow spit of land, its white tower streaked with rust. Every evening "
    "the keeper climbed the one hundred and twelve steps to light the lamp, and every morning he wrote the "
    "weather in a leather book: the wind, the height of the waves, and the ships that passed. In forty years he "
    "missed only one night, when the storm tore the door from its hinges and he spent the dark hours holding it "
    "shut with his back."
)
TYPOS = {"narrow": "narow", "streaked": "streeked", "evening": "evenning", "weather": "wether", "height": "hieght",
         "missed": "mised", "hinges": "hingés"}  # fmt: skip
TASKS = {
    "repeat": "Repeat the following passage exactly, with nothing before or after it.\n\n" + PASSAGE,
    "proofread": "Correct the spelling mistakes in the following passage and write it out in full, with nothing "
    "before or after it.\n\n" + " ".join(TYPOS.get(w, w) for w in PASSAGE.split(" ")),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), default="repeat")
    parser.add_argument("--k", type=int, nargs="+", default=[3, 5], help="num_speculative_tokens (default 3 5)")
    parser.add_argument("--rounds", type=int, default=3, help="timed calls of each engine (default 3)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min (default 2)")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max (default 4)")
    args = parser.parse_args()

    from lockstep import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=1)
    message = [{"role": "user", "content": TASKS[args.task]}]
    first = SamplingParams(temperature=0, max_tokens=1)
    engines = {"plain": LLM()}
    for k in args.k:
        spec = {"method": "ngram", "num_speculative_tokens": k}
        spec |= {"prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
        engines[f"ngram k={k}"] = LLM(speculative_config=spec)
    load = os.getloadavg()
    outputs, stats = {}, {}
    times, prefill = {name: [] for name in engines}, {name: [] for name in engines}
    for llm in engines.values():
        llm.chat(message, params, use_tqdm=False)  # warm-up
    for _ in range(args.rounds):
        for name, llm in engines.items():
            llm.engine.spec_stats = type(llm.engine.spec_stats)()
            start = time.perf_counter()
            [out] = llm.chat(message, params, use_tqdm=False)
            times[name].append(time.perf_counter() - start)
            outputs[name] = out.outputs[0]
            stats[name], llm.engine.spec_stats = llm.engine.spec_stats, type(llm.engine.spec_stats)()
            start = time.perf_counter()
            llm.chat(message, first, use_tqdm=False)
            prefill[name].append(time.perf_counter() - start)
    ref = outputs["plain"]
    print(f"embedded SmolLM2, task {args.task}, greedy, {len(ref.token_ids)} new tokens ({ref.finish_reason}), "
          f"{args.rounds} rounds")  # fmt: skip
    print(f"load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f} (2 shared cores)")
    print(f"{'engine':<12}{'tok/s':>9}{'vs plain':>10}{'decode tok/s':>14}{'vs plain':>10}{'accepted':>18}"
          f"{'tokens/step':>13}  identical")  # fmt: skip
    med = statistics.median
    decode = {n: (len(ref.token_ids) - 1) / (med(times[n]) - med(prefill[n])) for n in times}
    base = len(ref.token_ids) / statistics.median(times["plain"])
    for name, out in outputs.items():
        same = out.token_ids == ref.token_ids and [x.hex() for x in out.token_logprobs] == [
            x.hex() for x in ref.token_logprobs
        ]
        assert same, f"{name}: the output differs from plain decoding's"
        rate = len(out.token_ids) / statistics.median(times[name])
        s = stats[name]
        accepted = f"{s.num_accepted_tokens}/{s.num_draft_tokens} ({s.acceptance_rate:.0%})" if s.num_drafts else "-"
        per_step = f"{s.mean_request_accepted_length:.2f}" if s.num_drafts else "1.00"
        d = decode[name]
        print(f"{name:<12}{rate:>9.2f}{rate / base:>9.2f}x{d:>14.2f}{d / decode['plain']:>9.2f}x{accepted:>18}"
              f"{per_step:>13}  {same}")  # fmt: skip
    print("\n" + ref.text)


if __name__ == "__main__":
    main()
