"""From an NFA to a DFA over character classes: the subset construction (notebook 12).

The alphabet is every Unicode code point, far too many columns for a table. But the
pattern only ever asks about a few sets of characters, so the code points split into
*classes*, intervals in which every character is in exactly the same sets:
``[boundaries[c], boundaries[c + 1])`` is class ``c``. A DFA state then has one
transition per class, and its table is ``transitions[num_states, num_classes]``.

Subset construction (Rabin and Scott, *Finite automata and their decision problems*,
IBM J. Res. Dev. 3(2), 1959, https://doi.org/10.1147/rd.32.0114): a DFA state is the set of
NFA states the NFA could be in; from it, class ``c`` leads to the epsilon-closure of every
NFA state one ``c`` character away. States that can no longer reach an accepting state
are removed (their transitions become -1, *dead*), so any live state can still be
completed: what a token mask needs, since a token into a dead end would trap the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .regex import MAX_CHAR, NFA, thompson

DEAD = -1
MAX_DFA_STATES = 20000


@dataclass
class DFA:
    """``transitions[state, class]``: the next state, or -1 (dead). ``accepting[state]``.
    ``boundaries[c]``: the first code point of class ``c`` (sorted, ``boundaries[0] == 0``).
    ``start`` is state 0 unless the pattern matches nothing (then the DFA has no states
    and ``start`` is -1)."""

    transitions: np.ndarray       # int32 [num_states, num_classes]
    accepting: np.ndarray         # bool [num_states]
    boundaries: np.ndarray        # int64 [num_classes]
    start: int = 0
    pattern: str | None = None

    @property
    def num_states(self) -> int:
        return int(self.transitions.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.boundaries.shape[0])

    def classify(self, codepoints) -> np.ndarray:
        """The class of each code point (any integer array)."""
        return np.searchsorted(self.boundaries, np.asarray(codepoints), side="right") - 1

    def step(self, state: int, char: str) -> int:
        """The state after one character (-1: dead)."""
        if state < 0:
            return DEAD
        return int(self.transitions[state, int(self.classify(ord(char)))])

    def walk(self, state: int, text: str) -> int:
        """The state after ``text`` (-1 as soon as it dies)."""
        for ch in text:
            state = self.step(state, ch)
            if state < 0:
                return DEAD
        return state

    def fullmatch(self, text: str) -> bool:
        end = self.walk(self.start, text)
        return end >= 0 and bool(self.accepting[end])

    def live_classes(self, state: int) -> np.ndarray:
        """The classes with a transition out of ``state``."""
        return np.nonzero(self.transitions[state] >= 0)[0]


def _alphabet(nfa: NFA) -> np.ndarray:
    cuts = {0}
    for ranges in nfa.char_sets():
        for lo, hi in ranges:
            cuts.add(lo)
            if hi < MAX_CHAR:
                cuts.add(hi + 1)
    return np.array(sorted(cuts), dtype=np.int64)


def _closure(nfa: NFA, states) -> frozenset:
    seen, stack = set(states), list(states)
    while stack:
        for t in nfa.eps[stack.pop()]:
            if t not in seen:
                seen.add(t)
                stack.append(t)
    return frozenset(seen)


def subset_construction(nfa: NFA, boundaries: np.ndarray | None = None,
                        max_states: int = MAX_DFA_STATES) -> DFA:
    """The DFA of ``nfa`` (untrimmed: states that cannot accept are still there)."""
    if boundaries is None:
        boundaries = _alphabet(nfa)
    num_classes = len(boundaries)
    # each NFA edge as the classes it covers: its ranges start and end on class boundaries
    moves: list[list[tuple[np.ndarray, int]]] = []
    for out in nfa.edges:
        row = []
        for ranges, target in out:
            cls = np.concatenate([np.arange(np.searchsorted(boundaries, lo),
                                            np.searchsorted(boundaries, hi, side="right"))
                                  for lo, hi in ranges] or [np.zeros(0, np.int64)])
            row.append((cls, target))
        moves.append(row)
    start = _closure(nfa, [nfa.start])
    index = {start: 0}
    order = [start]
    table: list[np.ndarray] = []
    i = 0
    while i < len(order):
        current = order[i]
        i += 1
        targets: list[set] = [set() for _ in range(num_classes)]
        for s in current:
            for cls, t in moves[s]:
                for c in cls.tolist():
                    targets[c].add(t)
        row = np.full(num_classes, DEAD, dtype=np.int32)
        closures: dict[frozenset, frozenset] = {}
        for c, ts in enumerate(targets):
            if not ts:
                continue
            key = frozenset(ts)
            nxt = closures.get(key)
            if nxt is None:
                nxt = closures[key] = _closure(nfa, ts)
            if nxt not in index:
                if len(order) >= max_states:
                    raise ValueError(f"the pattern needs more than {max_states} DFA states; "
                                     "simplify it (smaller {m,n} bounds, fewer nested "
                                     "repetitions)")
                index[nxt] = len(order)
                order.append(nxt)
            row[c] = index[nxt]
        table.append(row)
    accepting = np.array([nfa.accept in s for s in order], dtype=bool)
    return DFA(np.stack(table), accepting, boundaries, 0)


def trim(dfa: DFA) -> DFA:
    """Remove the states from which no accepting state can be reached (renumbered; the
    start stays 0 if it survives, else the DFA is empty with start -1)."""
    n = dfa.num_states
    alive = dfa.accepting.copy()
    changed = True
    while changed:                   # backward reachability from the accepting states
        nxt = dfa.transitions
        reach = (nxt >= 0) & alive[np.where(nxt >= 0, nxt, 0)]
        new = alive | reach.any(axis=1)
        changed = bool((new != alive).any())
        alive = new
    if not alive[dfa.start]:
        return DFA(np.zeros((0, dfa.num_classes), np.int32), np.zeros(0, bool), dfa.boundaries,
                   DEAD, dfa.pattern)
    keep = np.nonzero(alive)[0]
    renumber = np.full(n, DEAD, dtype=np.int32)
    renumber[keep] = np.arange(len(keep), dtype=np.int32)
    t = dfa.transitions[keep]
    t = np.where(t >= 0, renumber[np.where(t >= 0, t, 0)], DEAD).astype(np.int32)
    return DFA(t, dfa.accepting[keep], dfa.boundaries, int(renumber[dfa.start]), dfa.pattern)


def minimize(dfa: DFA) -> DFA:
    """Merge equivalent states (Moore's partition refinement): same acceptance and, per
    class, transitions into the same block. Counted repetitions ``{m,n}`` make many
    states that only differ by how far they are from the end; this keeps those distinct
    and merges the rest."""
    n = dfa.num_states
    if n == 0:
        return dfa
    block = dfa.accepting.astype(np.int64)
    while True:
        t = dfa.transitions
        sig = np.concatenate([block[:, None], np.where(t >= 0, block[np.where(t >= 0, t, 0)], -1)],
                             axis=1)
        _, new = np.unique(sig, axis=0, return_inverse=True)
        new = new.reshape(-1)
        if len(np.unique(new)) == len(np.unique(block)):
            block = new
            break
        block = new
    # renumber blocks so the start state's block is 0 and the order follows first appearance
    order: dict[int, int] = {}
    for s in [dfa.start] + list(range(n)):
        order.setdefault(int(block[s]), len(order))
    ids = np.array([order[int(b)] for b in block], dtype=np.int32)
    m = len(order)
    trans = np.full((m, dfa.num_classes), DEAD, dtype=np.int32)
    acc = np.zeros(m, dtype=bool)
    for s in range(n):
        row = dfa.transitions[s]
        trans[ids[s]] = np.where(row >= 0, ids[np.where(row >= 0, row, 0)], DEAD)
        acc[ids[s]] = dfa.accepting[s]
    return DFA(trans, acc, dfa.boundaries, 0, dfa.pattern)


def regex_to_dfa(pattern: str, max_states: int = MAX_DFA_STATES) -> DFA:
    """Parse, build the NFA, run the subset construction, trim and minimize."""
    dfa = minimize(trim(subset_construction(thompson(pattern), max_states=max_states)))
    dfa.pattern = pattern
    return dfa


__all__ = ["DFA", "DEAD", "subset_construction", "trim", "minimize", "regex_to_dfa",
           "MAX_DFA_STATES"]
