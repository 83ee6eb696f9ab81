"""Structured outputs over HTTP with real clients and the random tiny model: ``chat.completions.parse`` with a
pydantic model parses 50 of 50, json_object, vLLM's guided_* / structured_outputs on both endpoints, a cut reply is
finish_reason "length", the schema compiles once, bad grammars are 400s naming the field."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from .conftest import API_KEY, MODEL

ASK = [{"role": "user", "content": "Describe a person."}]


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]
    active: bool


def test_parse_pydantic_50_of_50(served):
    client = openai.AsyncOpenAI(base_url=served[0].base_url, api_key=API_KEY, max_retries=0, timeout=120)

    async def run():
        calls = [
            client.chat.completions.parse(
                model=MODEL, messages=ASK, response_format=Person, n=10, max_tokens=120, temperature=1.0, seed=i
            )
            for i in range(5)
        ]
        return await asyncio.gather(*calls)

    results = asyncio.run(run())
    parsed = [c.message.parsed for r in results for c in r.choices]
    assert len(parsed) == 50
    assert all(isinstance(p, Person) for p in parsed)
    assert all(c.finish_reason == "stop" for r in results for c in r.choices)
    assert len({p.model_dump_json() for p in parsed}) > 10  # sampled, not one answer repeated


def test_json_object_and_schema_compiled_once(client, served):
    llm = served[1]
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, n=6, max_tokens=150, temperature=1.0, seed=3
    )
    for c in r.choices:
        assert c.message.content.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema(), "strict": True}}
    client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=4)
    compiles = llm.grammar_cache().compiles
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=4)
    assert llm.grammar_cache().compiles == compiles  # the second request reuses the compiled schema
    # max_tokens cuts the JSON: finish_reason "length", the text is the cut prefix (not valid JSON)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


def test_vllm_fields_on_both_endpoints(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=20, n=4, extra_body={"guided_choice": ["red", "green", "blue"]}
    )
    assert {c.message.content for c in r.choices} <= {"red", "green", "blue"}
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=20, n=4, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}
    )
    import re

    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", c.message.content) for c in r.choices)
    r = client.completions.create(
        model=MODEL, prompt="Pick:", max_tokens=20, n=3, extra_body={"guided_grammar": 'start: "ab" | "cd" "e"'}
    )
    assert {c.text for c in r.choices} <= {"ab", "cde"} and all(c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=60,
        extra_body={"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    )
    assert all(isinstance(v, bool) for v in json.loads(r.choices[0].text))


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
        ({"response_format": {}}, "response_format.type"),  # was: plain text, silently
        ({"response_format": {"json_schema": {"name": "x", "schema": {}}}}, "response_format.type"),
    ],
)
def test_bad_structured_requests_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kw)
    assert info.value.body["param"] == param, info.value.body


def test_response_format_on_completions(client):
    # vLLM takes response_format on /v1/completions too; it was silently ignored here (unconstrained text)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    r = client.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=30, n=3, extra_body={"response_format": fmt}
    )
    assert all(c.finish_reason == "stop" and isinstance(json.loads(c.text)["ok"], bool) for c in r.choices)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=4, extra_body={"response_format": fmt, "guided_regex": "a+"}
        )
    assert info.value.body["param"] == "guided_regex" and "not both" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=4, extra_body={"response_format": {"type": "xml"}}
        )
    assert info.value.body["param"] == "response_format.type" and "'xml' is not supported" in info.value.body["message"]


def test_structured_outputs_without_llguidance_are_a_400(tiny_model_dir, monkeypatch):
    """The grammar cache (llguidance's tokenizer index: a second or more for a real vocabulary) is made by the first
    structured request, in the prep pool; its UserError (llguidance missing, a slow tokenizer) is a 400 naming the
    field. It was made on the event loop outside the error handling: a 500 with a traceback in the server log."""
    import sys

    from polyrl.server import ServeConfig, start_server

    from .conftest import make_llm

    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` raises ImportError
    llm = make_llm(tiny_model_dir)
    handle = start_server(llm, ServeConfig(port=0, served_model_name=MODEL, api_key=API_KEY, log_level="critical"))
    try:
        client = openai.OpenAI(base_url=handle.base_url, api_key=API_KEY, max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=4, response_format={"type": "json_object"}
            )
        body = info.value.body
        assert body["param"] == "response_format" and "need the llguidance package" in body["message"], body
        # a forced tool call: the engine is what cannot compile, not the tool's schema
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=4, tools=[tool], tool_choice="required"
            )
        body = info.value.body
        assert body["param"] == "tool_choice" and "need the llguidance package" in body["message"], body
        # the engine is unharmed: a plain request still runs
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        handle.stop()
