"""Incremental detokenization: a completion's text, a few tokens at a time.

Decoding a completion's whole token list after every new token costs O(length) per token,
O(length²) for the completion: a 2,000-token answer would spend most of its time there. A
:class:`IncrementalDetokenizer` decodes only a short window instead, as vLLM's incremental
detokenizer and HF tokenizers' ``DecodeStream`` do: the tokens since ``prefix_offset``,
minus the text of those before ``read_offset`` (already emitted; they are decoded again only
as context, because a tokenizer may render a token differently at the start of a string,
e.g. SentencePiece drops a leading space). New text is emitted once it does not end in
U+FFFD (half of a multi-byte character split across tokens), then the window moves on.

The emitted pieces are final, so a stream can show them at once and their concatenation
is the completion's text: exactly what decoding the whole list gives, for valid UTF-8. A
U+FFFD that never completes (invalid bytes, e.g. from a random model) would keep the
window growing; once more than :data:`MAX_PENDING` tokens wait, the text is emitted up to
a token boundary that splits no character (decoding the two sides apart gives the same
text as together), and after :data:`MAX_STUCK` tokens up to any boundary: the window
stays bounded, so the cost per token does too. Taught in notebook 05.
"""
from __future__ import annotations

from typing import Sequence

MAX_PENDING = 3      # tokens that may wait for the rest of a character (UTF-8: up to 4 bytes)
MAX_STUCK = 12       # tokens after which invalid bytes are emitted wherever they split


class IncrementalDetokenizer:
    """The text of one completion's tokens, built by :meth:`add` as tokens arrive.

    ``pieces`` hold the emitted text (``length`` characters in all); ``tail(n)`` gives its
    last ``n`` characters without joining the whole text, for the stop-string check.
    """

    __slots__ = ("pieces", "length", "prefix_offset", "read_offset", "prefix_text")

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.length = 0
        self.prefix_offset = 0          # tokens before it are never decoded again
        self.read_offset = 0            # tokens before it have been emitted
        self.prefix_text = ""           # the decoded text of tokens[prefix_offset:read_offset]

    def add(self, tokenizer, token_ids: Sequence[int], end: int | None = None) -> str:
        """Read ``token_ids[:end]`` (default: all) past what was read before; returns the
        text that became final ("" while a character waits for its other bytes)."""
        end = len(token_ids) if end is None else end
        if end <= self.read_offset:
            return ""
        text = _decode(tokenizer, token_ids[self.prefix_offset:end])
        if not text.endswith("\ufffd"):
            return self._emit(tokenizer, token_ids, end, text)
        pending = end - self.read_offset
        if pending <= MAX_PENDING:            # the rest of a character may still come
            return ""
        # bytes that are no character: emit up to a boundary that splits none, keeping the
        # last tokens (they hold any character still being completed)
        for cut in range(end - MAX_PENDING, self.read_offset, -1):
            head = _decode(tokenizer, token_ids[self.prefix_offset:cut])
            if head + _decode(tokenizer, token_ids[cut:end]) == text:
                return self._emit(tokenizer, token_ids, cut, head)
        if pending > MAX_STUCK:
            cut = end - MAX_PENDING
            return self._emit(tokenizer, token_ids, cut,
                              _decode(tokenizer, token_ids[self.prefix_offset:cut]))
        return ""

    def flush(self, tokenizer, token_ids: Sequence[int], end: int | None = None) -> str:
        """The completion ends: read ``token_ids[:end]`` and emit everything, a trailing
        half character as U+FFFD (what decoding the whole list would give)."""
        end = len(token_ids) if end is None else end
        if end <= self.read_offset:
            return ""
        text = _decode(tokenizer, token_ids[self.prefix_offset:end])
        return self._emit(tokenizer, token_ids, end, text)

    def _emit(self, tokenizer, token_ids: Sequence[int], end: int, text: str) -> str:
        new = text[len(self.prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, end
        self.prefix_text = _decode(tokenizer, token_ids[self.prefix_offset:end])
        if new:
            self.pieces.append(new)
            self.length += len(new)
        return new

    def tail(self, n: int) -> str:
        """The last ``n`` characters of the text (all of it if shorter); costs O(n) plus the
        number of pieces they span, whatever the text's length."""
        if n <= 0:
            return ""
        got, size = [], 0
        for piece in reversed(self.pieces):
            got.append(piece)
            size += len(piece)
            if size >= n:
                break
        return "".join(reversed(got))[-n:]

    def text(self) -> str:
        """All the text emitted so far (O(length): for the final text, once)."""
        if len(self.pieces) > 1:             # keep one piece: the next call is O(1)
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True) if len(ids) else ""


__all__ = ["IncrementalDetokenizer", "MAX_PENDING", "MAX_STUCK"]
