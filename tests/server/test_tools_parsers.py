"""Tool-call parsers per family (Hermes/Qwen, Llama 3 JSON, Mistral), their streaming and their grammars, and the
shared message preparation (native tools vs the system-prompt fallback). No server: pure functions + llguidance."""

from __future__ import annotations

import json
import re

import pytest

from polyrl.agents.render import prepare_messages
from polyrl.agents.tool_parsers import ToolCallStream, detect_parser, get_parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "noop"}},
]


def calls(msg):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]


def test_hermes_parses_blocks_and_keeps_content():
    p = get_parser("qwen")
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    )
    text += '\n<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
    msg = p.parse(text, "call_x")
    assert msg["content"] == "Let me check."
    assert calls(msg) == [("get_weather", {"city": "Paris", "days": 2}), ("noop", {})]
    assert [c["id"] for c in msg["tool_calls"]] == ["call_x_0", "call_x_1"]
    bad = p.parse("<tool_call>{not json}</tool_call>")
    assert "tool_calls" not in bad and len(bad["invalid_tool_calls"]) == 1


def test_llama3_json_and_mistral():
    llama = get_parser("llama3_json")
    msg = llama.parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}; {"name": "noop"}'
    )
    assert calls(msg) == [("get_weather", {"city": "Rome", "days": 1}), ("noop", {})] and msg["content"] is None
    plain = llama.parse("The answer is {not a call}")
    assert plain["content"] == "The answer is {not a call}" and "tool_calls" not in plain
    # JSON without arguments is an answer (a response_format's object), unless the python tag says it is a call
    person = '{"name": "Bob", "age": 3}'
    assert llama.parse(person) == {"role": "assistant", "content": person}
    assert calls(llama.parse("<|python_tag|>" + person)) == [("Bob", {})]
    mistral = get_parser("mistral")
    msg = mistral.parse('Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]')
    assert msg["content"] == "Sure." and calls(msg) == [("get_weather", {"city": "Paris", "days": 3})]
    assert mistral.keep_special_tokens and not llama.keep_special_tokens


def test_detect_parser_from_template():
    assert detect_parser("{{ '<tool_call>' }}").name == "hermes"
    assert detect_parser("[TOOL_CALLS] {{ tools }}").name == "mistral"
    assert detect_parser("<|python_tag|>{{ x }}").name == "llama3_json"
    assert detect_parser(None).name == "hermes"  # no template tool support: the fallback asks for <tool_call>
    with pytest.raises(Exception, match="unknown tool-call parser"):
        get_parser("nope")


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_streaming_holds_back_markers_and_sends_calls_whole(name):
    p = get_parser(name)
    if name == "hermes":
        text = 'Hi <tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    elif name == "llama3_json":
        text = '{"name": "noop", "parameters": {}}'
    else:
        text = 'Hi [TOOL_CALLS][{"name": "noop", "arguments": {}}]'
    stream = ToolCallStream(p, "call_s")
    content = "".join(stream.feed(text[:i]) for i in range(1, len(text) + 1))
    rest, msg = stream.finish(text)
    assert content + rest == ("" if name == "llama3_json" else "Hi ")
    assert calls(msg) == [("noop", {})]
    # a reply without calls streams whole: held-back text comes out at the end
    stream = ToolCallStream(p, "call_s")
    text = "plain <tool answer"
    content = "".join(stream.feed(text[:i]) for i in range(1, len(text) + 1))
    rest, msg = stream.finish(text)
    assert content + rest == text and "tool_calls" not in msg


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_grammar_admits_exactly_the_format(name):
    llg = pytest.importorskip("llguidance")
    p = get_parser(name)
    grammar = llg.LLMatcher.grammar_from_lark(p.grammar(TOOLS[:1], parallel=False))
    assert llg.LLMatcher.validate_grammar(grammar) == ""
    args = {"city": "Paris", "days": 2}
    good = {
        "hermes": f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(args)}}}\n</tool_call>',
        "llama3_json": f'{{"name": "get_weather", "parameters": {json.dumps(args)}}}',
        "mistral": f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(args)}}}]',
    }[name]
    assert calls(p.parse(good)) == [("get_weather", args)]
    # the text form of the grammar pins the tool name and the parameter schema
    text = p.grammar(TOOLS[:1], parallel=False)
    assert '"const": "get_weather"' in text and '"enum": ["Paris", "Rome"]' in text


def test_prepare_messages_native_vs_fallback():
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    native, tools = prepare_messages(history, TOOLS, "{{ tools }} {{ m.tool_calls }}")
    assert tools == TOOLS and native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert native[1]["content"] == "" and native[2]["tool_call_id"] == "c1"
    fallback, tools = prepare_messages(history, TOOLS, "{{ m.content }}")
    assert tools is None and fallback[0]["role"] == "system" and "get_weather(city, days)" in fallback[0]["content"]
    assert fallback[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'


# ---- Mistral tokenizer v11+ (Mistral Small 3.1+, Magistral, Devstral): [TOOL_CALLS]name[ARGS]{...} ----------------


def test_mistral_v11_parses_beside_the_list_form():
    p = get_parser("mistral")
    text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]noop[ARGS]{}'
    msg = p.parse(text, "call_m")
    assert msg["content"] == "Sure." and calls(msg) == [("get_weather", {"city": "Paris", "days": 3}), ("noop", {})]
    ids = [c["id"] for c in msg["tool_calls"]]  # 9 alphanumerics, as Mistral's templates require, one per call
    assert all(re.fullmatch("[a-z0-9]{9}", i) for i in ids) and len(set(ids)) == 2
    assert ids == [c["id"] for c in p.parse(text, "call_m")["tool_calls"]]  # from the caller's prefix: stable
    # with the model's own call id, and with [ARGS] dropped (special tokens skipped by a client-side detokeniser)
    assert calls(p.parse('[TOOL_CALLS]noop[CALL_ID]a1b2c3d4e[ARGS]{"x": 1}')) == [("noop", {"x": 1})]
    assert calls(p.parse('hi{hi[TOOL_CALLS]noop{"q": "{}"}')) == [("noop", {"q": "{}"})]
    assert p.parse('hi{hi[TOOL_CALLS]noop{"q": "{}"}')["content"] == "hi{hi"
    # the older list form still parses, also followed by a v11 call
    mixed = p.parse('[TOOL_CALLS][{"name": "noop", "arguments": {}}][TOOL_CALLS]get_weather[ARGS]{"days": 1}')
    assert calls(mixed) == [("noop", {}), ("get_weather", {"days": 1})]
    # malformed calls are reported, the good ones kept
    bad = p.parse('[TOOL_CALLS]noop[ARGS]{"x": [TOOL_CALLS]get_weather[ARGS]{"days": 2} trailing')
    assert "tool_calls" not in bad and len(bad["invalid_tool_calls"]) == 2
    assert "not valid JSON" in bad["invalid_tool_calls"][0]["error"]
    assert "after the arguments" in bad["invalid_tool_calls"][1]["error"]
    assert p.parse("[TOOL_CALLS]")["invalid_tool_calls"][0]["error"] == "a [TOOL_CALLS] without a function name"


def test_mistral_v11_streaming():
    text = 'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}[TOOL_CALLS]noop[ARGS]{}'
    stream = ToolCallStream(get_parser("mistral"), "call_s")
    sent = [stream.feed(text[:i]) for i in range(1, len(text) + 1)]
    # the content streams as it comes, "[TOOL_..." is held back until it is known to be a call, nothing after it
    assert "".join(sent) == "Let me look." and sent[len("Let me look.") - 1].endswith(".")
    assert all(s == "" for s in sent[len("Let me look.") :])
    rest, msg = stream.finish(text)
    assert rest == "" and calls(msg) == [("get_weather", {"city": "Rome", "days": 2}), ("noop", {})]
    one = ToolCallStream(get_parser("mistral"), "call_s", parallel=False)
    assert calls(one.finish(text)[1]) == [("get_weather", {"city": "Rome", "days": 2})]


@pytest.fixture(scope="module")
def mistral_tokenizer(tiny_model_dir):
    """The tiny tokenizer with Mistral's control tokens added as special tokens (as v11 tokenizers have them)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.add_tokens([AddedToken("[TOOL_CALLS]", special=True), AddedToken("[ARGS]", special=True)], special_tokens=True)
    return tok


_CACHES: dict = {}


def _matcher(tok, lark):
    from polyrl.infer.sampling_params import StructuredOutputs
    from polyrl.infer.structured import GrammarCache

    if id(tok) not in _CACHES:  # the llguidance tokenizer is built once per tokenizer
        _CACHES[id(tok)] = GrammarCache(tok, len(tok), [tok.eos_token_id])
    return _CACHES[id(tok)].matcher(StructuredOutputs("lark", lark))


def _accepts(tok, lark, text) -> bool:
    m = _matcher(tok, lark)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_mistral_v11_grammar_uses_the_special_tokens(mistral_tokenizer):
    pytest.importorskip("llguidance")
    tok = mistral_tokenizer
    p = detect_parser("{{ '[TOOL_CALLS]' + name + '[ARGS]' + args }}")
    assert p.name == "mistral" and p.form == "v11"
    assert get_parser("mistral")._form(tok) == "v11"  # no template: the tokenizer's [ARGS] decides
    lark = p.grammar(TOOLS, parallel=True, tokenizer=tok)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("[TOOL_CALLS]", "[ARGS]")}
    assert f"<[{ids['[TOOL_CALLS]']}]>" in lark and f"<[{ids['[ARGS]']}]>" in lark
    oslo = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}'
    assert not _accepts(tok, lark, oslo)  # Oslo is not in the enum
    good = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}[TOOL_CALLS]noop[ARGS]{}'
    assert _accepts(tok, lark, good)
    assert not _accepts(tok, p.grammar(TOOLS, parallel=False, tokenizer=tok), good)  # one call only
    assert not _accepts(tok, lark, "Hello")
    # the same characters as plain text (not the special tokens) are not a call
    plain = [i for ch in good for i in tok(ch, add_special_tokens=False)["input_ids"]]
    m = _matcher(tok, lark)
    assert m.try_consume_tokens(plain) < len(plain)
    # the list form keeps working for v3 tokenizers / templates
    listed = detect_parser("{{ '[TOOL_CALLS]' + tool_calls | tojson }}")
    assert listed.form == "list" and "%json" in listed.grammar(TOOLS, parallel=False, tokenizer=tok)
    assert _accepts(tok, listed.grammar(TOOLS, True, tok), '[TOOL_CALLS][{"name": "noop", "arguments": {}}]')


# ---- tool_choice "auto" with a response format: a call OR an answer in the format ------------------------------

ANSWER = {
    "type": "object",
    "properties": {"verdict": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["verdict", "score"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "name, call",
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}'),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]'),
        ("mistral_v11", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}'),
    ],
)
def test_union_grammar_admits_a_call_or_the_answer(mistral_tokenizer, name, call):
    pytest.importorskip("llguidance")
    from polyrl.agents.tool_parsers import MistralParser, answer_rule
    from polyrl.infer.sampling_params import StructuredOutputs

    tok = mistral_tokenizer
    p = MistralParser("v11") if name == "mistral_v11" else get_parser(name)
    if name == "mistral":
        p.form = "list"
    lark = p.union_grammar(TOOLS, False, answer_rule(StructuredOutputs.json_schema(ANSWER)), tok)
    assert _accepts(tok, lark, call)
    assert calls(p.parse(call)) == [("get_weather", {"city": "Rome", "days": 2})]
    answer = '{"verdict": "yes", "score": 7}'
    assert _accepts(tok, lark, answer)
    assert "tool_calls" not in p.parse(answer) and p.parse(answer)["content"] == answer
    for bad in ('{"verdict": "maybe", "score": 7}', '{"verdict": "yes", "score": 70}', "Hello", answer + call):
        assert not _accepts(tok, lark, bad), bad
    assert not _accepts(tok, lark, call.replace("Rome", "Oslo"))  # a call still follows its tool's schema


def test_answer_rule_kinds(mistral_tokenizer):
    pytest.importorskip("llguidance")
    from polyrl.agents.tool_parsers import NoCallGrammar, answer_rule
    from polyrl.infer.sampling_params import StructuredOutputs

    tok, p = mistral_tokenizer, get_parser("hermes")

    def union(so):
        return p.union_grammar(TOOLS[1:], True, answer_rule(so), tok)

    assert _accepts(tok, union(StructuredOutputs("json_object")), '{"a": [1, 2]}')
    assert not _accepts(tok, union(StructuredOutputs("json_object")), "[1, 2]")
    assert _accepts(tok, union(StructuredOutputs.choice(["red", "green"])), "green")
    assert not _accepts(tok, union(StructuredOutputs.choice(["red", "green"])), "blue")
    regex = union(StructuredOutputs("regex", "[0-9]{2}/[a-z]"))  # a slash in the pattern is escaped for Lark
    assert _accepts(tok, regex, "12/x") and not _accepts(tok, regex, "123/x")
    one = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    assert _accepts(tok, regex, one + "\n" + one)  # parallel calls
    with pytest.raises(NoCallGrammar, match="grammar structured output cannot be combined"):
        answer_rule(StructuredOutputs("grammar", 'start: "a"'))


W = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
H = f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n"  # a whole Hermes call, then a second one opened
L = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
WHOLE = [("get_weather", {"city": "Paris", "days": 2})]


@pytest.mark.parametrize(
    "name, text, whole, content",
    [
        # hermes: a block opened after the last closed one, or the start of a marker, is the half-written call
        ("hermes", H + '{"name": "noop", "argu', WHOLE, None),
        ("hermes", H + '{"name": "noop", "arguments": {}}\n</tool_', WHOLE, None),
        ("hermes", f"<tool_call>\n{W}\n</tool_call>\n<tool_c", WHOLE, None),
        ("hermes", "Let me see.\n<tool_call>\n{", [], "Let me see."),
        ("hermes", f"<tool_call>\n{W}\n</tool_call>", WHOLE, None),  # cut right after a whole call: all kept
        ("hermes", "a plain answer cut in the midd", [], "a plain answer cut in the midd"),
        # llama3_json: the first object that does not decode, when it is a call (tagged, or after a call)
        ("llama3_json", f'{L}; {{"name": "noop", "param', WHOLE, None),
        ("llama3_json", '<|python_tag|>{"name": "noop", "param', [], None),
        ("llama3_json", "<|python_t", [], None),
        ("llama3_json", '{"name": "Ada", "ag', [], '{"name": "Ada", "ag'),  # may be an answer in a format: content
        # mistral: the last [TOOL_CALLS] whose call (v11) or list (v3) does not parse, or a marker begun at the end
        ("mistral", f'Hi [TOOL_CALLS][{W}, {{"name": "noop", "argu', [], "Hi"),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]noop[ARGS]{', WHOLE, None),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CA', WHOLE, None),
    ],
)  # fmt: skip
def test_unfinished_call_of_a_cut_reply(name, text, whole, content):
    """A reply cut by the token limit: what precedes ``unfinished`` parses to its whole calls and its content, with
    no invalid call and no call markup left (the server drops the rest: neither a call nor content)."""
    p = get_parser(name)
    msg = p.parse(text[: p.unfinished(text)], "call")
    assert calls(msg) == whole and "invalid_tool_calls" not in msg
    assert msg["content"] == content
