"""IncrementalDetokenizer against decoding the whole list, on the tokenizers we can build offline."""

import random
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lockstep.engine.detokenizer import IncrementalDetokenizer, decode, special_token_ids

TEXTS = [
    "Hello, world! Ça va? 日本語のテキスト 🙂🙂 naïve café — done.",
    "def f(x):\n    return x  # ok\n\n",
    " . , ' s n't  double  spaces ",
]


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-style: words carry a leading '▁', and the decoder drops the one that starts the string."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "</s>", "▁the", "▁cat", "s", "▁sat", "▁on", "▁mat", ".", "▁", ",", "▁é", "t", "é"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def check(tokenizer, ids: list[int], *options: bool) -> None:
    """``options``: skip_special_tokens, spaces_between_special_tokens (default True, True)."""
    detok = IncrementalDetokenizer(tokenizer, *options)
    pieces = []
    for n in range(1, len(ids) + 1):
        pieces.append(detok.update(ids[:n]))
        # Never ahead of, nor different from, the whole decode so far (it may hold back a partial character).
        assert decode(tokenizer, ids[:n], *options).startswith(detok.text), ids[:n]
    full = decode(tokenizer, ids, *options)
    assert "".join(pieces) == detok.text
    if not full.endswith("\ufffd"):
        assert detok.text == full, ids


def random_lists(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


def test_byte_level_bpe(embedded_model_dir: Path) -> None:
    # SmolLM2's tokenizer: random ids split multi-byte characters across tokens and hit special tokens.
    tok = AutoTokenizer.from_pretrained(embedded_model_dir)
    for ids in [tok.encode(t) for t in TEXTS] + random_lists(len(tok), 400):
        check(tok, ids)


def test_character_level(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for ids in [tok.encode(t) for t in TEXTS] + random_lists(len(tok), 100):
        check(tok, ids)


def test_metaspace_leading_space() -> None:
    # Decoded alone, "▁cat" is "cat"; after "▁the" it is " cat": the context window keeps the space.
    tok = metaspace_tokenizer()
    assert tok.decode(tok.convert_tokens_to_ids(["▁cat"])) == "cat"
    for ids in [tok.encode("the cats sat on the mat.")] + random_lists(len(tok), 200):
        check(tok, ids)


@pytest.mark.parametrize("spaces", [True, False])
def test_special_tokens_kept(embedded_model_dir: Path, spaces: bool) -> None:
    # skip_special_tokens=False, with and without spaces around the special tokens, on SmolLM2's chat tokens.
    tok = AutoTokenizer.from_pretrained(embedded_model_dir)
    special = sorted(special_token_ids(tok))
    assert tok.convert_tokens_to_ids("<|im_start|>") in special
    chat = tok.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False)
    # The reference: the template's text cut at its special tokens, the pieces joined with spaces.
    pieces = [p for p in re.split(r"(<\|im_start\|>|<\|im_end\|>)", chat) if p]
    assert decode(tok, tok.encode(chat), False, spaces) == (" ".join(pieces) if spaces else chat)
    rng = random.Random(1)
    mixed = [[rng.choice(special) if rng.random() < 0.2 else t for t in ids] for ids in random_lists(len(tok), 200)]
    for ids in [tok.encode(chat)] + mixed:
        check(tok, ids, False, spaces)


def test_nothing_new_returns_empty(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("abc")
    assert detok.update(ids) == "abc"
    assert detok.update(ids) == "" and detok.text == "abc"


@pytest.mark.parametrize("broken", [True, False])
def test_the_check_sees_a_wrong_window(broken: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Negative control: without the context window (each step decodes only its new tokens) the Metaspace
    # tokenizer loses the spaces between words, and the check above fails.
    tok = metaspace_tokenizer()
    if broken:
        monkeypatch.setattr(IncrementalDetokenizer, "update", _update_without_context)
    ids = tok.encode("the cat sat")
    if broken:
        with pytest.raises(AssertionError):
            check(tok, ids)
    else:
        check(tok, ids)


def _update_without_context(self: IncrementalDetokenizer, token_ids: list[int]) -> str:
    new = self._decode(token_ids[self._read :])
    self.text += new
    self._read = len(token_ids)
    return new
