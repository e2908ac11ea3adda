"""Structured outputs and tool calls over HTTP: the request fields that constrain the
output, and the tool-call message built from it, whole or streamed (notebook 12).

Fields (at most one of them may constrain a request; a second one is a 400 naming it):

- ``response_format`` (chat): ``{"type": "text"}``, ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (OpenAI's
  Structured Outputs, https://platform.openai.com/docs/guides/structured-outputs; what
  ``client.chat.completions.parse(response_format=PydanticModel)`` sends);
- ``tools`` + ``tool_choice`` (chat, https://platform.openai.com/docs/guides/function-calling):
  with ``"required"`` or ``{"type": "function", "function": {"name": ...}}`` the output is
  constrained to ``{"name": <a tool>, "arguments": <its parameters schema>}`` and answered
  as ``message.tool_calls`` (streamed: OpenAI's ``delta.tool_calls`` chunks, the name
  first, then the arguments in pieces); with ``"auto"`` (the default when tools are
  given) the output is free, and a complete call of that shape becomes a tool call in a
  non-streamed answer; ``"none"`` ignores the tools;
- vLLM's extensions ``guided_json``, ``guided_regex``, ``guided_choice`` (and
  ``guided_decoding_backend``), on both routes
  (https://docs.vllm.ai/en/latest/features/structured_outputs.html).

A schema that is not one gets a 400 naming the field it came in.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from ..structured.spec import coerce_spec

MAX_TOOLS = 128
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class FieldError(ValueError):
    """A structured-output field is wrong: ``param`` names it (for the 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class ToolPlan:
    """How a chat request's tools shape its answer: ``mode`` is ``"required"`` or
    ``"named"`` (the output is a constrained call) or ``"auto"`` (free text, parsed at
    the end); ``names``: the tools it may call."""

    mode: str
    names: list[str] = field(default_factory=list)

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


def _tool_call_schema(name: str, parameters: dict) -> dict:
    return {"type": "object", "additionalProperties": False,
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"]}


def _tools(req) -> dict[str, dict]:
    """{name: parameters schema} of ``req.tools``; FieldError naming the bad entry."""
    tools = req.tools or []
    if len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"{len(tools)} tools; at most {MAX_TOOLS}")
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(t.get("function"), dict):
            raise FieldError(where, 'must be {"type": "function", "function": {"name", '
                             '"parameters"}}')
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise FieldError(f"{where}.function.name", f"{name!r} must be 1-64 letters, "
                             "digits, '_' or '-'")
        if name in out:
            raise FieldError(f"{where}.function.name", f"{name!r} is given twice")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise FieldError(f"{where}.function.parameters", "must be a JSON Schema object")
        out[name] = params
    return out


def tool_plan(req) -> ToolPlan | None:
    """The request's :class:`ToolPlan`, or None when its tools do not apply."""
    tools = _tools(req) if getattr(req, "tools", None) else {}
    choice = getattr(req, "tool_choice", None)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise FieldError("tool_choice", f"{choice!r} needs tools")
        return None
    if choice is None or choice == "auto":
        return ToolPlan("auto", list(tools))
    if choice == "none":
        return None
    if choice == "required":
        return ToolPlan("required", list(tools))
    if isinstance(choice, dict) and choice.get("type", "function") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in tools:
            raise FieldError("tool_choice", f"function {name!r} is not one of the tools "
                             f"{list(tools)}")
        return ToolPlan("named", [name])
    raise FieldError("tool_choice", f"{choice!r}; allowed: 'none', 'auto', 'required' or "
                     '{"type": "function", "function": {"name": ...}}')


def structured_request(req) -> dict | None:
    """The ``SamplingParams.structured`` spec a request asks for (None: unconstrained);
    FieldError naming the field when it is malformed or a second one is given."""
    found: list[tuple[str, dict]] = []
    backend = getattr(req, "guided_decoding_backend", None)
    extra = {"backend": backend} if backend else {}
    if getattr(req, "guided_json", None) is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise FieldError("guided_json", f"is not JSON: {e}") from None
        found.append(("guided_json", {"json_schema": schema, **extra}))
    if getattr(req, "guided_regex", None) is not None:
        found.append(("guided_regex", {"regex": req.guided_regex, **extra}))
    if getattr(req, "guided_choice", None) is not None:
        found.append(("guided_choice", {"choice": req.guided_choice, **extra}))
    rf = getattr(req, "response_format", None)
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_object":
            found.append(("response_format", {"json_object": True, **extra}))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise FieldError("response_format.json_schema", 'must be {"name": ..., '
                                 '"schema": {...}}')
            found.append(("response_format", {"json_schema": js["schema"], **extra}))
        elif kind != "text":
            raise FieldError("response_format.type", f"{kind!r}; allowed: 'text', "
                             "'json_object', 'json_schema'")
    plan = tool_plan(req)
    if plan is not None and plan.constrained:
        tools = _tools(req)
        schemas = [_tool_call_schema(n, tools[n]) for n in plan.names]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        found.append(("tools", {"json_schema": schema, **extra}))
    if len(found) > 1:
        raise FieldError(found[1][0], f"only one of guided_json, guided_regex, guided_choice, "
                         f"response_format and tools (with tool_choice required or named) may "
                         f"constrain a request; {found[0][0]} already does")
    if not found:
        return None
    name, spec = found[0]
    try:
        coerce_spec(spec)
    except ValueError as e:
        raise FieldError(name, str(e).removeprefix("structured ")) from None
    return spec


# ---- the answer ------------------------------------------------------------------------------

def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStreamParser:
    """Reads ``{"name": "<tool>", "arguments": {...}}`` as it streams in, a piece of text
    at a time, and says what a client may be shown: the name once it is complete, then
    the arguments' text as it arrives, up to the ``}`` that closes them and not one
    character further (the wrapper's own ``}`` is not part of the arguments: a parser
    that forwards everything after ``"arguments":`` hands the client one ``}`` too many,
    and one that cuts the last character before the stream ends loses one).

    ``feed(text) -> list of ("name", str) or ("arguments", str)``.
    """

    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

    def __init__(self):
        self.buffer = ""
        self.name: str | None = None
        self.args_start: int | None = None
        self.pos = 0                  # next character of the arguments to read
        self.depth = 0
        self.in_string = self.escaped = False
        self.done = False
        self.arguments = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buffer += text
        events: list[tuple[str, str]] = []
        if self.args_start is None:
            m = self._HEAD.match(self.buffer)
            if m is None:
                return events
            self.name = json.loads(f'"{m.group(1)}"')
            self.args_start = self.pos = m.end()
            events.append(("name", self.name))
        if self.done:
            return events
        start = self.pos
        while self.pos < len(self.buffer):
            c = self.buffer[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    break
        piece = self.buffer[start:self.pos]
        if piece:
            self.arguments += piece
            events.append(("arguments", piece))
        return events


def parse_tool_call(text: str, names) -> tuple[str, str] | None:
    """``(name, arguments text)`` when ``text`` is one whole tool call of a known tool,
    else None."""
    p = ToolCallStreamParser()
    p.feed(text)
    if not p.done or p.name not in names:
        return None
    try:
        rest = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(rest, dict) or set(rest) != {"name", "arguments"}:
        return None
    return p.name, p.arguments


def tool_call_message(body: dict, plan: ToolPlan) -> dict:
    """A non-streamed chat body with each choice whose text is a whole tool call turned
    into ``message.tool_calls`` (``content`` None, ``finish_reason`` ``"tool_calls"``)."""
    for choice in body.get("choices", []):
        msg = choice.get("message") or {}
        call = parse_tool_call(msg.get("content") or "", plan.names)
        if call is None:
            continue
        name, args = call
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": [
            {"id": new_call_id(), "type": "function",
             "function": {"name": name, "arguments": args}}]}
        if choice.get("finish_reason") == "stop":
            choice["finish_reason"] = "tool_calls"
    return body


def tool_call_deltas(parser: ToolCallStreamParser, text: str, call_id: str) -> list[dict]:
    """The ``delta`` bodies for a new piece of streamed text: the call's id, type and name
    once the name is known, then each piece of the arguments."""
    out = []
    for kind, value in parser.feed(text):
        if kind == "name":
            out.append({"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                        "function": {"name": value, "arguments": ""}}]})
        else:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": value}}]})
    return out


__all__ = ["FieldError", "ToolPlan", "tool_plan", "structured_request", "ToolCallStreamParser",
           "parse_tool_call", "tool_call_message", "tool_call_deltas", "new_call_id"]
