"""vLLM's ``allowed_token_ids`` and ``bad_words``: which tokens one row may choose at this step.

Both are functions of the row's own request alone (its parameters and its output so far), applied to its logits
row before the choice like a ``logit_bias`` of -inf, so a row's bits never depend on its neighbours:

- ``allowed_token_ids``: every other token is set to -inf, at every step;
- ``bad_words``: each word is tokenized once (``bad_words_token_ids``) as vLLM does, the word with its leading
  whitespace stripped, and also with one leading space when that gives a different first token and as many tokens
  (the form a word takes mid-text in byte-level BPE). A word of ``k`` tokens bans its last token at a step whose
  previous ``k - 1`` output tokens are its first ``k - 1`` (a one-token word is banned at every step). Only output
  tokens count, never the prompt's, as in vLLM.

Logprobs stay those of the raw distribution, as for every other logits control (vLLM's default).
"""

from collections.abc import Sequence

MAX_BAD_WORDS = 128  # token sequences after tokenization, vLLM's default cap (VLLM_MAX_NUM_BAD_WORDS)


def bad_words_token_ids(words: Sequence[str], tokenizer) -> list[list[int]]:
    """The token sequences ``words`` ban, in vLLM's order: each word's plain form, then its space-prefixed form
    when that is a different word token of the same length. ValueError for a word that tokenizes to nothing, or
    for more than ``MAX_BAD_WORDS`` sequences."""
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words entries must tokenize to at least one token, got {word[:50]!r}")
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
        if len(out) > MAX_BAD_WORDS:
            raise ValueError(f"too many bad words after tokenization: more than {MAX_BAD_WORDS}")
    return out


def bad_word_bans(words: Sequence[Sequence[int]], token_ids: Sequence[int], num_prompt: int) -> list[int]:
    """The tokens the bad words (token sequences) ban after the row's output so far, ``token_ids[num_prompt:]``
    (read from its end: a step costs the words' lengths, not the output's)."""
    banned = []
    num_output = len(token_ids) - num_prompt
    for ids in words:
        k = len(ids) - 1  # the prefix that must have just been generated
        if k > num_output:
            continue
        if k == 0 or list(token_ids[len(token_ids) - k :]) == list(ids[:k]):
            banned.append(ids[-1])
    return banned


def needs_newest_token(words: Sequence[Sequence[int]] | None) -> bool:
    """Whether the bans depend on the output's newest token (a word of two tokens or more): a step may then not be
    launched before the previous step's token is on the host (async scheduling)."""
    return any(len(ids) > 1 for ids in words or ())
