"""A tokenizer's vocabulary as the automata see it: each token's bytes, split into
context-independent and context-dependent tokens (notebook 12).

A byte-level BPE tokenizer (GPT-2's, SmolLM2's) has tokens that are arbitrary byte
strings: most decode to whole UTF-8 characters (``"Ġthe"`` is ``" the"``), but some hold
half a character (``"\\xe4\\xb8"``, the first two bytes of a CJK character) or start in
the middle of one. A character automaton can judge a whole-character token from its
current state alone: such tokens are **context-independent**, and their validity per
state is computed once, before generation (:mod:`llmlab.structured.table`). A token with
a partial character depends on the bytes the previous tokens left pending: those few
**context-dependent** tokens are checked at run time (:mod:`llmlab.structured.matcher`).
This is the split of XGrammar (Dong et al., *XGrammar: Flexible and Efficient Structured
Generation Engine for Large Language Models*, MLSys 2025, https://arxiv.org/abs/2411.15100),
where the context is a pushdown automaton's stack; for a DFA the context is the pending
bytes of an unfinished character.

Special tokens (``<|im_end|>``, ``<|endoftext|>``, ...) are not text: the grammar never
allows them, except the end-of-sequence token once the grammar accepts.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for
    each byte in a byte-level BPE vocabulary -> the byte."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@dataclass
class TokenVocab:
    """Per token id (``0 .. vocab_size - 1``; ids past the tokenizer's are special):

    - ``token_bytes[i]``: its bytes;
    - ``codepoints`` int32 [vocab_size, max_chars]: the characters of a
      context-independent token, padded with -1; ``lengths`` int32 [vocab_size] its
      number of characters (0 for the other tokens);
    - ``independent`` bool: whole UTF-8 characters, not special, not empty;
    - ``special`` bool; ``eos_token_id``.
    """

    token_bytes: list[bytes]
    codepoints: np.ndarray
    lengths: np.ndarray
    independent: np.ndarray
    special: np.ndarray
    eos_token_id: int

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    @property
    def dependent_ids(self) -> np.ndarray:
        """The context-dependent tokens: text, but not whole characters."""
        return np.nonzero(~self.independent & ~self.special)[0]

    def text(self, token_id: int) -> str | None:
        """A context-independent token's text (None for the others)."""
        if not self.independent[token_id]:
            return None
        return self.token_bytes[token_id].decode("utf-8")

    @classmethod
    def from_token_bytes(cls, token_bytes: list[bytes], special, eos_token_id: int
                         ) -> "TokenVocab":
        special = np.asarray(special, dtype=bool)
        texts: list[str | None] = []
        for b, sp in zip(token_bytes, special):
            if sp or not b:
                texts.append(None)
                continue
            try:
                texts.append(b.decode("utf-8"))
            except UnicodeDecodeError:
                texts.append(None)
        independent = np.array([t is not None for t in texts], dtype=bool)
        lengths = np.array([len(t) if t is not None else 0 for t in texts], dtype=np.int32)
        width = max(1, int(lengths.max()) if len(lengths) else 1)
        codepoints = np.full((len(texts), width), -1, dtype=np.int32)
        for i, t in enumerate(texts):
            if t:
                codepoints[i, :len(t)] = [ord(c) for c in t]
        return cls(list(token_bytes), codepoints, lengths, independent, special, int(eos_token_id))

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None,
                       eos_token_id: int | None = None) -> "TokenVocab":
        """The vocabulary of a byte-level BPE tokenizer (HF ``tokenizers``), padded to the
        model's ``vocab_size`` with special (never allowed) ids. Cached per tokenizer."""
        key = (vocab_size, eos_token_id)
        per_tok = _CACHE.get(tokenizer)
        if per_tok is not None and key in per_tok:
            return per_tok[key]
        n_tok = len(tokenizer)
        vocab_size = n_tok if vocab_size is None else int(vocab_size)
        if eos_token_id is None:
            eos_token_id = tokenizer.eos_token_id
        pieces = tokenizer.convert_ids_to_tokens(list(range(min(n_tok, vocab_size))))
        decoder = _byte_decoder()
        special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special_ids |= {int(i) for i, t in added.items() if getattr(t, "special", True)}
        token_bytes, special = [], []
        for i, piece in enumerate(pieces):
            if piece is None or i in special_ids:
                token_bytes.append(b"")
                special.append(True)
                continue
            try:
                token_bytes.append(bytes(decoder[c] for c in piece))
            except KeyError as e:
                raise ValueError(f"token {i} ({piece!r}) is not byte-level BPE: the structured "
                                 "backend reads GPT-2-style byte-level vocabularies only") from e
            special.append(False)
        for _ in range(len(pieces), vocab_size):
            token_bytes.append(b"")
            special.append(True)
        vocab = cls.from_token_bytes(token_bytes, special, eos_token_id)
        try:
            _CACHE.setdefault(tokenizer, {})[key] = vocab
        except TypeError:                    # a tokenizer that cannot be weakly referenced
            pass
        return vocab


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

__all__ = ["TokenVocab"]
