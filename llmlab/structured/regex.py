"""A regular-expression subset, parsed and turned into a Thompson NFA (notebook 12).

The grammar of a structured output is a regular expression matched against the *whole*
output (no anchors needed, none allowed). The subset:

- literals, and ``\\`` before any punctuation to take it literally;
- ``.`` (any character but a newline), classes ``[abc]``, ranges ``[a-z]``, negated
  classes ``[^"\\\\]``, and the escapes ``\\d`` ``\\w`` ``\\s`` (ASCII: ``[0-9]``,
  ``[A-Za-z0-9_]``, ``[ \\t\\n\\r\\f\\v]``) and their negations ``\\D`` ``\\W`` ``\\S``,
  ``\\n`` ``\\t`` ``\\r`` ``\\f`` ``\\v``, ``\\xHH`` and ``\\uHHHH``;
- groups ``( )`` and ``(?: )`` (both only group: nothing is captured), alternation ``|``;
- the quantifiers ``*``, ``+``, ``?``, ``{m}``, ``{m,}``, ``{m,n}`` (greedy; the lazy forms
  mean nothing when the whole output must match, and are refused).

Characters are Unicode code points; a set of them is a tuple of inclusive ``(lo, hi)``
ranges. The NFA is Thompson's construction (K. Thompson, *Regular expression search
algorithm*, CACM 11(6), 1968, https://doi.org/10.1145/363347.363387): each piece of the
pattern becomes a fragment with one start and one end state, joined by epsilon moves.
:mod:`llmlab.structured.dfa` then turns it into a DFA by the subset construction.

Anything outside the subset raises ValueError naming the position and what is allowed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_CHAR = 0x10FFFF
MAX_REPEAT = 1000          # {m,n} bounds above this are refused (the automaton would be huge)

Ranges = tuple[tuple[int, int], ...]

DIGIT: Ranges = ((0x30, 0x39),)
WORD: Ranges = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE: Ranges = ((0x09, 0x0D), (0x20, 0x20))
ANY_BUT_NEWLINE: Ranges = ((0, 0x09), (0x0B, MAX_CHAR))


def normalize(ranges) -> Ranges:
    """Sorted, merged, inclusive ranges."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def negate(ranges: Ranges) -> Ranges:
    """Every code point not in ``ranges``."""
    out, nxt = [], 0
    for lo, hi in normalize(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CHAR:
        out.append((nxt, MAX_CHAR))
    return tuple(out)


# ---- the syntax tree ------------------------------------------------------------------------

@dataclass(frozen=True)
class Chars:
    ranges: Ranges


@dataclass(frozen=True)
class Concat:
    parts: tuple


@dataclass(frozen=True)
class Alt:
    options: tuple


@dataclass(frozen=True)
class Repeat:
    node: object
    min: int
    max: int | None          # None: unbounded


EMPTY = Concat(())

_ESCAPE_CLASSES = {"d": DIGIT, "w": WORD, "s": SPACE}
_ESCAPE_CHARS = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}


class _Parser:
    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise ValueError(f"regex must be a string, got {type(pattern).__name__}")
        self.p, self.i = pattern, 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"regex {self.p!r}, at position {self.i}: {what}")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        c = self.p[self.i]
        self.i += 1
        return c

    def parse(self):
        node = self.alt()
        if self.i != len(self.p):
            raise self.error(f"unexpected {self.p[self.i]!r} (an unmatched ')'?)")
        return node

    def alt(self):
        options = [self.concat()]
        while self.peek() == "|":
            self.take()
            options.append(self.concat())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def concat(self):
        parts = []
        while self.peek() is not None and self.peek() not in "|)":
            parts.append(self.quantified())
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def quantified(self):
        node = self.atom()
        while (c := self.peek()) is not None and c in "*+?{":
            start = self.i
            if c == "{":
                bounds = self.braces()
                if bounds is None:            # a literal '{' (as Python's re reads "a{")
                    self.i = start
                    break
                lo, hi = bounds
            else:
                self.take()
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            if self.peek() in ("?", "+"):
                raise self.error("lazy and possessive quantifiers are not supported (the "
                                 "whole output must match, so they would change nothing)")
            node = Repeat(node, lo, hi)
        return node

    def braces(self) -> tuple[int, int | None] | None:
        j = self.p.find("}", self.i)
        if j < 0:
            return None
        body = self.p[self.i + 1:j]
        lo_s, comma, hi_s = body.partition(",")
        if not lo_s.isdigit() or (hi_s and not hi_s.isdigit()):
            return None
        lo = int(lo_s)
        hi = lo if not comma else (int(hi_s) if hi_s else None)
        if hi is not None and hi < lo:
            raise self.error(f"{{{body}}}: the upper bound is below the lower one")
        if max(lo, hi or 0) > MAX_REPEAT:
            raise self.error(f"{{{body}}}: bounds above {MAX_REPEAT} are not supported")
        self.i = j + 1
        return lo, hi

    def atom(self):
        c = self.take()
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.error("only (?:...) groups are supported (no look-around, named "
                                 "groups or flags)")
            node = self.alt()
            if self.peek() != ")":
                raise self.error("missing ')'")
            self.take()
            return node
        if c == "[":
            return Chars(self.char_class())
        if c == ".":
            return Chars(ANY_BUT_NEWLINE)
        if c == "\\":
            return Chars(self.escape(in_class=False))
        if c in "^$":
            raise self.error(f"anchor {c!r}: the whole output always matches, anchors are not "
                             "needed (and not supported)")
        if c in "*+?":
            raise self.error(f"quantifier {c!r} with nothing before it")
        if c == ")":
            raise self.error("unmatched ')'")
        return Chars(((ord(c), ord(c)),))

    def escape(self, in_class: bool) -> Ranges:
        if self.peek() is None:
            raise self.error("a trailing backslash")
        c = self.take()
        if c in _ESCAPE_CLASSES:
            return _ESCAPE_CLASSES[c]
        if c.lower() in _ESCAPE_CLASSES:                 # \D \W \S
            return negate(_ESCAPE_CLASSES[c.lower()])
        if c in _ESCAPE_CHARS:
            ch = _ESCAPE_CHARS[c]
            return ((ord(ch), ord(ch)),)
        if c in "xu":
            n = 2 if c == "x" else 4
            digits = self.p[self.i:self.i + n]
            if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"\\{c} needs {n} hex digits")
            self.i += n
            v = int(digits, 16)
            return ((v, v),)
        if c.isalnum():
            raise self.error(f"unknown escape \\{c}; allowed: \\d \\w \\s \\D \\W \\S \\n \\t "
                             "\\r \\f \\v \\0 \\xHH \\uHHHH, or a backslash before punctuation")
        return ((ord(c), ord(c)),)

    def class_char(self) -> Ranges:
        if self.peek() is None:
            raise self.error("missing ']'")
        c = self.take()
        if c == "\\":
            return self.escape(in_class=True)
        return ((ord(c), ord(c)),)

    def char_class(self) -> Ranges:
        negated = self.peek() == "^"
        if negated:
            self.take()
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.peek() is None:
                raise self.error("missing ']'")
            if self.peek() == "]" and not first:
                self.take()
                break
            first = False
            lo = self.class_char()
            if (self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]"
                    and len(lo) == 1 and lo[0][0] == lo[0][1]):
                self.take()
                hi = self.class_char()
                if len(hi) != 1 or hi[0][0] != hi[0][1]:
                    raise self.error("a range must end in a single character")
                if hi[0][0] < lo[0][0]:
                    raise self.error("a range whose end is before its start")
                ranges.append((lo[0][0], hi[0][0]))
            else:
                ranges.extend(lo)
        ranges_n = normalize(ranges)
        return negate(ranges_n) if negated else ranges_n


def parse(pattern: str):
    """The syntax tree of ``pattern`` (:class:`Chars`, :class:`Concat`, :class:`Alt`,
    :class:`Repeat`); ValueError naming the position of anything outside the subset."""
    return _Parser(pattern).parse()


# ---- Thompson's NFA -------------------------------------------------------------------------

@dataclass
class NFA:
    """States 0..n-1. ``edges[s]``: ``(ranges, target)`` moves on one character;
    ``eps[s]``: targets reached without reading anything. One ``start``, one ``accept``."""

    edges: list[list[tuple[Ranges, int]]] = field(default_factory=list)
    eps: list[list[int]] = field(default_factory=list)
    start: int = 0
    accept: int = 0

    def new_state(self) -> int:
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    @property
    def num_states(self) -> int:
        return len(self.edges)

    def char_sets(self) -> list[Ranges]:
        """Every character set on an edge (the DFA's alphabet is cut from them)."""
        return [r for out in self.edges for r, _ in out]


def _fragment(nfa: NFA, node) -> tuple[int, int]:
    """Add ``node`` to ``nfa``; its (start, end) states."""
    if isinstance(node, Chars):
        s, e = nfa.new_state(), nfa.new_state()
        nfa.edges[s].append((node.ranges, e))
        return s, e
    if isinstance(node, Concat):
        s = e = nfa.new_state()
        for part in node.parts:
            ps, pe = _fragment(nfa, part)
            nfa.eps[e].append(ps)
            e = pe
        return s, e
    if isinstance(node, Alt):
        s, e = nfa.new_state(), nfa.new_state()
        for option in node.options:
            os_, oe = _fragment(nfa, option)
            nfa.eps[s].append(os_)
            nfa.eps[oe].append(e)
        return s, e
    if isinstance(node, Repeat):
        s = e = nfa.new_state()
        for _ in range(node.min):                      # the required copies
            ps, pe = _fragment(nfa, node.node)
            nfa.eps[e].append(ps)
            e = pe
        if node.max is None:                           # then a loop: zero or more
            ps, pe = _fragment(nfa, node.node)
            end = nfa.new_state()
            nfa.eps[e] += [ps, end]
            nfa.eps[pe] += [ps, end]
            return s, end
        end = nfa.new_state()
        for _ in range(node.max - node.min):           # then optional copies, each may stop
            nfa.eps[e].append(end)
            ps, pe = _fragment(nfa, node.node)
            nfa.eps[e].append(ps)
            e = pe
        nfa.eps[e].append(end)
        return s, end
    raise TypeError(f"not a regex node: {node!r}")


def thompson(node) -> NFA:
    """The NFA of a syntax tree (or of a pattern string)."""
    if isinstance(node, str):
        node = parse(node)
    nfa = NFA()
    nfa.start, nfa.accept = _fragment(nfa, node)
    return nfa


def escape(text: str) -> str:
    """``text`` as a regex that matches exactly it."""
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}-/" else
                   (f"\\u{ord(c):04x}" if ord(c) < 0x20 else c) for c in text)


__all__ = ["parse", "thompson", "NFA", "Chars", "Concat", "Alt", "Repeat", "escape", "normalize",
           "negate", "MAX_CHAR", "DIGIT", "WORD", "SPACE", "ANY_BUT_NEWLINE"]
