"""Mistral tokenizer v11+ calls end to end: the tiny model with two of its filler tokens renamed to Mistral's control
tokens ``[TOOL_CALLS]`` / ``[ARGS]`` (special, as in Magistral / Devstral tokenizers), served with
``--tool-call-parser mistral``: forced calls are written ``[TOOL_CALLS]name[ARGS]{...}`` over the special-token ids,
detokenised with them kept, parsed into ``tool_calls`` and streamed as OpenAI deltas; ``tool_choice: auto`` with a
JSON schema is a v11 call or the schema's JSON."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from .conftest import API_KEY, MODEL, make_llm
from .test_tools import ANSWER, ANSWER_FORMAT, ASK, SCHEMAS, TOOLS

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def mistral_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mistral") / "tiny"
    shutil.copytree(tiny_model_dir, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for filler, name in (("<filler_0>", "[TOOL_CALLS]"), ("<filler_1>", "[ARGS]")):
        i = vocab.pop(filler)
        vocab[name] = i
        spec["added_tokens"].append(
            {"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": True}
        )  # fmt: skip
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


@pytest.fixture(scope="module")
def client(mistral_dir):
    import openai

    from polyrl.server import ServeConfig, start_server

    llm = make_llm(mistral_dir)
    cfg = ServeConfig(port=0, served_model_name=MODEL, api_key=API_KEY, log_level="warning", tool_call_parser="mistral")
    handle = start_server(llm, cfg)
    yield openai.OpenAI(base_url=handle.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    handle.stop()


def test_forced_v11_calls_use_the_special_tokens(client, mistral_dir):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        n=6, max_tokens=80, temperature=1.0, seed=1,
    )  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c.message.content
        (call,) = c.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # the engine's tokens: [TOOL_CALLS] name [ARGS] {...}, the markers as their special ids (a second engine over the
    # same weights: the served one belongs to its engine thread)
    llm = make_llm(mistral_dir)
    out = llm.generate(
        [llm.tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)],
        _forced(llm, r),
    )[0].outputs[0]
    ids = {t: llm.tokenizer.convert_tokens_to_ids(t) for t in ("[TOOL_CALLS]", "[ARGS]")}
    assert out.token_ids[0] == ids["[TOOL_CALLS]"] and ids["[ARGS]"] in out.token_ids
    assert out.text.startswith("[TOOL_CALLS]get_") and "[ARGS]{" in out.text

    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=80, temperature=0, stream=True,
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""  # nothing of the call leaks as text
    calls = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert [d.index for d in calls] == [0, 0] and calls[0].function.name == "get_time"
    assert json.loads(calls[1].function.arguments)["zone"] in ("UTC", "CET")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _forced(llm, r):
    """The sampling of a forced call of the tools, as the server builds it (special tokens kept in the text)."""
    from polyrl.agents.tool_parsers import get_parser
    from polyrl.infer import SamplingParams
    from polyrl.infer.sampling_params import StructuredOutputs

    lark = get_parser("mistral").grammar(TOOLS, False, llm.tokenizer)
    return SamplingParams(
        temperature=1.0, seed=3, max_tokens=80, structured=StructuredOutputs("lark", lark), skip_special_tokens=False
    )


def test_auto_with_a_schema_is_a_v11_call_or_the_answer(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False, response_format=ANSWER_FORMAT,
        n=12, max_tokens=120, temperature=1.0, seed=4,
    )  # fmt: skip
    kinds = set()
    for c in r.choices:
        if c.message.tool_calls:
            (call,) = c.message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            assert c.finish_reason == "tool_calls" and c.message.content is None
            kinds.add("call")
        else:
            jsonschema.validate(json.loads(c.message.content), ANSWER)
            kinds.add("answer")
    assert kinds == {"call", "answer"}
