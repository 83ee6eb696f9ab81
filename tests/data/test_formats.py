"""Each format parses to the expected tokens and loss masks through the chat template."""

from __future__ import annotations

import pytest

from polyrl.data import ChatTokenizer
from polyrl.data.formats import RowError, as_prompt, as_sft, detect, parse_row
from polyrl.errors import ConfigError


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def masked_text(tok, seq):
    return tok.decode([i for i, m in zip(seq.input_ids, seq.loss_mask) if m])


def chat(tok, row, loss_on="assistant"):
    return ChatTokenizer(tok, loss_on=loss_on).tokenize_messages(as_sft(parse_row(row)).messages)


MULTI = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12 + 7?"},
        {"role": "assistant", "content": "19"},
        {"role": "user", "content": "Reverse the string: abc"},
        {"role": "assistant", "content": "cba"},
    ]
}
MULTI_TEXT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n"
    "<|im_start|>assistant\n19<|im_end|>\n<|im_start|>user\nReverse the string: abc<|im_end|>\n"
    "<|im_start|>assistant\ncba<|im_end|>\n"
)


def test_multi_turn_messages_mask_every_assistant_turn(tokenizer):
    seq = chat(tokenizer, MULTI)
    assert seq.input_ids == enc(tokenizer, MULTI_TEXT)
    assert masked_text(tokenizer, seq) == "19<|im_end|>\ncba<|im_end|>\n"
    # The mask is two contiguous runs: exactly the assistant contents plus their end-of-turn tokens.
    runs = sum(1 for a, b in zip([0] + seq.loss_mask, seq.loss_mask) if b and not a)
    assert runs == 2
    assert seq.num_loss_tokens == len(enc(tokenizer, "19<|im_end|>\n")) + len(enc(tokenizer, "cba<|im_end|>\n"))


def test_loss_policies_last_assistant_and_all(tokenizer):
    last = chat(tokenizer, MULTI, "last_assistant")
    assert masked_text(tokenizer, last) == "cba<|im_end|>\n"
    everything = chat(tokenizer, MULTI, "all")
    assert everything.loss_mask == [1] * len(everything.input_ids)


def test_sharegpt_with_system_matches_openai_messages(tokenizer):
    row = {
        "system": "You are a helpful assistant.",
        "conversations": [
            {"from": "human", "value": "What is 12 + 7?"},
            {"from": "gpt", "value": "19"},
            {"from": "human", "value": "Reverse the string: abc"},
            {"from": "gpt", "value": "cba"},
        ],
    }
    assert detect(row).name == "sharegpt"
    a, b = chat(tokenizer, row), chat(tokenizer, MULTI)
    assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask


def test_alpaca_joins_instruction_and_input(tokenizer):
    row = {"instruction": "Reverse the string:", "input": "abc", "output": "cba"}
    assert detect(row).name == "alpaca"
    seq = chat(tokenizer, row)
    text = "<|im_start|>user\nReverse the string:\n\nabc<|im_end|>\n<|im_start|>assistant\ncba<|im_end|>\n"
    assert seq.input_ids == enc(tokenizer, text)
    assert masked_text(tokenizer, seq) == "cba<|im_end|>\n"


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": "What is 12 + 7?", "completion": "19"},
        {"prompt": "What is 12 + 7?", "response": "19"},
        {
            "prompt": [{"role": "user", "content": "What is 12 + 7?"}],
            "completion": [{"role": "assistant", "content": "19"}],
        },
    ],
)
def test_prompt_completion_string_and_conversational(tokenizer, row):
    seq = chat(tokenizer, row)
    text = "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n19<|im_end|>\n"
    assert seq.input_ids == enc(tokenizer, text)
    assert masked_text(tokenizer, seq) == "19<|im_end|>\n"


def test_plain_concatenation_without_chat_template(plain_tokenizer):
    tok = plain_tokenizer
    ex = as_sft(parse_row({"prompt": "What is 12 + 7?", "completion": " 19"}))
    seq = ChatTokenizer(tok).tokenize_messages(ex.messages)
    prompt, answer = enc(tok, "What is 12 + 7?"), enc(tok, " 19")
    assert seq.input_ids == prompt + answer + [tok.eos_token_id]
    assert seq.loss_mask == [0] * len(prompt) + [1] * (len(answer) + 1)
    with pytest.raises(ConfigError, match="no chat template"):
        ChatTokenizer(tok).tokenize_messages(as_sft(parse_row(MULTI)).messages)


def test_template_override_is_used(plain_tokenizer, tokenizer):
    seq = ChatTokenizer(plain_tokenizer, chat_template=tokenizer.chat_template).tokenize_messages(
        as_sft(parse_row(MULTI)).messages
    )
    assert seq.input_ids == enc(plain_tokenizer, MULTI_TEXT)


def test_prefix_inconsistent_template_is_a_clear_error(tokenizer):
    # Like templates that rewrite a turn when it is the last one: earlier turns render differently afterwards.
    tricky = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if loop.last and m['role'] == 'assistant' %}"
        "[final] {% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    msgs = as_sft(parse_row(MULTI)).messages
    with pytest.raises(ConfigError, match="prefix-consistently.*assistant turn 3"):
        ChatTokenizer(tokenizer, chat_template=tricky).tokenize_messages(msgs)
    seq = ChatTokenizer(tokenizer, chat_template=tricky, loss_on="last_assistant").tokenize_messages(msgs)
    assert masked_text(tokenizer, seq) == "[final] cba<|im_end|>\n"


def test_pretokenized_labels_and_loss_mask():
    ex = parse_row({"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]})
    assert ex.input_ids == [5, 6, 7, 8] and ex.loss_mask == [0, 0, 1, 1]
    ex = parse_row({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]})
    assert ex.loss_mask == [0, 1, 1]
    assert parse_row({"input_ids": [1, 2]}).loss_mask == [1, 1]
    with pytest.raises(RowError, match="unshifted"):
        parse_row({"input_ids": [5, 6], "labels": [6, -100]})
    with pytest.raises(RowError, match="as long as input_ids"):
        parse_row({"input_ids": [5, 6], "loss_mask": [1]})


def test_preference_pairs_strings_messages_and_shared_prefix(tokenizer):
    ct = ChatTokenizer(tokenizer)
    ex = parse_row({"prompt": "What is 12 + 7?", "chosen": "19", "rejected": "21"})
    chosen, rejected = ct.tokenize_preference(ex)
    assert masked_text(tokenizer, chosen) == "19<|im_end|>\n"
    assert masked_text(tokenizer, rejected) == "21<|im_end|>\n"
    n = len(enc(tokenizer, "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"))
    assert chosen.input_ids[:n] == rejected.input_ids[:n] and chosen.loss_mask[:n] == [0] * n
    # Anthropic-HH style: full conversations, the common prefix is the prompt.
    hh = {
        "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go away"}],
    }
    ex = parse_row(hh)
    assert ex.prompt == [{"role": "user", "content": "hi"}] and ex.rejected[0]["content"] == "go away"


def test_prompt_only_view_for_rl(tokenizer):
    ex = as_prompt(parse_row({"question": "What is 2 + 2?", "answer": "4", "task": "arithmetic"}))
    assert ex.answer == "4" and ex.task == "arithmetic" and ex.messages[-1]["content"] == "What is 2 + 2?"
    ex = as_prompt(parse_row(MULTI))
    assert ex.answer == "cba" and ex.messages[-1]["role"] == "user"
    ids = ChatTokenizer(tokenizer).encode_prompt(ex.messages)
    assert tokenizer.decode(ids).endswith("Reverse the string: abc<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "row, problem",
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role 'robot'"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
        ({"messages": "hello"}, "non-empty list"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown role 'alien'"),
        ({"instruction": 3, "output": "x"}, "instruction must be a string"),
        ({"body": "x"}, "cannot tell the format"),
        ({"text": "x"}, "a 'text' row is plain text"),
        ({"prompt": "x", "chosen": "a", "rejected": "b"}, "cannot be used for SFT"),
    ],
)
def test_bad_rows_name_the_problem(row, problem):
    with pytest.raises(RowError, match=problem):
        as_sft(parse_row(row))


def test_forced_format_reports_missing_field():
    with pytest.raises(RowError, match="missing field 'output' for format 'alpaca'"):
        parse_row({"instruction": "x"}, "alpaca")


def test_tokenize_many_is_one_encode_call_and_equals_row_by_row(tokenizer):
    # A template that refuses a "tool" turn: that row comes back as its RowError, in its place.
    strict = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    multi = as_sft(parse_row(MULTI)).messages
    pair = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    bad = [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]
    convs, starts = [multi, bad, pair, multi], [0, 0, 0, 3]

    calls = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, text, **kw):
            calls.append(text)
            return self.inner(text, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    ct = ChatTokenizer(Counting(tokenizer), chat_template=strict)
    out = ct.tokenize_many(convs, starts)
    assert len(calls) == 1 and isinstance(calls[0], list)  # every text of the batch in one call
    assert isinstance(out[1], RowError) and "no tool turns" in str(out[1])
    one = ChatTokenizer(tokenizer, chat_template=strict)
    for i in (0, 2, 3):
        ref = one.tokenize_messages(convs[i], starts[i])
        assert out[i].input_ids == ref.input_ids and out[i].loss_mask == ref.loss_mask
    assert masked_text(tokenizer, out[0]) == "19<|im_end|>\ncba<|im_end|>\n"
    assert masked_text(tokenizer, out[3]) == "cba<|im_end|>\n"  # loss_from=3 skips the first answer
