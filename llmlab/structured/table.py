"""DFA × vocabulary: which tokens each DFA state allows, and where each one leads
(notebook 12).

A token is allowed in a state when walking its characters from that state never hits a
dead transition: a token may run *through* several fields (``'",'`` ends a string and
starts the next property) and may stop *inside* one (``'Ġpar'`` is half a word): what
matters is that every character of it is allowed where it falls, and the state it ends
in is where the next token starts. The end-of-sequence token is allowed exactly in the
accepting states.

Done for every state once, before generation, this is the table that makes a mask a
lookup (XGrammar's precomputed context-independent tokens; outlines' index, Willard and
Louf, *Efficient Guided Generation for Large Language Models*, 2023,
https://arxiv.org/abs/2307.09702). :func:`walk_tokens` does one state with numpy: all
tokens step together, one character position at a time, and a token leaves the walk as
soon as it dies or ends. :func:`brute_force_mask` is the plain reference: each token
walked on its own in Python, what a per-step scan without the table costs.
"""
from __future__ import annotations

import numpy as np
import torch

from .dfa import DEAD, DFA
from .vocab import TokenVocab


def token_classes(dfa: DFA, vocab: TokenVocab) -> np.ndarray:
    """int32 [vocab_size, max_chars]: each context-independent token's characters as the
    DFA's classes, -1 past its end (and for every other token)."""
    cp = vocab.codepoints
    cls = dfa.classify(np.where(cp >= 0, cp, 0)).astype(np.int32)
    return np.where(cp >= 0, cls, -1).astype(np.int32)


def walk_tokens(dfa: DFA, vocab: TokenVocab, state: int, classes: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """The context-independent tokens allowed in ``state``, and the state each leads to:
    ``(ids, next_states)``, int32, ids ascending."""
    if classes is None:
        classes = token_classes(dfa, vocab)
    ids = np.nonzero(vocab.independent)[0].astype(np.int32)
    states = np.full(len(ids), state, dtype=np.int32)
    lengths = vocab.lengths[ids]
    done_ids, done_states = [], []
    pos = 0
    while len(ids):
        ended = lengths == pos                   # every character read: allowed
        if ended.any():
            done_ids.append(ids[ended])
            done_states.append(states[ended])
            keep = ~ended
            ids, states, lengths = ids[keep], states[keep], lengths[keep]
        if not len(ids):
            break
        nxt = dfa.transitions[states, classes[ids, pos]]
        alive = nxt != DEAD
        ids, states, lengths = ids[alive], nxt[alive], lengths[alive]
        pos += 1
    if not done_ids:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    ids, states = np.concatenate(done_ids), np.concatenate(done_states)
    order = np.argsort(ids, kind="stable")
    return ids[order].astype(np.int32), states[order].astype(np.int32)


def brute_force_mask(dfa: DFA, vocab: TokenVocab, state: int) -> np.ndarray:
    """bool [vocab_size]: the context-independent tokens allowed in ``state``, each
    walked character by character in Python, plus EOS if ``state`` accepts. The
    reference for the table, and the cost of a scan at every step."""
    mask = np.zeros(vocab.vocab_size, dtype=bool)
    for i in np.nonzero(vocab.independent)[0].tolist():
        if dfa.walk(state, vocab.token_bytes[i].decode("utf-8")) != DEAD:
            mask[i] = True
    mask[vocab.eos_token_id] = bool(dfa.accepting[state])
    return mask


class TokenTable:
    """Per DFA state: the allowed context-independent tokens (ascending) and their next
    states, ``row(state)``; masks are built from them on first use and kept (bool
    [vocab_size], EOS set in accepting states). Rows are walked when first asked for, or
    all at once by :meth:`precompute` (:meth:`build`)."""

    def __init__(self, dfa: DFA, vocab: TokenVocab, ids: list[np.ndarray] | None = None,
                 next_states: list[np.ndarray] | None = None):
        if ids is not None and (len(ids) != dfa.num_states or next_states is None
                                or len(next_states) != dfa.num_states):
            raise ValueError(f"a table needs one row per DFA state ({dfa.num_states}); got "
                             f"{len(ids)} and {None if next_states is None else len(next_states)}")
        self.dfa, self.vocab = dfa, vocab
        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if ids is not None:
            self._rows = {s: (ids[s], next_states[s]) for s in range(dfa.num_states)}
        self._classes: np.ndarray | None = None
        self._masks: dict[int, torch.Tensor] = {}

    def row(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, next_states)`` of ``state``: walked on first use, then kept."""
        r = self._rows.get(state)
        if r is None:
            if self._classes is None:
                self._classes = token_classes(self.dfa, self.vocab)
            r = self._rows[state] = walk_tokens(self.dfa, self.vocab, state, self._classes)
        return r

    @property
    def complete(self) -> bool:
        """Whether every state's row has been walked."""
        return len(self._rows) == self.dfa.num_states

    def precompute(self) -> "TokenTable":
        """Walk every state now (a server does it when the grammar is compiled; without
        it each state is walked the first time a sequence reaches it)."""
        for s in range(self.dfa.num_states):
            self.row(s)
        return self

    @classmethod
    def build(cls, dfa: DFA, vocab: TokenVocab) -> "TokenTable":
        """Walk every state's tokens (:func:`walk_tokens`)."""
        return cls(dfa, vocab).precompute()

    @classmethod
    def from_dense(cls, dfa: DFA, vocab: TokenVocab, allowed: np.ndarray,
                   next_state: np.ndarray) -> "TokenTable":
        """From ``allowed`` bool [num_states, vocab_size] and ``next_state`` int
        [num_states, vocab_size] (the form notebook 12's build returns). The EOS column of
        ``allowed`` is kept as given: a table may be wrong about it."""
        allowed, next_state = np.asarray(allowed, dtype=bool), np.asarray(next_state)
        shape = (dfa.num_states, vocab.vocab_size)
        if allowed.shape != shape or next_state.shape != shape:
            raise ValueError(f"allowed and next_state must both be [num_states, vocab_size] = "
                             f"{list(shape)}; got {list(allowed.shape)} and "
                             f"{list(next_state.shape)}")
        text = allowed & vocab.independent[None, :]
        ids = [np.nonzero(row)[0].astype(np.int32) for row in text]
        nexts = [next_state[s, i].astype(np.int32) for s, i in enumerate(ids)]
        table = cls(dfa, vocab, ids, nexts)
        table.eos_allowed = allowed[:, vocab.eos_token_id].copy()
        return table

    def eos(self, state: int) -> bool:
        """Whether the end-of-sequence token is allowed in ``state``."""
        given = getattr(self, "eos_allowed", None)
        return bool(self.dfa.accepting[state] if given is None else given[state])

    def mask(self, state: int) -> torch.Tensor:
        """bool [vocab_size]: the context-independent tokens allowed in ``state``, and EOS
        if it accepts. Kept once built: do not modify it."""
        m = self._masks.get(state)
        if m is None:
            m = torch.zeros(self.vocab.vocab_size, dtype=torch.bool)
            m[torch.from_numpy(self.row(state)[0].astype(np.int64))] = True
            m[self.vocab.eos_token_id] = self.eos(state)
            self._masks[state] = m
        return m

    def next_state(self, state: int, token: int) -> int:
        """Where a context-independent ``token`` leads from ``state`` (-1: not allowed)."""
        ids, nexts = self.row(state)
        j = int(np.searchsorted(ids, token))
        return int(nexts[j]) if j < len(ids) and ids[j] == token else DEAD

    def num_allowed(self, state: int) -> int:
        return int(len(self.row(state)[0])) + int(self.eos(state))

    def to_dense(self) -> tuple[np.ndarray, np.ndarray]:
        """(allowed bool [num_states, vocab_size], next_state int32, -1 where not allowed)."""
        s, v = self.dfa.num_states, self.vocab.vocab_size
        allowed = np.zeros((s, v), dtype=bool)
        nxt = np.full((s, v), DEAD, dtype=np.int32)
        for state in range(s):
            ids, nexts = self.row(state)
            allowed[state, ids] = True
            nxt[state, ids] = nexts
            allowed[state, self.vocab.eos_token_id] = self.eos(state)
        return allowed, nxt


def build_token_table(dfa: DFA, vocab: TokenVocab) -> TokenTable:
    """The table of every state of ``dfa`` over ``vocab`` (:meth:`TokenTable.build`)."""
    return TokenTable.build(dfa, vocab)


__all__ = ["TokenTable", "build_token_table", "walk_tokens", "brute_force_mask", "token_classes"]
