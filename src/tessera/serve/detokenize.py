"""Incremental detokenisation: the text of a growing list of generated tokens, where each new token costs a
decode of a short window (the tokens since the last text, plus those of the text before them as context),
not a decode of the whole output, which would make a long generation quadratic.

The text equals the tokenizer's decoding of all the tokens without its clean-up of spaces before
punctuation (``clean_up_tokenization_spaces=False``, as vLLM streams text): decoding a window with a few
tokens of context renders word-initial spaces as the whole decoding does, and a window whose text ends
inside a multi-byte character waits for the character's last token.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decoder makes of a character whose bytes have not all arrived


class IncrementalDetokenizer:
    """The text of the tokens added so far (see the module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self._context = 0  # first token of the window: the context before the tokens not in the text yet
        self._read = 0  # tokens whose text is in self.text

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, clean_up_tokenization_spaces=False) if tokens else ""

    def add(self, token: int) -> str:
        """Append ``token``; returns the text it completes ("" while its bytes end inside a character)."""
        self.tokens.append(token)
        return self._advance(partial=False)

    def finish(self) -> str:
        """The text of tokens still waiting for the rest of a character (a generation that ended inside one
        gets the decoder's replacement character for it); returns what it added."""
        return self._advance(partial=True)

    def _advance(self, partial: bool) -> str:
        """Move the tokens after the text into it (unless ``partial``, only once they end on a whole
        character); returns the text added."""
        before = self._decode(self.tokens[self._context:self._read])
        after = self._decode(self.tokens[self._context:])
        if not partial and (len(after) <= len(before) or after.endswith(REPLACEMENT)):
            return ""
        new = after[len(before):]
        self.text += new
        self._context, self._read = self._read, len(self.tokens)
        return new
