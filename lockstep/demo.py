"""Show batch invariance on the embedded SmolLM2 model, run by Hugging Face transformers.

    python -m lockstep.demo [--trials N] [--device cpu|cuda]

The same prompt's next-token logits are computed alone and inside batches of other prompts, first with torch's
own kernels, then inside ``lockstep.batch_invariant_mode()``: the model code is not changed at all.
"""

import argparse

import torch

from lockstep import batch_invariant_mode, check_batch_invariance


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lockstep.models.embedded import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    sample = tokenizer(args.prompt, return_tensors="pt").input_ids[0].to(args.device)

    def next_token_logits(ids: torch.Tensor) -> torch.Tensor:
        return model(ids).logits[:, -1].float()

    print(f"model: {path.name}, prompt: {args.prompt!r} ({len(sample)} tokens), device: {args.device}")
    for enabled in (False, True):
        with batch_invariant_mode(enabled):
            report = check_batch_invariance(next_token_logits, sample, trials=args.trials, max_batch_size=16)
            token = int(next_token_logits(sample[None])[0].argmax())
        label = "lockstep.batch_invariant_mode()" if enabled else "torch's own kernels"
        print(f"\n{label}:\n{report}\n  greedy next token alone: {tokenizer.decode([token])!r}")


if __name__ == "__main__":
    main()
