"""Structured outputs (llmlab.structured): the regex subset against Python's ``re``, the
JSON-schema subset, the token table against a brute-force walk, the context-dependent
tokens (partial UTF-8 characters), a token that spans the end of a field, parity with
the library backend (llguidance), and the engine / ``generate`` honouring
``structured=`` on tiny-llama (a random model: only the grammar makes its output valid).
"""
from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

import llmlab
from llmlab.engine import LLM, SamplingParams
from llmlab.structured import (TokenTable, TokenVocab, UnsupportedSchema, brute_force_mask,
                               coerce_spec, compile_grammar, has_library, json_schema_to_regex,
                               regex_to_dfa)
from llmlab.structured.regex import parse
from .conftest import THOROUGH

EOS = 2
PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer"},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]},
                                  "maxItems": 3}},
          "required": ["name", "age", "ok", "tags"]}


@pytest.fixture(scope="module")
def tok():
    return llmlab.load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def vocab(tok):
    return TokenVocab.from_tokenizer(tok, 49152, EOS)


# ---- regex -> DFA ------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", [r"a(b|c)*d", r"[0-9]{2,4}", r'"([^"\\]|\\.)*"', r"(ab|a)*",
                                     r"x?y+z{0,3}", r".*", r"[^a-c\n]+|\d\s\w", r"(?:ab){2,}c?",
                                     r"\x41\u00e9[é-ë]"])
def test_dfa_matches_what_python_re_matches(pattern):
    dfa = regex_to_dfa(pattern)
    rx = re.compile(pattern)
    rng = random.Random(0)
    alphabet = "abcdxyz019\"\\ \n\tAé"
    for _ in range(1500):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 7)))
        assert dfa.fullmatch(s) == bool(rx.fullmatch(s)), (pattern, s)


@pytest.mark.parametrize("pattern, words", [("^a", "anchor"), ("a*?", "lazy"), ("(?=a)", "(?:"),
                                            (r"\q", "unknown escape"), ("a(b", "missing ')'"),
                                            ("a{3,1}", "upper bound"), ("[z-a]", "range"),
                                            ("*a", "nothing before")])
def test_regex_outside_the_subset_is_refused_with_its_position(pattern, words):
    with pytest.raises(ValueError, match="position") as e:
        parse(pattern)
    assert words in str(e.value)


def test_a_pattern_that_matches_nothing_is_refused(tok):
    with pytest.raises(ValueError, match="matches nothing"):
        compile_grammar({"regex": r"a[^\s\S]"}, tok)      # a class with no character in it


# ---- JSON schema -> regex ------------------------------------------------------------------------

def test_schema_regex_accepts_valid_documents_and_rejects_invalid_ones():
    dfa = regex_to_dfa(json_schema_to_regex(PERSON))
    good = [{"name": "Ada", "age": 36, "ok": True, "tags": ["a", 3]},
            {"name": "", "age": -7, "ok": False, "tags": []},
            {"name": 'q"\\\n', "age": 0, "ok": True, "tags": [None, "b", "a"]}]
    bad = [{"name": "Ada", "age": 36, "ok": True},                       # missing tags
           {"name": "Ada", "age": 3.5, "ok": True, "tags": []},          # not an integer
           {"name": "x" * 13, "age": 1, "ok": True, "tags": []},         # maxLength
           {"name": "A", "age": 1, "ok": True, "tags": ["c"]},           # not in enum
           {"name": "A", "age": 1, "ok": True, "tags": ["a"] * 4},       # maxItems
           {"age": 1, "name": "A", "ok": True, "tags": []}]              # order
    for doc in good:
        assert dfa.fullmatch(json.dumps(doc, separators=(",", ":"))), doc
    for doc in bad:
        assert not dfa.fullmatch(json.dumps(doc, separators=(",", ":"))), doc


def test_pydantic_models_and_refs():
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str
        population: int

    class Trip(pydantic.BaseModel):
        to: City
        days: list[float]

    dfa = regex_to_dfa(coerce_spec({"json_schema": Trip}).key and json_schema_to_regex(Trip))
    doc = Trip(to=City(name="Lyon", population=522000), days=[1.5, 2.0])
    assert dfa.fullmatch(doc.model_dump_json())


@pytest.mark.parametrize("schema, word", [({"type": "string", "pattern": "a+"}, "pattern"),
                                          ({"type": "object", "properties": {"a": {"type": "integer"}}},
                                           "optional"),
                                          ({"type": "object"}, "without properties")])
def test_schemas_outside_the_subset_name_the_keyword(schema, word):
    with pytest.raises(UnsupportedSchema, match=word):
        json_schema_to_regex(schema)
    with pytest.raises(UnsupportedSchema):
        coerce_spec({"json_schema": schema, "backend": "llmlab"})


@pytest.mark.parametrize("structured, words", [
    ({"regex": "a("}, "structured regex"), ({"json_schema": {"type": "strin"}}, "strin"),
    ({"json_schema": {"type": "object", "properties": {"a": {"maxLength": -1}}}},
     "properties.a.maxLength"),
    ({"choice": []}, "choice"), ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"regex": "a", "backend": "outlines"}, "backend"), ("a+", "dict")])
def test_bad_specs_are_refused_naming_them(structured, words):
    with pytest.raises(ValueError, match="structured") as e:
        SamplingParams(structured=structured)
    assert words in str(e.value)


# ---- the token table -----------------------------------------------------------------------------

@pytest.mark.parametrize("every_state", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_token_table_equals_the_brute_force_walk(vocab, every_state):
    dfa = regex_to_dfa(r'\{"id":[0-9]{1,3},"tag":"[a-z ]{0,4}"\}')
    table = TokenTable.build(dfa, vocab)
    assert table.complete
    # the brute force walks 49k tokens in Python per state: the fast tier takes the start,
    # a state inside the number and one inside the string
    inside = [dfa.walk(dfa.start, p) for p in ('{"id":1', '{"id":1,"tag":"a')]
    for state in (range(dfa.num_states) if every_state else [dfa.start, *inside]):
        want = brute_force_mask(dfa, vocab, state)
        got = table.mask(state).numpy()
        assert (got == want).all(), (state, np.nonzero(got != want)[0][:5])
    allowed, nxt = table.to_dense()
    again = TokenTable.from_dense(dfa, vocab, allowed, nxt)
    assert all(torch.equal(again.mask(s), table.mask(s)) for s in range(dfa.num_states))


def test_a_token_may_span_the_end_of_a_field(tok):
    """'",' closes the string and writes the separator in one token; '"}' would close
    the object too early (b is required) and is refused; the EOS only at the very end."""
    g = compile_grammar({"json_schema": {"type": "object", "properties": {
        "a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}, tok,
        49152, EOS)
    m = g.matcher()
    for t in tok.encode('{"a":"xy', add_special_tokens=False):
        m.advance(t)
    mask = m.allowed_mask()
    comma, close, quote_colon = (tok.convert_tokens_to_ids(x) for x in ('",', '"}', '":'))
    assert mask[comma] and not mask[close] and not mask[EOS]
    m.advance(comma)                                     # now inside the next property's key
    assert not m.allowed_mask()[comma]
    for t in tok.encode('"b":12}', add_special_tokens=False):
        m.advance(t)
    assert m.accepts() and m.allowed_mask()[EOS] and m.is_finished()
    assert quote_colon != comma


def test_context_dependent_tokens_complete_a_character_across_tokens(tok, vocab):
    """'龥' is three single-byte tokens in SmolLM2's vocabulary: none is a whole character,
    so none is in the table; each is checked at run time against the pending bytes."""
    g = compile_grammar({"regex": "[一-龥]{1,2}!"}, tok, 49152, EOS)
    ids = tok.encode("龥!", add_special_tokens=False)
    assert len(ids) == 3 + 1 and not vocab.independent[ids[:3]].any()
    m = g.matcher()
    assert m.allowed_mask()[ids[0]]
    assert not m.allowed_mask()[tok.convert_tokens_to_ids("!")]
    for t in ids[:3]:
        assert m.allowed_mask()[t]
        m.advance(t)
    assert m.allowed_mask()[ids[3]] and not m.accepts()
    m.advance(ids[3])
    assert m.accepts() and m.is_finished()
    # a continuation byte cannot start a character, and 'é' (U+00E9) is not in the range
    fresh = g.matcher()
    assert not fresh.allowed_mask()[ids[1]]
    assert not fresh.allowed_mask()[tok.encode("é", add_special_tokens=False)[0]]


def test_eos_only_where_the_grammar_accepts(tok):
    g = compile_grammar({"choice": ["yes", "yesterday"]}, tok, 49152, EOS)
    m = g.matcher()
    assert not m.allowed_mask()[EOS]
    m.advance(tok.convert_tokens_to_ids("yes"))
    assert m.accepts() and m.allowed_mask()[EOS] and not m.is_finished()
    with pytest.raises(ValueError, match="not allowed"):
        g.matcher().advance(EOS)


# ---- parity with the library ----------------------------------------------------------------------

CORPUS = {
    r'\{"id":[0-9]{1,3},"tag":"[a-z ]{0,6}"\}': ['{"id":7,"tag":"ab c"}', '{"id":123,"tag":""}',
                                                  '{"id":1234,"tag":""}', '{"id":7,"tag":"AB"}'],
    r"(yes|no|maybe)": ["yes", "maybe", "ye", "nope"],
    r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8})?": ["Ada Lovelace", "Paris", "paris", "A B"],
}


@pytest.mark.skipif(not has_library(), reason="llguidance is not installed")
@pytest.mark.parametrize("pattern", [p if i == 0 else pytest.param(p, marks=pytest.mark.slow)
                                     for i, p in enumerate(CORPUS)])
def test_both_backends_accept_the_same_strings_and_give_the_same_masks(tok, pattern):
    """Masks are compared wherever llguidance forces no bytes: where the grammar leaves a
    single way forward, llguidance narrows it to its canonical tokens
    (docs/fast_forward.md in its repository); llmlab keeps every token that fits."""
    own = compile_grammar({"regex": pattern, "backend": "llmlab"}, tok, 49152, EOS)
    lib = compile_grammar({"regex": pattern, "backend": "llguidance"}, tok, 49152, EOS)
    compared = 0
    for text in CORPUS[pattern]:
        ids = tok.encode(text, add_special_tokens=False)
        a, b = own.matcher(), lib.matcher()
        verdicts = []
        for m in (a, b):
            try:
                for t in ids:
                    m.advance(t)
                verdicts.append(m.accepts())
            except ValueError:
                verdicts.append(False)
        assert verdicts[0] == verdicts[1] == bool(re.fullmatch(pattern, text)), text
        a, b = own.matcher(), lib.matcher()
        for t in ids:
            if not b.m.compute_ff_bytes():
                assert torch.equal(a.allowed_mask(), b.allowed_mask()), (text, t)
                compared += 1
            if not a.allowed_mask()[t]:
                break
            a.advance(t)
            b.advance(t)
    assert compared >= 3


# ---- the engine and generate -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llm():
    torch.manual_seed(0)
    return LLM("tiny-llama", max_num_seqs=8)


def _valid_person(text: str) -> bool:
    doc = json.loads(text)
    return (set(doc) == set(PERSON["properties"]) and isinstance(doc["name"], str)
            and len(doc["name"]) <= 12 and type(doc["age"]) is int and type(doc["ok"]) is bool
            and len(doc["tags"]) <= 3 and all(t in ("a", "b", 3, None) for t in doc["tags"]))


def test_engine_outputs_always_validate_on_a_random_model(tiny_llm):
    outs = tiny_llm.generate(["a", "bb", "ccc", "dddd"],
                             SamplingParams(temperature=1.0, max_tokens=120, seed=5,
                                            structured={"json_schema": PERSON}),
                             use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert all(_valid_person(t) for t in texts), texts
    assert len(set(texts)) > 1


@pytest.mark.slow
def test_engine_regex_choice_and_forks(tiny_llm):
    pattern = "[a-c]{2,5}-(x|yz)"
    outs = tiny_llm.generate(["q"] * 3, SamplingParams(n=2, temperature=1.0, max_tokens=30,
                                                       structured={"regex": pattern}),
                             use_tqdm=False)
    assert all(re.fullmatch(pattern, c.text) for o in outs for c in o.outputs)
    outs = tiny_llm.generate(["q"] * 3, SamplingParams(temperature=0.9, max_tokens=30,
                                                       structured={"choice": ["Paris", "Lyon"]}),
                             use_tqdm=False)
    assert all(o.outputs[0].text in ("Paris", "Lyon") for o in outs)


@pytest.mark.slow
@pytest.mark.skipif(not has_library(), reason="llguidance is not installed")
def test_engine_library_backend_any_json_object(tiny_llm):
    outs = tiny_llm.generate(["x"] * 2, SamplingParams(temperature=0, max_tokens=100,
                                                       structured={"json_object": True}),
                             use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:      # out of tokens mid-object: still a prefix of one
            assert c.text.startswith("{")


def test_grammar_that_allows_everything_leaves_greedy_unchanged():
    model, tok = llmlab.load_model("tiny-llama"), llmlab.load_tokenizer("tiny-llama")
    free = llmlab.generate(model, tok, ["hi", "a longer prompt"], max_new_tokens=8)
    every = llmlab.generate(model, tok, ["hi", "a longer prompt"], max_new_tokens=8,
                            structured={"regex": r"(.|\n)*"})
    assert [g.token_ids for g in every] == [g.token_ids for g in free]


@pytest.mark.slow
def test_generate_structured_paths_agree():
    model, tok = llmlab.load_model("tiny-llama"), llmlab.load_tokenizer("tiny-llama")
    runs = [llmlab.generate(model, tok, ["hi", "hello there"], max_new_tokens=24, temperature=1.0,
                            seed=3, kv_cache=kv, structured={"regex": "[0-9]{3}-[a-z]{2,4}"})
            for kv in ("none", "contiguous", "paged")]
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2,4}", g.text) for r in runs for g in r)
    assert [g.token_ids for g in runs[0]] == [g.token_ids for g in runs[1]] == \
        [g.token_ids for g in runs[2]]


# ---- SmolLM2: every sampled output validates ----------------------------------------------------

VALIDITY_SCHEMAS = [
    ("llmlab", "Describe a person as JSON.",
     {"type": "object", "additionalProperties": False,
      "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
      "required": ["name", "age"]}),
    ("llmlab", "Give a point on a map with a label, as JSON.",
     {"type": "object", "additionalProperties": False,
      "properties": {"point": {"type": "object", "additionalProperties": False,
                               "properties": {"x": {"type": "integer"}, "y": {"type": "number"}},
                               "required": ["x", "y"]},
                     "tags": {"type": "array", "items": {"enum": ["red", "blue", None, 1]},
                              "maxItems": 2}},
      "required": ["point", "tags"]}),
    ("llguidance", "Is it raining? Answer as JSON.",
     {"type": "object", "additionalProperties": False,
      "properties": {"raining": {"type": "boolean"},
                     "city": {"enum": ["Paris", "Rome", "Oslo"]}},
      "required": ["raining", "city"]}),
    ("auto", "Rate a film from 1 to 5 as JSON.",       # minimum/maximum: the library's
     {"type": "object", "additionalProperties": False,
      "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                     "word": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
      "required": ["stars", "word"]}),
]


@pytest.mark.slow
def test_smollm2_sampled_outputs_all_validate(smollm2, tokenizer):
    """Completions at temperature 1 over four schemas (two on llmlab's automaton, two on
    llguidance), batched in the engine: every one ends by the grammar and validates. 80 of them
    (two prompts a schema); `make test-thorough` draws 200 (five)."""
    import jsonschema

    variants = 5 if THOROUGH else 2
    llm = LLM(smollm2, tokenizer, max_num_seqs=40)
    convs, params, schemas = [], [], []
    for backend, question, schema in VALIDITY_SCHEMAS:
        for variant in range(variants):
            convs.append([{"role": "user", "content": f"{question} (example {variant + 1})"}])
            params.append(SamplingParams(n=10, temperature=1.0, max_tokens=80, seed=variant,
                                         structured={"json_schema": schema, "backend": backend}))
            schemas.append(schema)
    outs = llm.chat(convs, params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    checked = 0
    for out, schema in zip(outs, schemas):
        for c in out.outputs:
            # a grammar with no bound on a number's digits could, in principle, run out of
            # max_tokens: 80 tokens hold far more than these schemas ever need
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            jsonschema.validate(json.loads(c.text), schema)
            checked += 1
    assert checked == 40 * variants
    assert len({c.text for o in outs for c in o.outputs}) > 10 * variants     # sampled, not one answer
