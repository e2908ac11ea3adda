"""Structured outputs and tool calls over HTTP, through the real ``openai`` client:
``response_format`` (``client.chat.completions.parse`` with a pydantic model),
``tools`` with ``tool_choice`` (non-streamed and streamed ``tool_calls`` deltas), vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice``, and a 400 naming a bad schema.

tiny-llama (a random model: only the grammar makes its output valid) for the mechanics;
SmolLM2 (slow) for a parse whose answer means something.
"""
from __future__ import annotations

import json
import re

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

import llmlab  # noqa: E402
from llmlab.engine import LLM  # noqa: E402
from llmlab.serve import create_app  # noqa: E402
from llmlab.serve.tools import ToolCallStreamParser  # noqa: E402

from .test_serve import ThreadServer  # noqa: E402


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    population: int
    capital: bool


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"]}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny():
    model, tok = llmlab.load_model("tiny-llama", device="cpu"), llmlab.load_tokenizer("tiny-llama")
    srv = ThreadServer(create_app(LLM(model, tok, max_num_seqs=8), "tiny-llama"))
    yield srv
    srv.close()


def test_parse_with_a_pydantic_model(tiny):
    r = tiny.client.chat.completions.parse(model="tiny-llama", messages=USER, response_format=City,
                                           temperature=1.0, seed=3, max_tokens=80)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and len(city.name) <= 16
    assert r.choices[0].finish_reason == "stop"


def test_tool_call_required_non_streamed(tiny):
    r = tiny.client.chat.completions.create(model="tiny-llama", messages=USER,
                                            tools=[WEATHER, TIME], tool_choice="required",
                                            temperature=1.0, seed=1, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, set(args)) in (("get_weather", {"city", "unit"}),
                                               ("get_time", {"zone"}))


def test_tool_call_streamed_as_deltas(tiny):
    stream = tiny.client.chat.completions.create(
        model="tiny-llama", messages=USER, tools=[WEATHER, TIME], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0, seed=2, max_tokens=80)
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    args = "".join(d.function.arguments or "" for d in deltas)
    parsed = json.loads(args)                      # not one '}' too many, none lost
    assert set(parsed) == {"city", "unit"} and parsed["unit"] in ("celsius", "fahrenheit")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)


def test_guided_fields_on_both_routes(tiny):
    c = tiny.client.completions.create(model="tiny-llama", prompt="Phone:", max_tokens=20,
                                       temperature=1.0, extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.choices[0].text)
    r = tiny.client.chat.completions.create(model="tiny-llama", messages=USER, max_tokens=10,
                                            extra_body={"guided_choice": ["sunny", "rainy"]})
    assert r.choices[0].message.content in ("sunny", "rainy")
    r = tiny.client.chat.completions.create(
        model="tiny-llama", messages=USER, max_tokens=60, temperature=1.0,
        extra_body={"guided_json": {"type": "object", "properties": {
            "ok": {"type": "boolean"}, "n": {"type": "integer"}}, "required": ["ok", "n"]}})
    doc = json.loads(r.choices[0].message.content)
    assert type(doc["ok"]) is bool and type(doc["n"]) is int


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format", "strin"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}},
     "guided_json", "nope"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_regex": "a("}, "guided_regex", "missing ')'"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name", "bad name"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
])
def test_a_bad_schema_gets_a_400_naming_it(tiny, body, param, words):
    r = httpx.post(tiny.url + "/v1/chat/completions", timeout=30,
                   json={"messages": USER, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_tool_call_stream_parser_stops_at_the_arguments_end():
    text = '{"name":"f","arguments":{"s":"a}\\"b","l":[1,{"x":[2]}]}}'
    for size in (1, 2, 5, len(text)):
        p = ToolCallStreamParser()
        events = [e for i in range(0, len(text), size) for e in p.feed(text[i:i + size])]
        assert events[0] == ("name", "f")
        assert "".join(v for k, v in events if k == "arguments") == '{"s":"a}\\"b","l":[1,{"x":[2]}]}'


@pytest.mark.slow
def test_parse_on_smollm2(smollm2, tokenizer):
    srv = ThreadServer(create_app(LLM(smollm2, tokenizer, max_num_seqs=2), "smollm2-135m"))
    try:
        r = srv.client.chat.completions.parse(
            model="smollm2-135m", temperature=0, max_tokens=40, response_format=City,
            messages=[{"role": "user", "content": "Give the name of the capital of France, its "
                       "population and whether it is a capital, as JSON."}])
        city = r.choices[0].message.parsed
        assert isinstance(city, City) and city.name.strip() and city.capital in (True, False)
    finally:
        srv.close()
