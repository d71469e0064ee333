"""Text of a growing token list, streamed without ever breaking a character."""
from __future__ import annotations

from typing import List, Sequence

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Text of a growing token list, emitted only up to the last complete character.

    Decodes a short window (``prefix`` .. end) each time and emits what it adds beyond the
    window's earlier text; a decode ending in U+FFFD (half of a multi-byte character) waits.
    """

    def __init__(self, tokenizer, prompt_tail: Sequence[int] = ()):
        self.tok = tokenizer
        self.tokens: List[int] = list(prompt_tail)[-4:]  # context for the first tokens' spaces
        self.prefix = 0
        self.read = len(self.tokens)

    def push(self, token_id: int) -> str:
        self.tokens.append(token_id)
        before = self.tok.decode(self.tokens[self.prefix:self.read], skip_special_tokens=True)
        after = self.tok.decode(self.tokens[self.prefix:], skip_special_tokens=True)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        return after[len(before):]
