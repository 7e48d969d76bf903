"""Text of a growing token list without decoding the whole list at every step."""


class IncrementalDetokenizer:
    """The text of one request's output tokens, updated a few tokens at a time.

    Decoding all of a request's tokens at every step costs O(length) a step: over a 1000-token SmolLM2 output,
    146 us a step on average on our CPU machine (37 ms a step across 256 streams), against 8 us for ``update``.
    ``update`` decodes a short window: the tokens from ``_prefix`` (already emitted, kept as context: a tokenizer
    may render a token differently at the start of a string, e.g. without its leading space) to the end, and the
    context alone; the new text is what the window adds to the context. While the window's text ends in U+FFFD
    (a character whose UTF-8 bytes span tokens not all generated yet) nothing is emitted and the window grows.

    ``text`` equals ``tokenizer.decode(token_ids, skip_special_tokens=True)`` for the tokenizers the tests try
    (byte-level BPE, character-level, Metaspace) on random token lists; callers still decode the whole list once
    at the end and use that as the final text.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self._prefix = 0  # first token of the context window
        self._read = 0  # tokens [0, _read) are in ``text``

    def update(self, token_ids: list[int]) -> str:
        """Take the request's whole output token list (grown since the last call); return the text it adds."""
        if len(token_ids) <= self._read:
            return ""
        context = self._decode(token_ids[self._prefix : self._read])
        window = self._decode(token_ids[self._prefix :])
        if len(window) <= len(context) or window.endswith("\ufffd"):
            return ""
        new = window[len(context) :]
        self.text += new
        self._prefix, self._read = self._read, len(token_ids)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
