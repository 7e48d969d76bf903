"""The CPU path on the embedded model: the one-time conversion, then decode speed side by side in one process.

    PYTHONPATH=. python bench/cpu_decode.py [--tokens 64] [--rounds 3]

1. The conversion: ``embedded.default_model_path()`` into a fresh temporary cache, timed from the call (the first
   thing the script does, so its imports are counted as a user would pay them).
2. Decode, SmolLM2-135M-Instruct in fp32, greedy, ``--tokens`` new tokens (EOS ignored) after the chat-templated
   prompt, three ways on the converted folder: lockstep with its invariant kernels (``LLM()``), lockstep on
   torch's default kernels (``LLM(batch_invariant=False)``), and transformers' ``generate`` on the same folder
   (``AutoModelForCausalLM``). Each takes one warm-up call, then ``--rounds`` rounds run the three in turn; the
   median of each is printed as tok/s = new tokens / wall time of the whole call (prefill included).

3. ``--batched``: instead of 2, ``lockstep bench throughput``'s CPU case side by side: ``--batch`` requests (32) of
   ``--input-len`` random prompt tokens (128) submitted at once, each generating ``--output-len`` tokens (32),
   stepped to the end (``lockstep.benchmark.run_batch``), lockstep invariant and default kernels in turn for
   ``--rounds`` rounds after one warm-up each. Prints output tok/s (median), the invariant/default ratio of every
   round by wall time and by this process's CPU time (user + system, all threads: less swayed by other processes
   on shared cores, with PASSIVE workers that sleep while they wait), and the load average before and after.

The 2-core CPU machines are shared, so only figures from one run are comparable; nothing here asserts a speed.
OMP_WAIT_POLICY defaults to PASSIVE here, as in the tests: on shared cores, OpenMP workers that spin while they
wait (the default policy) make every engine's figures swing by several times from one run to the next, with
the other users' load. Set OMP_WAIT_POLICY in the environment to measure another policy.
"""

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import torch  # noqa: E402

PROMPT = "What is the capital of France?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per call (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="timed calls of each engine (default 3)")
    parser.add_argument("--batched", action="store_true", help="the batched case (3. above) instead of one request")
    parser.add_argument("--batch", type=int, default=32, help="--batched: requests submitted together (default 32)")
    parser.add_argument("--input-len", type=int, default=128, help="--batched: prompt tokens (default 128)")
    parser.add_argument("--output-len", type=int, default=32, help="--batched: tokens generated (default 32)")
    args = parser.parse_args()

    cache = tempfile.mkdtemp(prefix="lockstep-bench-")
    os.environ["LOCKSTEP_CACHE"] = cache
    try:
        start = time.perf_counter()
        from lockstep.models import embedded

        folder = embedded.default_model_path()
        conversion_s = time.perf_counter() - start
        if args.batched:
            run_batched(args.batch, args.input_len, args.output_len, args.rounds, conversion_s)
        else:
            run(folder, args.tokens, args.rounds, conversion_s)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def run(folder, tokens: int, rounds: int, conversion_s: float) -> None:
    from transformers import AutoModelForCausalLM

    from lockstep import LLM, SamplingParams

    invariant = LLM()
    default = LLM(batch_invariant=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos: argmax at every step, EOS included
    tokenizer = invariant.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    prompt = list(tokenizer.encode(text, add_special_tokens=False))

    def lockstep_call(llm: LLM, n: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return list(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids)

    def hf_call(n: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[0, len(prompt) :].tolist()

    engines = {
        "lockstep invariant": lambda n: lockstep_call(invariant, n),
        "lockstep default kernels": lambda n: lockstep_call(default, n),
        "transformers generate": hf_call,
    }
    for call in engines.values():
        call(4)  # warm-up: first-call allocations and kernel set-up
    times: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[int]] = {}
    for _ in range(rounds):
        for name, call in engines.items():
            start = time.perf_counter()
            outputs[name] = call(tokens)
            times[name].append(time.perf_counter() - start)
            assert len(outputs[name]) == tokens, (name, len(outputs[name]))

    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, OMP_WAIT_POLICY {policy}"
    )
    print(f"conversion (GGUF -> fp32 safetensors folder, fresh cache): {conversion_s:.1f} s")
    print(f"decode: fp32, greedy, {len(prompt)}-token prompt, {tokens} new tokens, median of {rounds}")
    reference = outputs["lockstep invariant"]
    for name, ts in times.items():
        same = next((i for i, (a, b) in enumerate(zip(outputs[name], reference, strict=True)) if a != b), None)
        agree = "same tokens as invariant" if same is None else f"first differs from invariant at token {same}"
        print(f"  {name:26s} {tokens / statistics.median(ts):6.1f} tok/s   ({agree})")


def run_batched(batch: int, input_len: int, output_len: int, rounds: int, conversion_s: float) -> None:
    from lockstep import LLM, SamplingParams
    from lockstep.benchmark import prompt_token_pool, run_batch

    engines = {"lockstep invariant": LLM(), "lockstep default kernels": LLM(batch_invariant=False)}
    pool = prompt_token_pool(engines["lockstep invariant"])
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    load_before = os.getloadavg()
    for llm in engines.values():  # warm-up: a short run of the same shape
        warm = [[rng.choice(pool) for _ in range(input_len)] for _ in range(batch)]
        run_batch(llm, warm, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), "warm")
    rates: dict[str, list[float]] = {name: [] for name in engines}
    cpu_rates: dict[str, list[float]] = {name: [] for name in engines}  # per second of this process's CPU time
    for r in range(rounds):
        prompts = [[rng.choice(pool) for _ in range(input_len)] for _ in range(batch)]  # fresh: no prefix hits
        for name, llm in engines.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            done = run_batch(llm, prompts, params, f"r{r}")
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            assert done.output_tokens == batch * output_len, (name, done.output_tokens)
            rates[name].append(done.output_tokens / seconds)
            cpu_rates[name].append(done.output_tokens / cpu_seconds)
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, OMP_WAIT_POLICY {policy}"
    )
    print(f"conversion (GGUF -> fp32 safetensors folder, fresh cache): {conversion_s:.1f} s")
    print(f"batched: fp32, greedy, {batch} x {input_len}/{output_len} (random prompts), {rounds} rounds, interleaved")
    for name, rs in rates.items():
        print(f"  {name:26s} {statistics.median(rs):6.1f} output tok/s (rounds: {', '.join(f'{x:.1f}' for x in rs)})")
    for label, table in (("wall", rates), ("CPU time", cpu_rates)):
        inv, dflt = table["lockstep invariant"], table["lockstep default kernels"]
        ratios = [a / b for a, b in zip(inv, dflt, strict=True)]
        rounds_text = ", ".join(f"{x:.2f}" for x in ratios)
        print(f"  invariant / default, {label}: {statistics.median(ratios):.2f} (rounds: {rounds_text})")
    load_after = os.getloadavg()
    print(f"  load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
