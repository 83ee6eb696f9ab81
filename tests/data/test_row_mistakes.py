"""What a new user's data gets wrong, and what polyrl says: other datasets' key names (with the rename that fixes
them, per algorithm), empty targets and prompts, identical preference pairs, role spellings, non-text content,
tool calls, globs, paths that are not on disk (never a hub lookup), @split on a single file, wrongly typed
settings."""

from __future__ import annotations

import json
import re

import pytest

from polyrl.algorithms.rewards import example_view
from polyrl.data import DataConfig, build_preference, build_sft, load_examples, load_prompts
from polyrl.data.chat import ChatTokenizer
from polyrl.data.dataset import chat_tokenizer, encode_prompts
from polyrl.data.formats import RowError, as_sft, parse_row
from polyrl.errors import ConfigError, DataError

# the fixture tokenizer's ChatML template, also writing assistant tool calls (as Qwen2.5's does, in short)
TOOLS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
TOOL_CONVERSATION = [
    {"role": "user", "content": "1+2?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": "3", "tool_call_id": "c1"},
    {"role": "assistant", "content": "3"},
]


def _load(tmp_path, rows, purpose="sft", **kw):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_examples(DataConfig(path=str(path), **kw), purpose)


@pytest.mark.parametrize(
    "row, purpose, problem",
    [
        ({"instruction": "q", "response": "a"}, "sft", "rename 'response' to 'output'"),
        ({"input": "q", "output": "a"}, "sft", "rename 'input' to 'instruction'"),
        ({"query": "q", "response": "a"}, "sft", "rename 'query' to 'prompt'"),
        ({"problem": "q", "answer": "1"}, "rl", "rename 'problem' to 'prompt'"),
        ({"query": "q", "label": "1"}, "rl", "rename 'query' to 'prompt'"),
        # a row of another format: the hint is the rename that makes it a row for the algorithm
        ({"prompt": "q", "accepted": "a", "rejected": "b"}, "dpo", "rename 'accepted' to 'chosen'"),
        (
            {"prompt": "q", "chosen_response": "a", "rejected_response": "b"},
            "dpo",
            "rename 'chosen_response' to 'chosen', 'rejected_response' to 'rejected'",
        ),
        ({"prompt": "q", "output": "a"}, "sft", "rename 'output' to 'completion'"),
    ],
)
def test_other_datasets_key_names_get_the_rename(tmp_path, row, purpose, problem):
    with pytest.raises(DataError) as err:
        _load(tmp_path, [row], purpose)
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path / 'd.jsonl'}: line 1: ") and problem in msg and "\n" not in msg


@pytest.mark.parametrize(
    "row, purpose, problem",
    [
        ({"prompt": "q", "completion": ""}, "sft", "completion is empty; fill it in or remove the row"),
        ({"prompt": "q", "completion": "  \n"}, "sft", "completion is empty"),
        ({"instruction": "q", "output": ""}, "sft", "every assistant message is empty"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}, "sft", "is empty"),
        ({"prompt": "q", "chosen": "", "rejected": "b"}, "dpo", "chosen is empty"),
        ({"prompt": "q", "chosen": "a", "rejected": "a"}, "dpo", "chosen and rejected are the same"),
        ({"prompt": "", "answer": "1"}, "rl", "prompt is empty"),
        ({"prompt": None, "answer": "1"}, "rl", "prompt must be a string or a list of messages, got NoneType"),
        ({"prompt": "q", "completion": 3}, "sft", "completion must be a string or a list of messages, got int"),
        ({"messages": [{"role": "system", "content": "s"}]}, "sft", "no assistant message to train on (its roles: "),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "sft",
            "content has parts of type image_url; polyrl trains on text",
        ),
        ({"messages": [{"role": "user", "content": 5}]}, "sft", "content must be a string (or a list of text parts)"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "sft", "unknown role 'robot'"),
    ],
)
def test_empty_and_malformed_rows_name_the_problem(tmp_path, row, purpose, problem):
    with pytest.raises(DataError, match="line 1: ") as err:
        _load(tmp_path, [row], purpose)
    assert problem in str(err.value) and "--skip-bad-rows" in str(err.value)
    good = {"sft": {"prompt": "q", "completion": "a"}, "dpo": {"prompt": "q", "chosen": "a", "rejected": "b"},
            "rl": {"prompt": "q", "answer": "1"}}[purpose]  # fmt: skip
    examples, stats = _load(tmp_path, [row, good], purpose, skip_bad_rows=True)
    assert stats.bad_rows == 1 and problem in stats.bad_examples[0]


def test_role_spellings_and_message_keys_of_either_format():
    want = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    rows = [
        {"messages": [{"role": "developer", "content": "s"}, {"role": "User", "content": "q"},
                      {"role": "ASSISTANT", "content": "a"}]},
        {"messages": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                      {"from": "gpt", "value": "a"}]},
        {"conversations": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                           {"role": "assistant", "content": "a"}]},
    ]  # fmt: skip
    for row in rows:
        assert as_sft(parse_row(row)).messages == want


def test_tool_calls_are_kept_for_a_template_that_renders_them(tokenizer):
    ex = as_sft(parse_row({"messages": TOOL_CONVERSATION}))
    call = ex.messages[1]
    assert call["content"] == "" and call["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert ex.messages[2]["tool_call_id"] == "c1"
    seq = ChatTokenizer(tokenizer, TOOLS_TEMPLATE).tokenize_messages(ex.messages)
    trained = tokenizer.decode([t for t, m in zip(seq.input_ids, seq.loss_mask) if m])
    assert trained == '<tool_call>add {"a": 1, "b": 2}</tool_call><|im_end|>\n3<|im_end|>\n'
    # a template that never writes tool_calls would train the call turn as empty: refused, naming the fix
    with pytest.raises(RowError, match="tool_calls, which the chat template does not render.*data.chat_template"):
        ChatTokenizer(tokenizer).tokenize_messages(ex.messages)
    bad = [*TOOL_CONVERSATION[:1], {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]
    with pytest.raises(RowError, match="tool call 1 must be"):
        parse_row({"messages": bad})


def test_a_glob_reads_its_files_in_order_and_a_split_on_a_file_is_refused(tmp_path):
    for name, n in (("b.jsonl", 2), ("a.jsonl", 1), ("c.txt", 5)):
        (tmp_path / name).write_text(json.dumps({"prompt": name, "completion": "x"}) + "\n" * n)
    examples, _ = load_examples(DataConfig(path=str(tmp_path / "*.jsonl")))
    assert [ex.messages[0]["content"] for _, ex in examples] == ["a.jsonl", "b.jsonl"]
    with pytest.raises(ConfigError, match=r"matches no .jsonl, .json, .parquet file \(it matches 1 other path"):
        DataConfig(path=str(tmp_path / "*.txt"))
    with pytest.raises(DataError, match=r"has no splits, so @test cannot pick one.*data.holdout"):
        load_examples(DataConfig(path=str(tmp_path / "a.jsonl") + "@test"))
    assert len(load_examples(DataConfig(path=str(tmp_path / "a.jsonl") + "@train"))[0]) == 1


@pytest.mark.parametrize("spec", ["nothere.csv", "data/train.txt", "mydata/", "nothere.jsonl.gz"])
def test_a_missing_local_file_is_not_looked_up_on_the_hub(spec):
    """Refused when the config is built, before anything is loaded (a hub lookup retried for ~30 s offline)."""
    with pytest.raises(ConfigError, match=f"data file '{spec}' does not exist"):
        DataConfig(path=spec)


def test_an_existing_csv_says_how_to_convert_it(tmp_path):
    (tmp_path / "x.csv").write_text("prompt,completion\nq,a\n")
    with pytest.raises(DataError, match=r"unsupported file type '.csv'.*to_json\('data.jsonl'"):
        load_examples(DataConfig(path=str(tmp_path / "x.csv")))


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"limit": "5"}, "data.limit='5': use an integer or unset (got str)"),
        ({"holdout": "0.1"}, "data.holdout='0.1': use a number (got str)"),
        ({"max_seq_len": "64"}, "data.max_seq_len='64': use an integer >= 2"),
        ({"shuffle": "no"}, "data.shuffle='no': use true or false (got str)"),
        ({"path": 3}, "data.path=3: use a string (got int)"),
        ({"seed": 1.5}, "data.seed=1.5: use an integer (got float)"),
    ],
)
def test_wrongly_typed_data_settings(kwargs, problem):
    with pytest.raises(ConfigError) as err:
        DataConfig(**{"path": "builtin:arithmetic", **kwargs})
    assert str(err.value) == problem


def test_a_prompt_longer_than_max_seq_len_is_dropped_and_counted(tmp_path, tokenizer):
    rows = [{"prompt": "q", "completion": "a"}, {"prompt": "What is 12 + 7? " * 20, "completion": "19"}]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = build_sft(DataConfig(path=str(path), max_seq_len=32), tokenizer, micro_batch_tokens=64)
    assert data.stats.dropped_too_long == 1 and data.stats.sequences == 1 and data.stats.truncated == 0


# TOOLS_TEMPLATE that also writes the row's tool definitions into a system block first (as Qwen2.5's does, in short)
DEFS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}" + TOOLS_TEMPLATE
)
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


def test_row_tools_are_rendered_into_the_prompt_and_never_trained(tmp_path, tokenizer):
    row = {"messages": TOOL_CONVERSATION, "tools": [ADD_TOOL]}
    ex = as_sft(parse_row(row))
    assert ex.tools == [ADD_TOOL]
    assert as_sft(parse_row({**row, "tools": json.dumps([ADD_TOOL])})).tools == [ADD_TOOL]  # stored as a string
    seq = ChatTokenizer(tokenizer, DEFS_TEMPLATE).tokenize_messages(ex.messages, tools=ex.tools)
    text = tokenizer.decode(seq.input_ids)
    assert text.startswith('<|im_start|>system\n# Tools\n{"name": "add", "description": "Adds two integers"')
    # the tool definitions are prompt: the trained tokens are exactly those without tools
    trained = tokenizer.decode([t for t, m in zip(seq.input_ids, seq.loss_mask) if m])
    assert trained == '<tool_call>add {"a": 1, "b": 2}</tool_call><|im_end|>\n3<|im_end|>\n'
    head = len(tokenizer(text[: text.index("<|im_start|>user")], add_special_tokens=False)["input_ids"])
    assert head > 10 and not any(seq.loss_mask[:head])
    # the data path (load -> tokenise -> pack) passes them too; a row without tools renders no tools block
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({"messages": TOOL_CONVERSATION}) + "\n")
    data = build_sft(DataConfig(path=str(path), chat_template=DEFS_TEMPLATE), tokenizer, micro_batch_tokens=4096)
    texts = [tokenizer.decode(unit[0].input_ids) for unit in data.units]
    assert [("Adds two integers" in t) for t in texts] == [True, False]


def test_tools_a_template_does_not_render_are_refused(tmp_path, tokenizer, plain_tokenizer):
    ex = as_sft(parse_row({"messages": TOOL_CONVERSATION, "tools": [ADD_TOOL]}))
    # TOOLS_TEMPLATE writes the call (so the name 'add' is in the text) but never the definitions
    for template in (TOOLS_TEMPLATE, DEFS_TEMPLATE.replace("{{ t['function'] | tojson }}", "a tool")):
        with pytest.raises(RowError, match="row has tools, but the chat template does not render them.*chat_template"):
            ChatTokenizer(tokenizer, template).tokenize_messages(ex.messages, tools=ex.tools)
    with pytest.raises(RowError, match="no definition of 'add' in the rendered text"):
        ChatTokenizer(tokenizer, DEFS_TEMPLATE.replace("{{ t['function'] | tojson }}", "a tool")).tokenize_messages(
            ex.messages, tools=ex.tools
        )
    plain = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(RowError, match="row has tools, which need a chat template"):
        ChatTokenizer(plain_tokenizer).tokenize_messages(plain, tools=[ADD_TOOL])
    # through the data path: the file and line are named
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"messages": TOOL_CONVERSATION, "tools": [ADD_TOOL]}) + "\n")
    with pytest.raises(DataError, match=r"t\.jsonl: line 1: the row has tools, but the chat template does not"):
        build_sft(DataConfig(path=str(path), chat_template=TOOLS_TEMPLATE), tokenizer, micro_batch_tokens=4096)


@pytest.mark.parametrize(
    "tools, problem",
    [
        ({"type": "function"}, "tools must be a list of {type: function, function: {name, description, parameters}}"),
        ("[{", "tools is a string that is not valid JSON"),
        ([{"type": "function", "function": {"description": "d"}}], "tools item 1 must be {type: function, function:"),
        ([ADD_TOOL, {"name": "add"}], "tools item 2 must be"),
        ([ADD_TOOL, "add"], "tools item 2 must be"),
    ],
)
@pytest.mark.parametrize(
    "row, purpose",
    [
        ({"messages": TOOL_CONVERSATION}, "sft"),
        ({"messages": TOOL_CONVERSATION[:1]}, "rl"),
        ({"prompt": "1+2?", "answer": "3"}, "rl"),
        ({"prompt": "1+2?", "chosen": "3", "rejected": "4"}, "dpo"),
    ],
)
def test_a_bad_tools_value_is_a_named_row_error(tmp_path, tools, problem, row, purpose):
    with pytest.raises(DataError) as err:
        _load(tmp_path, [{**row, "tools": tools}], purpose)
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path / 'd.jsonl'}: line 1: ") and problem in msg


def _prompt_text(tokenizer, template, messages, tools=None):
    return tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )


def test_rl_prompt_rows_render_their_tools_and_rewards_see_them(tmp_path, tokenizer):
    """A GRPO prompt row's tools are in the prompt the policy samples from (they were dropped silently)."""
    rows = [
        {"prompt": "1+2?", "answer": "3", "tools": [ADD_TOOL]},
        {"messages": TOOL_CONVERSATION[:1], "tools": json.dumps([ADD_TOOL])},  # the RL view of a messages row
        {"prompt": "1+2?", "chosen": "3", "rejected": "4", "tools": [ADD_TOOL]},  # and of a preference row
        {"prompt": "1+2?", "answer": "3"},
    ]
    path = tmp_path / "rl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=str(path), chat_template=DEFS_TEMPLATE)
    prompts, _ = load_prompts(cfg)
    assert [p.tools for p in prompts] == [[ADD_TOOL]] * 3 + [None]
    texts = [tokenizer.decode(ids) for ids in encode_prompts(chat_tokenizer(cfg, tokenizer), prompts, cfg.path)]
    user = [{"role": "user", "content": "1+2?"}]
    assert texts[:3] == [_prompt_text(tokenizer, DEFS_TEMPLATE, user, [ADD_TOOL])] * 3
    assert texts[0].startswith('<|im_start|>system\n# Tools\n{"name": "add", "description": "Adds two integers"')
    assert texts[0].endswith("<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n")
    assert texts[3] == _prompt_text(tokenizer, DEFS_TEMPLATE, user) and "# Tools" not in texts[3]
    # a reward function's example holds the tools (the schema a tool-call reward checks against)
    assert [example_view(p)["tools"] for p in prompts] == [[ADD_TOOL]] * 3 + [None]


def test_preference_rows_render_their_tools_into_both_prompts(tmp_path, tokenizer):
    rows = [
        {"prompt": "1+2?", "chosen": "3", "rejected": "4", "tools": [ADD_TOOL]},
        {"chosen": TOOL_CONVERSATION[:1] + [{"role": "assistant", "content": "3"}],
         "rejected": TOOL_CONVERSATION[:1] + [{"role": "assistant", "content": "4"}], "tools": [ADD_TOOL]},
    ]  # fmt: skip
    path = tmp_path / "pref.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = build_preference(DataConfig(path=str(path), chat_template=DEFS_TEMPLATE), tokenizer, micro_batch_tokens=4096)
    prompt = _prompt_text(tokenizer, DEFS_TEMPLATE, [{"role": "user", "content": "1+2?"}], [ADD_TOOL])
    assert "Adds two integers" in prompt
    for chosen, rejected in data.units:
        n = chosen.loss_mask.index(1)
        assert rejected.loss_mask.index(1) == n and chosen.input_ids[:n] == rejected.input_ids[:n]
        assert tokenizer.decode(chosen.input_ids[:n]) == prompt  # the shared prompt, tools included, untrained
        assert tokenizer.decode(chosen.input_ids) == prompt + "3<|im_end|>\n"
        assert tokenizer.decode(rejected.input_ids) == prompt + "4<|im_end|>\n"
    # ChatTokenizer.tokenize_preference (the per-pair API) gives the same sequences
    examples, _ = load_examples(DataConfig(path=str(path)), "dpo")
    pairs = [ChatTokenizer(tokenizer, DEFS_TEMPLATE).tokenize_preference(ex) for _, ex in examples]
    assert [(c.input_ids, r.input_ids) for c, r in pairs] == [(c.input_ids, r.input_ids) for c, r in data.units]


def test_rl_and_preference_tools_a_template_does_not_render_are_refused(tmp_path, tokenizer, plain_tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+2?", "answer": "3"}) + "\n")
    path.write_text(path.read_text() + json.dumps({"prompt": "1+2?", "answer": "3", "tools": [ADD_TOOL]}) + "\n")
    prompts, _ = load_prompts(DataConfig(path=str(path)))
    untold = "the row has tools, but the chat template does not render them (no definition of 'add' in the rendered"
    with pytest.raises(DataError) as err:
        encode_prompts(ChatTokenizer(tokenizer, TOOLS_TEMPLATE), prompts, str(path))
    assert str(err.value).startswith(f"{path}: prompt 2: {untold}") and "set data.chat_template" in str(err.value)
    with pytest.raises(RowError, match="row has tools, which need a chat template that renders them; set data.chat"):
        ChatTokenizer(plain_tokenizer).encode_prompt(prompts[1].messages, prompts[1].tools)
    with pytest.raises(DataError, match=r"d\.jsonl: prompt 2: the row has tools, which need a chat template"):
        encode_prompts(ChatTokenizer(plain_tokenizer), prompts, str(path))
    # preference rows: refused by file and line, as SFT rows are
    path.write_text(json.dumps({"prompt": "1+2?", "chosen": "3", "rejected": "4", "tools": [ADD_TOOL]}) + "\n")
    with pytest.raises(DataError, match=rf"d\.jsonl: line 1: {re.escape(untold)}"):
        build_preference(DataConfig(path=str(path), chat_template=TOOLS_TEMPLATE), tokenizer, micro_batch_tokens=4096)
    with pytest.raises(DataError, match=r"d\.jsonl: line 1: the row has tools, which need a chat template"):
        build_preference(DataConfig(path=str(path)), plain_tokenizer, micro_batch_tokens=4096)
