"""What a request asks its output to be, and JSON Schema → regex for a subset (notebook 12).

``SamplingParams(structured=...)`` takes one of (vLLM's guided-decoding names)::

    {"regex": r"[0-9]{3}-[0-9]{4}"}
    {"json_schema": {...}}               # a dict, or a pydantic model (class or instance)
    {"choice": ["yes", "no", "maybe"]}
    {"json_object": True}                # any JSON object (the library backend)

and optionally ``"backend"``: ``"auto"`` (default: llmlab's own automaton when the
pattern is in its subset, else the library), ``"llmlab"`` or ``"llguidance"``.

**The JSON Schema subset llmlab's own backend compiles** (anything else raises
:class:`UnsupportedSchema`, and ``"auto"`` hands the schema to the library, which speaks
the full JSON Schema):

- ``object`` with ``properties``, every one of them ``required``; they are written in
  the order the schema lists them; ``additionalProperties`` is ignored (none are written);
- ``string`` with ``minLength`` / ``maxLength`` (counted in characters, an escape
  sequence counting as one; the escapes written are ``\\" \\\\ \\/ \\b \\f \\n \\r \\t``,
  not ``\\uXXXX``, which would add five states per character of a bounded string),
  ``integer``, ``number``, ``boolean``, ``null``;
- ``enum`` and ``const`` of any JSON values; ``anyOf``; a list of types;
- ``array`` with ``items`` (one schema) and ``minItems`` / ``maxItems``;
- ``$ref`` to ``#/$defs/...`` or ``#/definitions/...`` (not recursive), as pydantic
  writes nested models; ``title``, ``description``, ``default``, ``examples`` are read
  and ignored.

The JSON it allows is one line: no whitespace but an optional single space after each
``:`` and ``,`` (so ``json.dumps``'s default layout and the compact one both match).
Integers have at most 16 digits and numbers at most 15 fraction digits and a 3-digit
exponent: a grammar with no bound on its length lets a sampled model ramble in digits
until ``max_tokens``, which no schema asked for.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .regex import escape, parse

BACKENDS = ("auto", "llmlab", "llguidance")
KINDS = ("regex", "json_schema", "choice", "json_object")

WS = ""
STRING_CHAR = r'([^"\\\x00-\x1f]|\\["\\/bfnrt])'
INTEGER = r"-?(0|[1-9][0-9]{0,15})"
NUMBER = INTEGER + r"(\.[0-9]{1,15})?([eE][+-]?[0-9]{1,3})?"
_IGNORED = {"title", "description", "$schema", "$id", "default", "examples",
            "additionalProperties", "$defs", "definitions", "$comment", "strict", "type",
            "properties", "required", "items", "minItems", "maxItems", "minLength",
            "maxLength", "enum", "const", "anyOf", "$ref"}


class UnsupportedSchema(ValueError):
    """The schema uses JSON Schema outside llmlab's own subset (see the module docstring)."""


@dataclass(frozen=True)
class StructuredSpec:
    """One structured-output request, normalized: ``kind`` in :data:`KINDS`, its
    ``value`` (a pattern, a schema dict, a tuple of choices, or True), ``backend``."""

    kind: str
    value: object
    backend: str = "auto"

    @property
    def key(self) -> str:
        """A canonical string: equal specs compile to the same grammar."""
        value = list(self.value) if isinstance(self.value, tuple) else self.value
        return json.dumps([self.kind, value, self.backend], sort_keys=True)


def _schema_of(value):
    """A pydantic model (class or instance) -> its JSON schema; anything else unchanged."""
    target = value if isinstance(value, type) else type(value)
    if hasattr(target, "model_json_schema"):
        return target.model_json_schema()
    return value


_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def _check(schema, where: str) -> None:
    """The structural rules of JSON Schema for the keywords that shape a document (the
    library checks the rest when it compiles the grammar). ValueError naming ``where``."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: a schema must be an object (or true/false), got "
                         f"{type(schema).__name__}")
    t = schema.get("type")
    if t is not None:
        for x in (t if isinstance(t, list) else [t]):
            if x not in _TYPES:
                raise ValueError(f"{where}.type: {x!r} is not a JSON Schema type; allowed: "
                                 f"{list(_TYPES)}")
    for key in _COUNTS:
        if key in schema and not (isinstance(schema[key], int) and not isinstance(schema[key], bool)
                                  and schema[key] >= 0):
            raise ValueError(f"{where}.{key}: must be an integer >= 0, got {schema[key]!r}")
    if "properties" in schema:
        if not isinstance(schema["properties"], dict):
            raise ValueError(f"{where}.properties: must be an object of schemas")
        for name, sub in schema["properties"].items():
            _check(sub, f"{where}.properties.{name}")
    if "required" in schema and (not isinstance(schema["required"], list)
                                 or not all(isinstance(r, str) for r in schema["required"])):
        raise ValueError(f"{where}.required: must be a list of property names")
    for key in ("$defs", "definitions"):
        if key in schema:
            if not isinstance(schema[key], dict):
                raise ValueError(f"{where}.{key}: must be an object of schemas")
            for name, sub in schema[key].items():
                _check(sub, f"{where}.{key}.{name}")
    for key in ("items", "additionalProperties", "not"):
        if key in schema:
            _check(schema[key], f"{where}.{key}")
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                raise ValueError(f"{where}.{key}: must be a non-empty list of schemas")
            for i, sub in enumerate(schema[key]):
                _check(sub, f"{where}.{key}[{i}]")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise ValueError(f"{where}.enum: must be a non-empty list")
    if "$ref" in schema and not isinstance(schema["$ref"], str):
        raise ValueError(f"{where}.$ref: must be a string")


def check_json_schema(schema, name: str = "json_schema") -> dict:
    """``schema`` as a dict (a pydantic model becomes its schema), checked for the
    structure of the keywords that shape a document; ValueError naming ``name`` and the
    place of the first problem. (Not the whole meta-schema: importing ``jsonschema``
    takes seconds; the library backend checks the rest as it compiles.)"""
    schema = _schema_of(schema)
    if not isinstance(schema, dict):
        raise ValueError(f"{name} must be a JSON Schema object (a dict) or a pydantic model; "
                         f"got {type(schema).__name__}")
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} is not JSON: {e}") from None
    _check(schema, name)
    return schema


def coerce_spec(structured) -> StructuredSpec | None:
    """``structured`` (see the module docstring) as a :class:`StructuredSpec`, checked;
    None stays None. ValueError ``structured=...: what is wrong`` otherwise."""
    if structured is None or isinstance(structured, StructuredSpec):
        return structured
    if not isinstance(structured, dict):
        raise ValueError(f"structured={structured!r}: must be a dict with one of "
                         f"{list(KINDS)} (and optionally 'backend')")
    kinds = [k for k in structured if k != "backend"]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or len(kinds) != 1:
        raise ValueError(f"structured: needs exactly one of {list(KINDS)} (and optionally "
                         f"'backend'); got keys {sorted(structured)}")
    kind = kinds[0]
    backend = structured.get("backend", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"structured backend={backend!r}; allowed: {list(BACKENDS)}")
    value = structured[kind]
    if kind == "regex":
        if not isinstance(value, str):
            raise ValueError(f"structured regex must be a string, got {type(value).__name__}")
        try:
            parse(value)
        except ValueError as e:               # naming the position
            raise ValueError(f"structured {e}") from None
    elif kind == "json_schema":
        value = check_json_schema(value, "structured json_schema")
    elif kind == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"structured choice={value!r}: must be a non-empty list of "
                             "non-empty strings")
        value = tuple(value)
    else:
        if value is not True:
            raise ValueError(f"structured json_object={value!r}: must be True")
    spec = StructuredSpec(kind, value, backend)
    if backend == "llmlab":
        spec_to_regex(spec)                   # UnsupportedSchema now, not at run time
    elif kind == "json_schema":
        try:
            if backend == "auto":
                spec_to_regex(spec)
                return spec                   # llmlab's own backend will compile it
        except UnsupportedSchema:
            pass
        _check_with_library(value)
    if backend == "llmlab" and kind == "json_object":
        raise UnsupportedSchema("structured json_object (any JSON object) is not a regular "
                                "language: use backend 'llguidance' or 'auto'")
    return spec


def _check_with_library(schema: dict) -> None:
    """The library's own check of a schema it will compile (milliseconds, no tokenizer):
    ValueError with its message (a bad ``$ref``, a pattern that is not a regex, ...)."""
    try:
        import llguidance
    except ImportError:
        return
    errors = llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_json_schema(schema))
    if errors:
        raise ValueError(f"structured json_schema does not compile: {errors.strip()}")


def spec_to_regex(spec: StructuredSpec) -> str:
    """The regex of a spec (UnsupportedSchema when llmlab's subset cannot express it)."""
    if spec.kind == "regex":
        return spec.value
    if spec.kind == "choice":
        return "|".join(f"({escape(c)})" for c in spec.value)
    if spec.kind == "json_schema":
        return json_schema_to_regex(spec.value)
    raise UnsupportedSchema(f"structured {spec.kind} has no regex in llmlab's subset")


def json_schema_to_regex(schema: dict) -> str:
    """The regex of the JSON documents ``schema`` allows, for the subset in the module
    docstring; :class:`UnsupportedSchema` names the first keyword outside it."""
    schema = _schema_of(schema)
    defs = {}
    if isinstance(schema, dict):
        defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    return _value(schema, defs, ())


def _value(s, defs: dict, seen: tuple) -> str:
    if not isinstance(s, dict):
        raise UnsupportedSchema(f"schema {s!r}: only object schemas are in llmlab's subset "
                                "(true / any value needs the library backend)")
    if "$ref" in s:
        ref = s["$ref"]
        name = ref.rsplit("/", 1)[-1]
        if not (ref.startswith("#/$defs/") or ref.startswith("#/definitions/")) or name not in defs:
            raise UnsupportedSchema(f"$ref {ref!r}: only #/$defs/... references are supported")
        if name in seen:
            raise UnsupportedSchema(f"$ref {ref!r} is recursive: not a regular language")
        return _value(defs[name], defs, seen + (name,))
    extra = sorted(set(s) - _IGNORED)
    if extra:
        raise UnsupportedSchema(f"keyword {extra[0]!r} is outside llmlab's JSON Schema subset")
    if "const" in s:
        return escape(json.dumps(s["const"]))
    if "enum" in s:
        if not s["enum"]:
            raise UnsupportedSchema("enum is empty: nothing matches")
        return "(" + "|".join(escape(json.dumps(v)) for v in s["enum"]) + ")"
    if "anyOf" in s:
        return "(" + "|".join(_value(o, defs, seen) for o in s["anyOf"]) + ")"
    t = s.get("type")
    if isinstance(t, list):
        return "(" + "|".join(_value({**s, "type": x}, defs, seen) for x in t) + ")"
    if t == "string":
        lo, hi = int(s.get("minLength", 0)), s.get("maxLength")
        rep = "*" if lo == 0 and hi is None else (
            f"{{{lo},}}" if hi is None else f"{{{lo},{int(hi)}}}")
        return f'"{STRING_CHAR}{rep}"'
    if t == "integer":
        return INTEGER
    if t == "number":
        return NUMBER
    if t == "boolean":
        return "(true|false)"
    if t == "null":
        return "null"
    if t == "array":
        if "items" not in s or not isinstance(s["items"], dict):
            raise UnsupportedSchema("array without one 'items' schema is outside llmlab's "
                                    "subset")
        item = _value(s["items"], defs, seen)
        lo, hi = int(s.get("minItems", 0)), s.get("maxItems")
        if hi is not None and int(hi) < lo:
            raise UnsupportedSchema(f"maxItems {hi} < minItems {lo}: nothing matches")
        if hi is not None and int(hi) == 0:
            return r"\[\]"
        more_lo = max(lo - 1, 0)
        more = (f"{{{more_lo},}}" if hi is None else f"{{{more_lo},{int(hi) - 1}}}")
        body = f"{item}(,{WS}{item}){more}"
        return rf"\[{body}\]" if lo >= 1 else rf"\[({body})?\]"
    if t == "object":
        props = s.get("properties")
        if not props:
            raise UnsupportedSchema("an object without properties (any object) is outside "
                                    "llmlab's subset")
        required = set(s.get("required", []))
        missing = [p for p in props if p not in required]
        if missing:
            raise UnsupportedSchema(f"property {missing[0]!r} is optional: llmlab's subset "
                                    "needs every property required")
        fields = [escape(json.dumps(name)) + ":" + WS + _value(sub, defs, seen)
                  for name, sub in props.items()]
        return r"\{" + ("," + WS).join(fields) + r"\}"
    raise UnsupportedSchema(f"type {t!r} is outside llmlab's JSON Schema subset")


__all__ = ["StructuredSpec", "UnsupportedSchema", "coerce_spec", "spec_to_regex",
           "json_schema_to_regex", "check_json_schema", "BACKENDS", "KINDS"]
