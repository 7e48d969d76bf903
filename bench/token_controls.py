"""vLLM's allowed_token_ids and bad_words in the sampler (layers/token_bans.py): a controlled row's token and
logprob are the same bits alone and among other rows (at any position), and what the per-row controls cost a step.

    python bench/token_controls.py            # CUDA: vocab 151936, rows 1, 64, 256
    python bench/token_controls.py --smoke    # CPU, tiny (the interpreter)

Prints a table: per row count, whether the controlled row's bits matched alone / first / last in the batch, and the
sampler's step time with no controlled rows, with every row under allowed_token_ids (1000 ids) and 8 two-token bad
words ("both"), and with every row under the bad words alone. Asserts the bits; the times are for reading.
"""

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # set before lockstep is imported

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampler import ms  # noqa: E402  (bench/sampler.py)

from lockstep.layers.sampler import Sampler  # noqa: E402
from lockstep.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    vocab, rows_list, reps = (97, [1, 5], 2) if device == "cpu" else (151936, [1, 64, 256], 20)
    g = torch.Generator().manual_seed(0)
    allowed = sorted(torch.randperm(vocab, generator=g)[: min(1000, vocab // 2)].tolist())
    history = ([3, 1, 4, 1, 5, 9, 2, 6], 4)  # output tokens 5, 9, 2, 6: a bad word (6, t) bans t now
    words = [[6, t] for t in range(10, 18)]
    target = SamplingParams(temperature=0.8, seed=7, logprobs=2, allowed_token_ids=allowed, bad_words_token_ids=words)
    other = SamplingParams(temperature=0.8, seed=11, logprobs=2)
    sampler = Sampler()
    print(f"device {device}, vocab {vocab}")
    print(f"{'rows':>5} {'bits alone=first=last':>22} {'plain ms':>9} {'both ms':>11} {'bad words ms':>13}")
    for rows in rows_list:
        logits = torch.randn(rows, vocab, generator=g).to(device) * 4
        row = logits[0].clone()
        alone = sampler(row[None], [target], [8], [history])
        results = []
        for pos in (0, rows - 1):
            batch = logits.clone()
            batch[pos] = row
            params = [other] * rows
            params[pos] = target
            tokens, lps = sampler(batch, params, [8] * rows, [history] * rows)
            results.append((tokens[pos], lps[pos]))
        same = all(r == (alone[0][0], alone[1][0]) for r in results)
        assert same, f"rows={rows}: the controlled row's bits moved with the batch"
        assert alone[0][0] in allowed and alone[0][0] not in range(10, 18)
        hist = [history] * rows
        plain = ms(lambda: sampler(logits, [other] * rows, [8] * rows, hist), reps)
        with_allowed = ms(lambda: sampler(logits, [target] * rows, [8] * rows, hist), reps)
        bad_only = SamplingParams(temperature=0.8, seed=7, logprobs=2, bad_words_token_ids=words)
        with_bad = ms(lambda: sampler(logits, [bad_only] * rows, [8] * rows, hist), reps)
        print(f"{rows:>5} {str(same):>22} {plain:>9.2f} {with_allowed:>11.2f} {with_bad:>13.2f}")


if __name__ == "__main__":
    main()
