"""The exercises of notebook 12 (structured outputs).

- ``nb12.token_table`` (build): DFA × vocabulary -> the token table, the core of
  constrained decoding. The notebook gives the regex parser, Thompson's NFA and the
  subset construction (``llmlab.structured.regex_to_dfa``) and the vocabulary as code
  points (``TokenVocab``); the student writes the walk of every token from every state.
  The checker compares the table with llmlab's on every state and with a brute-force walk
  on two, then runs SmolLM2's generation constrained by it (greedy and sampled) and
  checks that every output matches the pattern. Why a token cannot be judged by its first
  character is told in the notebook's prose and named by this checker (the "first character
  only" mistake), not asked as a separate question.
- ``nb12.predict_allowed_fraction`` (predict): the share of the vocabulary allowed inside
  a JSON string value, against the measurement.
- ``nb12.predict_naive_tool_stream`` (predict): what a streaming parser that forwards
  everything after ``"arguments":`` hands the client.
- ``nb12.stream_arguments`` (build, stretch): that parser, done right.

The student's function for the build::

    token_table(dfa, vocab) -> (allowed, next_state)

``dfa.transitions`` int [num_states, num_classes] (-1: dead), ``dfa.accepting`` bool
[num_states], ``dfa.classify(codepoints)`` -> classes; ``vocab.codepoints`` int
[vocab_size, max_chars] (each context-independent token's characters, -1 past its end),
``vocab.lengths``, ``vocab.independent`` bool, ``vocab.eos_token_id``. Returns ``allowed``
bool [num_states, vocab_size] (a context-independent token whose every character has a
transition; EOS exactly in the accepting states; nothing else) and ``next_state`` int
[num_states, vocab_size] (the state after the token; -1 where not allowed).
"""
from __future__ import annotations

import functools
import json
import re

import numpy as np

from . import Verdict, exercise, forbid, right, wrong
from ..structured import (RegexGrammar, TokenTable, TokenVocab, brute_force_mask,
                          build_token_table, regex_to_dfa, walk_tokens)

NB = "12_structured_outputs"
PATTERN = r'\{"city":"[A-Z][a-z]{1,11}","temp":-?[0-9]{1,2}\}'
PROMPTS = ("Give the weather in one city as JSON with the fields city and temp.",
           "What is the temperature in Paris? Answer as JSON.",
           "Pick a city in Japan and report its temperature as JSON.")
NEW_TOKENS = 32


# ---- the reference and realistic mistakes ---------------------------------------------------

def reference_token_table(dfa, vocab):
    """Every token walked from each state, one character position at a time; a token
    leaves the walk as soon as a transition is dead."""
    num_states, v = dfa.num_states, vocab.vocab_size
    cp = vocab.codepoints
    classes = np.where(cp >= 0, dfa.classify(np.maximum(cp, 0)), -1)
    allowed = np.zeros((num_states, v), dtype=bool)
    next_state = np.full((num_states, v), -1, dtype=np.int64)
    for s in range(num_states):
        ids = np.nonzero(vocab.independent)[0]          # whole-character tokens only
        state = np.full(len(ids), s, dtype=np.int64)
        for j in range(cp.shape[1]):
            longer = vocab.lengths[ids] > j             # tokens with a j-th character
            if not longer.any():
                break
            state[longer] = dfa.transitions[state[longer], classes[ids[longer], j]]
            keep = state >= 0                           # dead: the token does not fit
            ids, state = ids[keep], state[keep]
        allowed[s, ids] = True
        next_state[s, ids] = state
        allowed[s, vocab.eos_token_id] = dfa.accepting[s]   # stop once the pattern is matched
    return allowed, next_state


def _first_character_only(dfa, vocab):
    cp = vocab.codepoints
    first = dfa.classify(np.maximum(cp[:, 0], 0))
    nxt = dfa.transitions[:, first]                                  # [states, vocab]
    allowed = (nxt >= 0) & vocab.independent[None, :]
    allowed[:, vocab.eos_token_id] = dfa.accepting
    return allowed, np.where(allowed, nxt, -1)


def _must_end_accepting(dfa, vocab):
    allowed, nxt = reference_token_table(dfa, vocab)
    ends = np.where(nxt >= 0, dfa.accepting[np.maximum(nxt, 0)], False)
    allowed = allowed & ends                     # only tokens that complete the match
    allowed[:, vocab.eos_token_id] = dfa.accepting
    return allowed, np.where(allowed, nxt, -1)


def _no_eos(dfa, vocab):
    allowed, nxt = reference_token_table(dfa, vocab)
    allowed[:, vocab.eos_token_id] = False
    return allowed, nxt


def _state_after_first_character(dfa, vocab):
    allowed, _ = reference_token_table(dfa, vocab)
    first = dfa.classify(np.maximum(vocab.codepoints[:, 0], 0))
    nxt = np.where(allowed, dfa.transitions[:, first], -1)
    return allowed, nxt


def _library_wrapper(dfa, vocab):
    return build_token_table(dfa, vocab).to_dense()


# ---- the checker -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def smollm2():
    import llmlab

    return (llmlab.load_model("smollm2-135m", attention="sdpa"),
            llmlab.load_tokenizer("smollm2-135m"))


@functools.lru_cache(maxsize=1)
def exercise_dfa():
    """The DFA and the vocabulary the build is checked on (SmolLM2's tokenizer)."""
    import llmlab

    tok = llmlab.load_tokenizer("smollm2-135m")
    return regex_to_dfa(PATTERN), TokenVocab.from_tokenizer(tok, len(tok), tok.eos_token_id)


def _describe(vocab, token: int) -> str:
    text = vocab.text(token)
    return repr(text) if text is not None else f"#{token}"


def _compare(got, want, dfa, vocab) -> str | None:
    allowed, nxt = got
    want_allowed, want_next = want
    shape = want_allowed.shape
    allowed, nxt = np.asarray(allowed), np.asarray(nxt)
    if allowed.shape != shape or nxt.shape != shape:
        return (f"allowed and next_state should both be [num_states, vocab_size] = {list(shape)}; "
                f"got {list(allowed.shape)} and {list(nxt.shape)}.")
    allowed = allowed.astype(bool)
    eos = vocab.eos_token_id
    bad_eos = np.nonzero(allowed[:, eos] != want_allowed[:, eos])[0]
    if len(bad_eos):
        s = int(bad_eos[0])
        return (f"the end-of-sequence token in state {s}: yours {'allows' if allowed[s, eos] else 'forbids'} "
                f"it, but state {s} {'accepts' if dfa.accepting[s] else 'does not accept'} "
                f"({len(bad_eos)} states wrong). Once the pattern is matched the model must be "
                "able to stop.")
    extra = allowed & ~want_allowed
    missing = want_allowed & ~allowed
    if extra.any():
        s, t = (int(x) for x in np.argwhere(extra)[0])
        return (f"{int(extra.sum())} (state, token) pairs are allowed that should not be, e.g. "
                f"token {_describe(vocab, t)} in state {s}: a character part-way through it has "
                "no transition. Every character of a token must fit, not just the first.")
    if missing.any():
        s, t = (int(x) for x in np.argwhere(missing)[0])
        return (f"{int(missing.sum())} (state, token) pairs are forbidden that should be "
                f"allowed, e.g. token {_describe(vocab, t)} in state {s}: it fits, and may stop "
                "inside the match (the next token goes on from where it ends).")
    ok = want_allowed.copy()
    ok[:, eos] = False
    if not np.array_equal(np.where(ok, nxt, -1), np.where(ok, want_next, -1)):
        s, t = (int(x) for x in np.argwhere(ok & (nxt != want_next))[0])
        return (f"next_state is wrong for token {_describe(vocab, t)} in state {s}: yours "
                f"{int(nxt[s, t])}, the walk ends in {int(want_next[s, t])}. It is the state "
                "after the token's last character.")
    return None


def _generate_with(table_pair, dfa, vocab) -> tuple[str | None, list[str]]:
    import llmlab

    model, tok = smollm2()
    table = TokenTable.from_dense(dfa, vocab, *table_pair)
    grammar = RegexGrammar(dfa, vocab, table, pattern=PATTERN)
    texts = []
    for temperature, seed in ((0.0, None), (1.0, 0)):
        gens = llmlab.generate(model, tok, list(PROMPTS), max_new_tokens=NEW_TOKENS,
                               temperature=temperature, seed=seed, kv_cache="contiguous",
                               structured=grammar)
        for g in gens:
            texts.append(g.text)
            if not re.fullmatch(PATTERN, g.text):
                return (f"SmolLM2 constrained by your table wrote {g.text!r} "
                        f"(finish {g.finish_reason}), which does not match the pattern."), texts
    return None, texts


@exercise("nb12.token_table", notebook=NB, kind="build",
          title="build: the token table of a DFA over SmolLM2's vocabulary",
          solution=reference_token_table,
          wrong_variants={
              "first character only": (_first_character_only, ("part-way",)),
              "must end in an accepting state": (_must_end_accepting, ("inside the match",)),
              "no EOS on accept": (_no_eos, ("end-of-sequence",)),
              "state after the first character": (_state_after_first_character,
                                                  ("next_state",)),
              "library": (_library_wrapper, ("llmlab's own",)),
          })
def _check_token_table(fn, **_) -> Verdict:
    dfa, vocab = exercise_dfa()
    want = build_token_table(dfa, vocab).to_dense()
    with forbid(walk_tokens, build_token_table, TokenTable.build, TokenTable.to_dense,
                TokenTable.precompute, brute_force_mask):
        got = fn(dfa, vocab)
    if not isinstance(got, tuple) or len(got) != 2:
        return wrong(f"return (allowed, next_state), got {type(got).__name__}.",
                     "two arrays, both [num_states, vocab_size].")
    if (problem := _compare(got, want, dfa, vocab)) is not None:
        return wrong(problem, "walk each token from each state, one character position at a "
                     "time, dropping a token as soon as a transition is -1.")
    mid = dfa.walk(dfa.start, '{"city":"Pa')
    for s in (dfa.start, mid):                  # the brute-force reference, token by token
        if not np.array_equal(np.asarray(got[0], bool)[s], brute_force_mask(dfa, vocab, s)):
            return wrong(f"state {s} differs from a token-by-token walk.")
    problem, texts = _generate_with(got, dfa, vocab)
    if problem is not None:
        return wrong(problem, "compare your table with the brute-force walk on the states "
                     "the output went through.")
    return right(f"your table equals llmlab's on all {dfa.num_states} states and the brute-force "
                 f"walk on two; SmolLM2 constrained by it wrote {len(texts)} outputs (greedy and "
                 f"sampled), all matching the pattern, e.g. {texts[0]!r}.")


# ---- predict: how much of the vocabulary fits inside a string --------------------------------

_FRACTION_CHOICES = {"a": "under 1%", "b": "1-10%", "c": "10-60%", "d": "over 60%"}


def fraction_letter(fraction: float) -> str:
    return "a" if fraction < 0.01 else "b" if fraction < 0.10 else "c" if fraction < 0.60 else "d"


def measured_string_fraction() -> float:
    """The share of SmolLM2's vocabulary allowed inside a JSON string value (llmlab's
    string pattern, unbounded), after its first character."""
    from ..structured.spec import STRING_CHAR

    dfa = regex_to_dfa(f'"{STRING_CHAR}*"')
    vocab = exercise_dfa()[1]
    state = dfa.walk(dfa.start, '"a')
    return float(TokenTable(dfa, vocab).mask(state).float().mean())


@exercise("nb12.predict_allowed_fraction", notebook=NB, kind="predict",
          title="predict: the share of SmolLM2's vocabulary allowed inside a JSON string",
          solution="measured", choices=_FRACTION_CHOICES,
          wrong_variants={"almost none": ("a", ("measured",))})
def _check_predict_allowed_fraction(answer, measured: float | None = None, **_) -> Verdict:
    if measured is None:
        measured = measured_string_fraction()
    want = fraction_letter(measured)
    if answer == "measured":
        answer = want
    letter = str(answer).strip().lower()[:1]
    if letter not in _FRACTION_CHOICES:
        return wrong(f"{answer!r} is not one of the choices {sorted(_FRACTION_CHOICES)}.",
                     "answer with a letter, e.g. \"b\".")
    said = f"({letter}) {_FRACTION_CHOICES[letter]}"
    if letter == want:
        return right(f"{said}: the measured share is {measured:.1%}. Inside a string almost "
                     "any token fits; only those holding a quote, a backslash or a control "
                     "character (or a special token) do not.")
    return wrong(f"you said {said}; the measured share is {measured:.1%}, option ({want}).",
                 "which characters may not appear inside a JSON string?")


# ---- predict: a naive streaming tool-call parser ---------------------------------------------

CALL = '{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}'
_STREAM_CHOICES = {
    "a": 'the arguments exactly: {"city":"Paris","unit":"celsius"}',
    "b": 'the arguments and one more "}" after them, which is not JSON',
    "c": 'the arguments without their final "}"',
    "d": "nothing at all until the stream ends, and then the whole call, name and all, at once",
}


def naive_arguments(text: str) -> str:
    """What a parser that forwards every character after ``"arguments":`` shows."""
    return text.split('"arguments":', 1)[1]


def stream_letter(shown: str, args: str) -> str:
    if shown == args:
        return "a"
    if shown.startswith(args) and shown[len(args):].strip() == "}":
        return "b"
    if args.startswith(shown):
        return "c"
    return "d"


@exercise("nb12.predict_naive_tool_stream", notebook=NB, kind="predict",
          title="predict: what does a parser that forwards everything after \"arguments\": "
                "hand the client?",
          solution="b", choices=_STREAM_CHOICES,
          wrong_variants={"exact": ("a", ("wrapper",))})
def _check_predict_naive_tool_stream(answer, **_) -> Verdict:
    args = json.dumps(json.loads(CALL)["arguments"], separators=(",", ":"))
    shown = naive_arguments(CALL)
    want = stream_letter(shown, args)
    letter = str(answer).strip().lower()[:1]
    if letter not in _STREAM_CHOICES:
        return wrong(f"{answer!r} is not one of the choices {sorted(_STREAM_CHOICES)}.",
                     "answer with a letter.")
    if letter == want:
        return right(f"({letter}): the client got {shown!r}. The last '}}' closes the wrapper "
                     "object, not the arguments; a parser must count braces (outside strings) "
                     "and stop where the arguments' own object closes.")
    return wrong(f"({letter}) is not what happens: the client got {shown!r}, option ({want}); "
                 "the wrapper's closing brace came along.", "look at the last character.")


# ---- stretch: the streaming parser ------------------------------------------------------------

def reference_stream_arguments(pieces: list[str]) -> list[str]:
    """For each streamed piece of ``{"name": ..., "arguments": {...}}``, the arguments text
    that may be shown now."""
    head = re.compile(r'\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"arguments"\s*:\s*')
    buffer, start, pos, depth, in_str, esc, done = "", None, 0, 0, False, False, False
    out = []
    for piece in pieces:
        buffer += piece
        if start is None:
            m = head.match(buffer)
            if m is None:
                out.append("")
                continue
            start = pos = m.end()
        begin = pos
        while pos < len(buffer) and not done:
            c = buffer[pos]
            pos += 1
            if in_str:
                esc, in_str = (False, True) if esc else (c == "\\", c != '"')
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                done = depth == 0
        out.append(buffer[begin:pos])
    return out


def _forward_everything(pieces):
    return [p for p in naive_pieces(pieces)]


def naive_pieces(pieces: list[str]) -> list[str]:
    buffer, shown, out = "", 0, []
    for piece in pieces:
        buffer += piece
        if '"arguments":' not in buffer:
            out.append("")
            continue
        start = buffer.index('"arguments":') + len('"arguments":')
        shown = max(shown, start)
        out.append(buffer[shown:])
        shown = len(buffer)
    return out


def _braces_in_strings(pieces):
    buffer, out, depth, pos, start, done = "", [], 0, 0, None, False
    for piece in pieces:
        buffer += piece
        if start is None:
            if '"arguments":' not in buffer:
                out.append("")
                continue
            start = pos = buffer.index('"arguments":') + len('"arguments":')
        begin = pos
        while pos < len(buffer) and not done:
            c = buffer[pos]
            pos += 1
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                done = depth == 0
        out.append(buffer[begin:pos])
    return out


_STREAM_CASES = (
    '{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}',
    '{"name":"search","arguments":{"q":"a } and a {","tags":["x","y}"],"n":3}}',
    '{"name":"f","arguments":{"s":"say \\"}\\" twice","nested":{"l":[1,[2,{}]]}}}',
)


@exercise("nb12.stream_arguments", notebook=NB, kind="build", stretch=True,
          title="stretch: a streaming tool-call parser that hands out exactly the arguments",
          solution=reference_stream_arguments,
          wrong_variants={"forwards everything": (_forward_everything, ("one '}' too many",)),
                          "braces inside strings": (_braces_in_strings, ("inside a string",))})
def _check_stream_arguments(fn, **_) -> Verdict:
    for text in _STREAM_CASES:
        args = json.dumps(json.loads(text)["arguments"], separators=(",", ":"))
        for size in (1, 3, 7, len(text)):
            pieces = [text[i:i + size] for i in range(0, len(text), size)]
            got = fn(list(pieces))
            if not isinstance(got, list) or len(got) != len(pieces):
                return wrong(f"return one string per piece ({len(pieces)}), got "
                             f"{type(got).__name__} of {len(got) if hasattr(got, '__len__') else '?'}.")
            shown = "".join(got)
            if shown == args:
                continue
            if shown.startswith(args) and shown[len(args):] == "}":
                return wrong(f"for {text!r} in pieces of {size}, the client got one '}}' too many "
                             f"({shown!r}): the wrapper's brace is not part of the arguments.",
                             "count braces and stop where the arguments' object closes.")
            if args.startswith(shown):
                return wrong(f"for {text!r} in pieces of {size}, the client got {shown!r}: the end "
                             "of the arguments was lost (a brace inside a string stopped you "
                             "early?).", "a '}' inside a string is text: track quotes and escapes.")
            return wrong(f"for {text!r} in pieces of {size}, the client got {shown!r}, not "
                         f"{args!r} (a brace inside a string counted?).",
                         "a '}' inside a string is text: track quotes and escapes.")
    return right("the arguments come out exactly, in pieces of 1, 3, 7 and whole, braces inside "
                 "strings and escaped quotes included.")
