"""Structured outputs: grammars -> per-state token masks (notebook 12).

    from llmlab.structured import compile_grammar
    g = compile_grammar({"json_schema": schema}, tokenizer)       # or {"regex": ...}, {"choice": [...]}
    m = g.matcher(); m.mask_logits_(logits); m.advance(token)

The pieces, in the order notebook 12 builds them: :mod:`.regex` (a regex subset ->
Thompson NFA), :mod:`.dfa` (subset construction -> a DFA over character classes),
:mod:`.vocab` (the tokenizer's tokens as bytes; context-independent or not),
:mod:`.table` (DFA × vocabulary -> a token table per state), :mod:`.matcher` (the
:class:`Grammar` / :class:`Matcher` interface, and the llguidance backend), and
:mod:`.spec` (what a request may ask for; JSON Schema -> regex for a subset). The engine
(``SamplingParams(structured=...)``), ``llmlab.generate(..., structured=...)`` and the
server's ``response_format`` / ``tools`` / ``guided_*`` all go through
:func:`compile_grammar`.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

from .dfa import DFA, regex_to_dfa
from .matcher import (LLGuidanceGrammar, LLGuidanceMatcher, Matcher, RegexGrammar, RegexMatcher,
                      llguidance_tokenizer)
from .spec import (StructuredSpec, UnsupportedSchema, check_json_schema, coerce_spec,
                   json_schema_to_regex, spec_to_regex)
from .table import TokenTable, brute_force_mask, build_token_table, walk_tokens
from .vocab import TokenVocab

Grammar = RegexGrammar | LLGuidanceGrammar
CACHE_SIZE = 64
_GRAMMARS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def has_library() -> bool:
    """Whether the library backend (llguidance) is installed."""
    try:
        import llguidance  # noqa: F401
        import llguidance.torch  # noqa: F401
    except ImportError:
        return False
    return True


def _library_grammar(spec: StructuredSpec, tokenizer, vocab_size: int, eos: int):
    if not has_library():
        raise UnsupportedSchema(f"structured {spec.kind}: outside llmlab's own subset, and the "
                                "library backend (pip install llguidance) is not installed")
    lltok = llguidance_tokenizer(tokenizer, vocab_size, eos)
    if spec.kind == "json_schema":
        return LLGuidanceGrammar.from_json_schema(spec.value, lltok, vocab_size, eos)
    if spec.kind == "json_object":
        return LLGuidanceGrammar.from_json_schema({"type": "object"}, lltok, vocab_size, eos)
    return LLGuidanceGrammar.from_regex(spec_to_regex(spec), lltok, vocab_size, eos)


def compile_grammar(structured, tokenizer, vocab_size: int | None = None,
                    eos_token_id: int | None = None):
    """The grammar of ``structured`` (a :class:`StructuredSpec` or what
    :func:`coerce_spec` takes) over ``tokenizer``'s vocabulary, padded to the model's
    ``vocab_size``. Backend ``"auto"``: llmlab's own automaton when the spec is in its
    subset, else llguidance. The last :data:`CACHE_SIZE` grammars per tokenizer are kept,
    so a repeated schema compiles once."""
    spec = coerce_spec(structured)
    vocab_size = len(tokenizer) if vocab_size is None else int(vocab_size)
    eos = tokenizer.eos_token_id if eos_token_id is None else int(eos_token_id)
    cache = _GRAMMARS.setdefault(tokenizer, OrderedDict())
    key = (spec.key, vocab_size, eos)
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    grammar = None
    if spec.backend in ("auto", "llmlab") and spec.kind != "json_object":
        try:
            pattern = spec_to_regex(spec)
        except UnsupportedSchema:
            if spec.backend == "llmlab":
                raise
        else:
            vocab = TokenVocab.from_tokenizer(tokenizer, vocab_size, eos)
            grammar = RegexGrammar(regex_to_dfa(pattern), vocab, pattern=pattern)
    if grammar is None:
        grammar = _library_grammar(spec, tokenizer, vocab_size, eos)
    cache[key] = grammar
    while len(cache) > CACHE_SIZE:
        cache.popitem(last=False)
    return grammar


__all__ = ["compile_grammar", "coerce_spec", "has_library", "StructuredSpec", "UnsupportedSchema",
           "Grammar", "Matcher", "RegexGrammar", "RegexMatcher", "LLGuidanceGrammar",
           "LLGuidanceMatcher", "TokenVocab", "TokenTable", "DFA", "regex_to_dfa",
           "build_token_table", "walk_tokens", "brute_force_mask", "json_schema_to_regex",
           "spec_to_regex", "check_json_schema"]
