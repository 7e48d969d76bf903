"""The CPU path on the embedded model: the one-time conversion, then decode speed side by side in one process.

    PYTHONPATH=. python bench/cpu_decode.py [--tokens 64] [--rounds 3]

1. The conversion: ``embedded.default_model_path()`` into a fresh temporary cache, timed from the call (the first
   thing the script does, so its imports are counted as a user would pay them).
2. Decode, SmolLM2-135M-Instruct in fp32, greedy, ``--tokens`` new tokens (EOS ignored) after the chat-templated
   prompt, three ways on the converted folder: lockstep with its invariant kernels (``LLM()``), lockstep on
   torch's default kernels (``LLM(batch_invariant=False)``), and transformers' ``generate`` on the same folder
   (``AutoModelForCausalLM``). Each takes one warm-up call, then ``--rounds`` rounds run the three in turn; the
   median of each is printed as tok/s = new tokens / wall time of the whole call (prefill included).

The 2-core CPU machines are shared, so only figures from one run are comparable; nothing here asserts a speed.
OMP_WAIT_POLICY defaults to PASSIVE here, as in the tests: on shared cores, OpenMP workers that spin while they
wait (the default policy) make every engine's figures swing by several times from one run to the next, with
the other users' load. Set OMP_WAIT_POLICY in the environment to measure another policy.
"""

import argparse
import os
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
    args = parser.parse_args()

    cache = tempfile.mkdtemp(prefix="lockstep-bench-")
    os.environ["LOCKSTEP_CACHE"] = cache
    try:
        start = time.perf_counter()
        from lockstep.models import embedded

        folder = embedded.default_model_path()
        conversion_s = time.perf_counter() - start
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


if __name__ == "__main__":
    main()
