"""Tool calling in /v1/chat/completions with the official openai client against the real server and the tiny random
model: forced calls (required / named) are valid calls of the given tools every time, streamed in the OpenAI shape;
tool messages render; bad tools / tool_choice are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from polyrl.agents.render import prepare_messages

from .conftest import MODEL

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_required_calls_are_valid_every_time(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        n=8, max_tokens=120, temperature=1.0, seed=1,
    )  # fmt: skip
    assert len(r.choices) == 8
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c.message.content
        (call,) = c.message.tool_calls  # parallel_tool_calls=False: exactly one
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert c.message.content is None


def parallel_calls(client):
    """(seed, [(name, arguments)], completion tokens) of a forced reply with two or more whole calls that ended on its
    own (the first such seed; the sampling is seeded, so a lower max_tokens cuts this same reply)."""
    for seed in range(40):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="required",
            max_tokens=120, temperature=1.0, seed=seed,
        )  # fmt: skip
        c = r.choices[0]
        if c.finish_reason == "tool_calls" and len(c.message.tool_calls) >= 2:
            calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
            return seed, calls, r.usage.completion_tokens
    raise AssertionError("no seed gave two calls")


def test_a_reply_cut_inside_a_call_keeps_the_whole_calls_and_no_markup(client):
    """max_tokens cuts the last of several forced calls: finish_reason "length", the whole calls as tool_calls, the
    half-written one nowhere (was: its raw <tool_call> text as content); streamed alike. A cut inside the first call
    leaves no call and no text."""
    seed, whole, n = parallel_calls(client)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="required",
               temperature=1.0, seed=seed)  # fmt: skip
    for limit, kept in ((n - 3, whole[:-1]), (6, [])):  # 3 tokens before the end: inside the last call's markup
        r = client.chat.completions.create(**ask, max_tokens=limit)
        (c,) = r.choices
        assert c.finish_reason == "length" and r.usage.completion_tokens == limit
        assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []] == kept
        assert c.message.content == (None if kept else "")
        chunks = list(client.chat.completions.create(**ask, max_tokens=limit, stream=True))
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
        assert content == "" and chunks[-1].choices[0].finish_reason == "length"
        names = [d.function.name for d in deltas if d.function.name]
        args = [d.function.arguments for d in deltas if not d.function.name]
        assert list(zip(names, args)) == kept


# pydantic writes a nested model as a $ref into $defs (what the openai-agents SDK and LangChain send for tools whose
# arguments hold a model); inside the call grammar the reference pointed at the call object's root: a 400 before
TRIP = {
    "type": "object",
    "properties": {"dest": {"$ref": "#/$defs/Place"}, "back": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]}},
    "required": ["dest", "back"],
    "additionalProperties": False,
    "$defs": {
        "Place": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        }
    },
}
NUMBERED = {
    "type": "object",
    "properties": {"n": {"$ref": "#/$defs/Place"}},
    "required": ["n"],
    "additionalProperties": False,
    "$defs": {"Place": {"type": "integer", "minimum": 0, "maximum": 9}},
}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_required_call_with_defs_refs(client, served, parser):
    from polyrl.agents.tool_parsers import get_parser
    from polyrl.infer.sampling_params import StructuredOutputs
    from polyrl.infer.structured import GrammarCache

    tools = [
        {"type": "function", "function": {"name": "book_trip", "parameters": TRIP}},
        {"type": "function", "function": {"name": "count", "parameters": NUMBERED}},  # its own "Place"
    ]
    if parser != "hermes":  # each parser's call grammar compiles (the served model's parser is hermes)
        tok = served[1].tokenizer
        for parallel in (True, False):
            grammar = get_parser(parser).grammar(tools, parallel, tok)
            GrammarCache(tok, served[1].vocab_size, [tok.eos_token_id]).matcher(StructuredOutputs("lark", grammar))
        return
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=tools, tool_choice="required", parallel_tool_calls=False,
        n=4, max_tokens=100, temperature=1.0, seed=3,
    )  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c.message.content
        (call,) = c.message.tool_calls
        schema = TRIP if call.function.name == "book_trip" else NUMBERED
        jsonschema.validate(json.loads(call.function.arguments), schema)


# Parameters named like the schema keywords whose values are data (default, enum, const, examples), holding a nested
# model: their $refs were left pointing at the call schema's root (a 400 for a valid tool), as was a $ref beside them
SETTINGS = {
    "type": "object",
    "properties": {
        "default": {"$ref": "#/$defs/Level"},
        "enum": {"type": "array", "items": {"$ref": "#/$defs/Level"}, "maxItems": 2},
        "examples": {"anyOf": [{"$ref": "#/$defs/Level"}, {"type": "null"}]},
    },
    "required": ["default", "enum", "examples"],
    "additionalProperties": False,
    "$defs": {"Level": {"type": "integer", "enum": [1, 2, 3], "default": 2}},
}


def test_required_call_with_refs_under_keyword_named_parameters(client, served):
    from polyrl.agents.tool_parsers import call_schema

    tools = [{"type": "function", "function": {"name": "configure", "parameters": SETTINGS}}]
    schema = call_schema(tools)
    jsonschema.validate({"name": "configure", "arguments": {"default": 1, "enum": [2], "examples": None}}, schema)
    with pytest.raises(jsonschema.ValidationError):  # the references are followed: 7 is not a Level
        jsonschema.validate({"name": "configure", "arguments": {"default": 7, "enum": [], "examples": 3}}, schema)
    assert schema["$defs"]["polyrl_tool_0"]["$defs"]["Level"]["default"] == 2  # data stays as it was
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=tools, tool_choice="required", parallel_tool_calls=False,
        n=2, max_tokens=120, temperature=1.0, seed=5,
    )  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c.message.content
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), SETTINGS)


def test_named_tool_choice_and_streaming_deltas(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    # a response_format alongside a forced call is accepted (as OpenAI does) and the call's grammar wins
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60, temperature=1.0, seed=2,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")

    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60, temperature=0, stream=True
    )
    chunks = list(stream)
    deltas = [ch.choices[0].delta for ch in chunks]
    assert deltas[0].role == "assistant"
    call_deltas = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert len(call_deltas) == 2
    first, second = call_deltas
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_time" and first.function.arguments == ""
    assert second.index == 0 and second.id is None and second.function.name is None
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the stream carries the same call a non-streamed greedy request returns
    whole = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=60, temperature=0
    )
    assert second.function.arguments == whole.choices[0].message.tool_calls[0].function.arguments


def test_tool_messages_render_through_the_shared_renderer(client, served):
    llm = served[1]
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    # the prompt is exactly the fallback rendering (the tiny ChatML template has no tool support)
    msgs, native = prepare_messages(history, TOOLS, llm.tokenizer.chat_template)
    assert native is None and "get_weather(city, days)" in msgs[0]["content"]
    text = llm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}</tool_call>' in text
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode(text, add_special_tokens=False))
    # tool_choice none: tools are not rendered at all
    r2 = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
    assert r2.usage.prompt_tokens == plain.usage.prompt_tokens < r.usage.prompt_tokens
    assert r2.choices[0].message.tool_calls is None


ANSWER = {
    "type": "object",
    "properties": {"verdict": {"enum": ["sunny", "rainy"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["verdict", "score"],
    "additionalProperties": False,
}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}


def test_auto_with_response_format_is_a_call_or_the_schema(client):
    """tool_choice auto + json_schema: the random model either calls a tool (valid against its parameters) or answers
    in the schema, every one of 20 samples; both happen."""
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", parallel_tool_calls=False,
        response_format=ANSWER_FORMAT, n=20, max_tokens=150, temperature=1.0, seed=5,
    )  # fmt: skip
    kinds = []
    for c in r.choices:
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            (call,) = c.message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            kinds.append("call")
        else:
            assert c.finish_reason == "stop", c.message.content
            jsonschema.validate(json.loads(c.message.content), ANSWER)
            kinds.append("answer")
    assert len(kinds) == 20 and set(kinds) == {"call", "answer"}, kinds
    # streamed: the same union, parsed as the stream ends
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, response_format=ANSWER_FORMAT, n=4, max_tokens=150,
        temperature=1.0, seed=6, stream=True, parallel_tool_calls=False,
    )  # fmt: skip
    content, calls, finish = {}, {}, {}
    for ch in stream:
        for c in ch.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            for d in c.delta.tool_calls or []:
                calls.setdefault(c.index, []).append(d)
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert 0 < len(calls) < 4, (calls, content)  # both kinds
    for i in range(4):
        if i in calls:
            assert finish[i] == "tool_calls" and content[i] == ""
            name = next(d.function.name for d in calls[i] if d.function.name)
            args = "".join(d.function.arguments or "" for d in calls[i])
            jsonschema.validate(json.loads(args), SCHEMAS[name])
        else:
            assert finish[i] == "stop"
            jsonschema.validate(json.loads(content[i]), ANSWER)


def test_auto_with_a_grammar_or_a_parser_without_call_syntax_is_400(client, monkeypatch):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4, extra_body={"guided_grammar": 'start: "a"'}
        )
    assert info.value.body["param"] == "guided_grammar" and "cannot be combined" in info.value.body["message"]
    # a registered parser that cannot write its call syntax as a grammar: 400 naming tool_choice
    from types import SimpleNamespace

    from polyrl.agents import tool_parsers
    from polyrl.server.api_errors import APIError
    from polyrl.server.tool_calls import plan_tools

    class Prose(tool_parsers.HermesParser):
        name = "prose"

        def call_rules(self, tools, parallel, tokenizer=None):
            return tool_parsers.ToolParser.call_rules(self, tools, parallel, tokenizer)

    monkeypatch.setitem(tool_parsers.TOOL_PARSERS, "prose", Prose)
    req = SimpleNamespace(tools=TOOLS, tool_choice="auto")
    with pytest.raises(APIError) as err:
        plan_tools(req, "prose", None, None, {"type": "json_object"})
    assert err.value.status == 400 and err.value.param == "tool_choice" and "prose" in str(err.value)
    assert plan_tools(SimpleNamespace(tools=TOOLS), "prose", None, None, None).structured is None  # free auto: fine


BAD_SCHEMA = {"type": "object", "properties": {"city": {"type": "strin"}}}  # a typo llguidance refuses
BAD_TOOL = {"type": "function", "function": {"name": "get_city", "parameters": BAD_SCHEMA}}


@pytest.mark.parametrize(
    "kw, param, says",
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0", "only function tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "1-64"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", '"required"'),
        # a tool_choice object without the function's name (was: "names the function None")
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
            "tool_choice.function.name",
            "needs the function's name",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_time"}},
            "tool_choice.function.name",
            "get_time",
        ),
        # a tool's schema that does not compile, inside the call grammar (was: the whole grammar, param tool_choice)
        (
            {"tools": [*TOOLS, BAD_TOOL], "tool_choice": "required"},
            "tools.2.function.parameters",
            "(function 'get_city') is not a JSON schema polyrl can enforce",
        ),
        (
            {"tools": [BAD_TOOL], "response_format": {"type": "json_object"}},
            "tools.0.function.parameters",
            "Invalid type: strin",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(client, kw, param, says):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kw)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
    assert says in info.value.body["message"] and "<tool_call>" not in info.value.body["message"]
