"""Grammars and matchers: one interface over llmlab's automaton and the library's
(notebook 12).

A :class:`Grammar` is compiled once per (spec, tokenizer) and shared; each sequence
gets its own :class:`Matcher`, which follows the tokens it generates:

    m = grammar.matcher()
    m.mask_logits_(logits_row)      # forbidden tokens -> -inf, before sampling
    m.advance(token)                # after sampling
    m.accepts()                     # the output so far is a whole match
    m.is_finished()                 # EOS consumed, or nothing but EOS may follow

``allowed_mask()`` returns the bool [vocab_size] mask itself.

Two backends:

- ``"llmlab"`` (:class:`RegexGrammar`): a DFA (:mod:`.dfa`) and its token table
  (:mod:`.table`). A mask is the table's row for the current state (the
  context-independent tokens), plus the few context-dependent tokens (partial UTF-8
  characters, :mod:`.vocab`) checked at run time against the pending bytes; those checks
  are memoized per (state, pending bytes), so each is done once per grammar.
- ``"llguidance"`` (:class:`LLGuidanceGrammar`): Microsoft's llguidance
  (https://github.com/guidance-ai/llguidance), a Rust library with the full JSON Schema,
  regexes and Lark grammars, computing masks with a byte-level lexer and an Earley parser.
"""
from __future__ import annotations

import weakref
from abc import ABC, abstractmethod

import numpy as np
import torch

from .dfa import DEAD, DFA
from .table import TokenTable
from .vocab import TokenVocab

_UTF8_MIN = {2: 0x80, 3: 0x800, 4: 0x10000}
_UTF8_MAX = {2: 0x7FF, 3: 0xFFFF, 4: 0x10FFFF}


class Matcher(ABC):
    """One sequence's place in a grammar (see the module docstring); the backends
    implement the abstract methods."""

    vocab_size: int
    eos_token_id: int
    consumed: int = 0                 # tokens advanced over since the last reset

    @abstractmethod
    def allowed_mask(self) -> torch.Tensor:
        ...

    def mask_logits_(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits of forbidden tokens to -inf, in place; ``logits`` [vocab]."""
        mask = self.allowed_mask().to(logits.device)
        n = min(logits.shape[-1], mask.shape[0])
        logits[:n].masked_fill_(~mask[:n], float("-inf"))
        if logits.shape[-1] > n:
            logits[n:] = float("-inf")
        return logits

    @abstractmethod
    def advance(self, token: int) -> None:
        ...

    @abstractmethod
    def accepts(self) -> bool:
        ...

    @abstractmethod
    def is_finished(self) -> bool:
        ...

    @abstractmethod
    def reset(self) -> None:
        ...

    def catch_up(self, tokens) -> None:
        """Advance over ``tokens[self.consumed:]``: a sequence's matcher follows its
        output list even when a step stopped between appending a token and advancing, or
        the output was cleared (then it starts over)."""
        if self.consumed > len(tokens):
            self.reset()
        for t in tokens[self.consumed:]:
            self.advance(int(t))


def _split_utf8(data: bytes) -> tuple[str, bytes] | None:
    """(the whole characters of ``data``, the bytes of an unfinished last one), or None
    when ``data`` is not a valid UTF-8 prefix."""
    try:
        return data.decode("utf-8"), b""
    except UnicodeDecodeError as e:
        if e.reason == "unexpected end of data" and e.end == len(data):
            try:
                return data[:e.start].decode("utf-8"), data[e.start:]
            except UnicodeDecodeError:
                return None
        return None


def _pending_range(pending: bytes) -> tuple[int, int] | None:
    """The code points whose UTF-8 encoding starts with ``pending`` (1-3 bytes of an
    unfinished character): an inclusive range, or None if there are none."""
    lead = pending[0]
    n = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 0
    if not n or len(pending) >= n:
        return None
    value = lead & (0x7F >> n)
    for b in pending[1:]:
        value = (value << 6) | (b & 0x3F)
    free = 6 * (n - len(pending))
    lo, hi = max(value << free, _UTF8_MIN[n]), min((value << free) | ((1 << free) - 1), _UTF8_MAX[n])
    return (lo, hi) if lo <= hi else None


class RegexGrammar:
    """llmlab's own backend: a DFA, its token table, and the run-time check of the
    context-dependent tokens."""

    backend = "llmlab"

    def __init__(self, dfa: DFA, vocab: TokenVocab, table: TokenTable | None = None,
                 pattern: str | None = None, precompute: bool = False):
        if dfa.num_states == 0:
            raise ValueError(f"the pattern {pattern or dfa.pattern!r} matches nothing")
        self.dfa, self.vocab = dfa, vocab
        self.table = TokenTable(dfa, vocab) if table is None else table
        if precompute:
            self.table.precompute()
        self.pattern = pattern or dfa.pattern
        self.vocab_size, self.eos_token_id = vocab.vocab_size, vocab.eos_token_id
        self._dependent: dict[tuple[int, bytes], dict[int, tuple[int, bytes]]] = {}
        # states with a transition on some non-ASCII character: only there can a token
        # holding part of a multi-byte character be allowed
        first_non_ascii = int(dfa.classify(0x80))
        self._non_ascii = (dfa.transitions[:, first_non_ascii:] != DEAD).any(axis=1)
        self._dep_masks: dict[tuple[int, bytes], torch.Tensor] = {}

    def matcher(self) -> "RegexMatcher":
        return RegexMatcher(self)

    def _prefix_possible(self, state: int, pending: bytes) -> bool:
        rng = _pending_range(pending)
        if rng is None:
            return False
        c0, c1 = self.dfa.classify([rng[0], rng[1]])
        return bool((self.dfa.transitions[state, c0:c1 + 1] != DEAD).any())

    def dependent(self, state: int, pending: bytes) -> dict[int, tuple[int, bytes]]:
        """The context-dependent tokens allowed in ``state`` with ``pending`` bytes of an
        unfinished character: ``{token: (next state, next pending bytes)}`` (memoized).
        With bytes pending, these are the only tokens allowed: a whole-character token
        would leave the pending character unfinished forever."""
        key = (state, pending)
        found = self._dependent.get(key)
        if found is not None:
            return found
        found = {}
        if not pending and not self._non_ascii[state]:
            self._dependent[key] = found
            return found
        for t in self.vocab.dependent_ids.tolist():
            split = _split_utf8(pending + self.vocab.token_bytes[t])
            if split is None:
                continue
            text, rest = split
            s = self.dfa.walk(state, text)
            if s == DEAD or (rest and not self._prefix_possible(s, rest)):
                continue
            found[t] = (s, rest)
        self._dependent[key] = found
        return found

    def mask(self, state: int, pending: bytes) -> torch.Tensor:
        """bool [vocab_size]: every token allowed in (state, pending)."""
        key = (state, pending)
        m = self._dep_masks.get(key)
        if m is None:
            dep = self.dependent(state, pending)
            m = self.table.mask(state).clone() if not pending else \
                torch.zeros(self.vocab_size, dtype=torch.bool)
            if dep:
                m[torch.tensor(list(dep), dtype=torch.long)] = True
            self._dep_masks[key] = m
        return m


class RegexMatcher(Matcher):
    """A sequence's (DFA state, pending bytes) in a :class:`RegexGrammar`."""

    def __init__(self, grammar: RegexGrammar):
        self.grammar = grammar
        self.vocab_size, self.eos_token_id = grammar.vocab_size, grammar.eos_token_id
        self.reset()

    def reset(self) -> None:
        self.state, self.pending, self.ended, self.consumed = self.grammar.dfa.start, b"", False, 0

    def allowed_mask(self) -> torch.Tensor:
        if self.ended:
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        return self.grammar.mask(self.state, self.pending)

    def advance(self, token: int) -> None:
        g = self.grammar
        if self.ended:
            raise ValueError(f"token {token} after the end-of-sequence token")
        if token == self.eos_token_id:
            if not self.accepts():
                raise ValueError(f"the end-of-sequence token {token} is not allowed: the output "
                                 "is not a whole match yet")
            self.ended = True
        elif not self.pending and 0 <= token < self.vocab_size and g.vocab.independent[token]:
            nxt = g.table.next_state(self.state, token)
            if nxt == DEAD:
                raise ValueError(f"token {token} ({g.vocab.token_bytes[token]!r}) is not allowed "
                                 f"in state {self.state}")
            self.state = nxt
        else:
            found = g.dependent(self.state, self.pending).get(token)
            if found is None:
                raise ValueError(f"token {token} is not allowed in state {self.state} with "
                                 f"{self.pending!r} pending")
            self.state, self.pending = found
        self.consumed += 1

    def accepts(self) -> bool:
        return not self.pending and bool(self.grammar.dfa.accepting[self.state])

    def is_finished(self) -> bool:
        if self.ended:
            return True
        if self.pending or not self.accepts():
            return False
        return self.grammar.table.num_allowed(self.state) == 1 and \
            not self.grammar.dependent(self.state, b"")


# ---- the library backend -------------------------------------------------------------------

_LLTOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def llguidance_tokenizer(tokenizer, vocab_size: int, eos_token_id: int):
    """llguidance's view of an HF tokenizer (about a second to build; kept per tokenizer)."""
    import llguidance.hf

    per = _LLTOKENIZERS.setdefault(tokenizer, {})
    key = (vocab_size, eos_token_id)
    if key not in per:
        per[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                eos_token=eos_token_id)
    return per[key]


class LLGuidanceGrammar:
    """The library backend: a grammar in llguidance's format, checked on construction."""

    backend = "llguidance"

    def __init__(self, source: str, lltokenizer, vocab_size: int, eos_token_id: int):
        import llguidance

        errors = llguidance.LLMatcher.validate_grammar(source, lltokenizer)
        if errors:                            # "" when it compiles
            raise ValueError(f"the grammar does not compile: {errors}")
        self.source, self.lltokenizer = source, lltokenizer
        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id

    @classmethod
    def from_regex(cls, pattern: str, lltokenizer, vocab_size: int, eos_token_id: int):
        import llguidance

        return cls(llguidance.LLMatcher.grammar_from_regex(pattern), lltokenizer, vocab_size,
                   eos_token_id)

    @classmethod
    def from_json_schema(cls, schema: dict, lltokenizer, vocab_size: int, eos_token_id: int):
        import llguidance

        # one line, as llmlab's subset writes it: no free whitespace to wander into
        src = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        return cls(src, lltokenizer, vocab_size, eos_token_id)

    def matcher(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self)


class LLGuidanceMatcher(Matcher):
    """An ``llguidance.LLMatcher`` behind :class:`Matcher`."""

    def __init__(self, grammar: LLGuidanceGrammar):
        import llguidance
        import llguidance.torch as lgt

        self.grammar = grammar
        self.vocab_size, self.eos_token_id = grammar.vocab_size, grammar.eos_token_id
        self.m = llguidance.LLMatcher(grammar.lltokenizer, grammar.source)
        if self.m.is_error():
            raise ValueError(f"the grammar does not compile: {self.m.get_error()}")
        self._lgt = lgt
        self.bitmask = lgt.allocate_token_bitmask(1, grammar.lltokenizer.vocab_size)
        self.consumed = 0

    def reset(self) -> None:
        self.m.reset()
        self.consumed = 0

    def _fill(self) -> None:
        self._lgt.fill_next_token_bitmask(self.m, self.bitmask, 0)

    def allowed_mask(self) -> torch.Tensor:
        self._fill()
        # the bitmask is int32 words, token i in bit i % 32 of word i // 32 (little-endian
        # bytes): unpacked in one numpy call (llguidance.torch's apply_token_bitmask_inplace
        # takes milliseconds per row on a CPU)
        bits = np.unpackbits(self.bitmask[0].numpy().view(np.uint8), bitorder="little")
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        n = min(self.vocab_size, bits.shape[0])
        out[:n] = torch.from_numpy(bits[:n].astype(bool))
        return out

    def advance(self, token: int) -> None:
        if not self.m.consume_token(int(token)):
            raise ValueError(f"token {token} is not allowed here: {self.m.get_error()}")
        self.consumed += 1

    def accepts(self) -> bool:
        return bool(self.m.is_accepting())

    def is_finished(self) -> bool:
        return bool(self.m.is_stopped())


__all__ = ["Matcher", "RegexGrammar", "RegexMatcher", "LLGuidanceGrammar", "LLGuidanceMatcher",
           "llguidance_tokenizer"]
