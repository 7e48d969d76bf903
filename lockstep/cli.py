"""The ``lockstep`` command. ``lockstep generate "prompt"`` prints a completion; each subcommand is one
``add_<name>_parser`` + ``run_<name>`` pair registered in ``main`` (``serve`` and ``audit`` go there later)."""

import argparse
import sys
from collections.abc import Sequence


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate one completion and print it",
        description="Generate a completion. Instruct models (a tokenizer with a chat template) get the prompt as "
        "a user message by default; --raw continues the text as it is.",
    )
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None, help="Hugging Face checkpoint folder (default: embedded SmolLM2-135M)")
    p.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    p.add_argument("--system", default=None, help="a system message (chat mode only)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None, help="noise seed for temperature > 0 (default: drawn, printed)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--logprobs", action="store_true", help="print each token with its logprob")
    p.add_argument("--no-batch-invariant", action="store_true", help="torch's default kernels (not invariant)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from lockstep.llm import LLM
    from lockstep.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    llm = LLM(args.model, batch_invariant=not args.no_batch_invariant, device=args.device, dtype=args.dtype)
    tokenizer = llm.tokenizer
    chat = not args.raw and tokenizer is not None and bool(tokenizer.chat_template)
    if chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        [out] = llm.chat(messages, params, use_tqdm=False)
    else:
        [out] = llm.generate(args.prompt, params, use_tqdm=False)
    if args.logprobs:
        for token_id, logprob in zip(out.token_ids, out.logprobs, strict=True):
            piece = tokenizer.decode([token_id]) if tokenizer is not None else ""
            print(f"{token_id:>8d} {logprob:12.6f} {piece!r}")
        print()
    print(out.text)
    if out.seed is not None and args.seed is None:
        print(f"(seed {out.seed})", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lockstep", description="LLM inference whose answers do not depend on how requests are batched."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"lockstep: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
