"""Dataset formats: detect a row's format from its keys (or force one) and parse it into a canonical example.

Formats (registry ``FORMATS``, checked in this order by ``detect``):
  pretokenized  {"input_ids": [...], "labels": [...] | "loss_mask": [...]}   (labels unshifted, HF style)
  preference    {"prompt"?: str | msgs, "chosen": str | msgs, "rejected": str | msgs}
  messages      {"messages": [{"role", "content"}, ...]}                        (OpenAI)
  sharegpt      {"conversations": [{"from": "human" | "gpt" | ..., "value"}], "system"?: str}
  alpaca        {"instruction", "input"?, "output", "system"?}
  prompt_completion {"prompt": str | msgs, "completion" | "response": str | msgs}
  prompt        {"prompt" | "question": str | msgs, "answer" | "solution" | "ground_truth"?: str}   (RL)
A parser raises ``RowError`` with the problem; the caller adds the file and row. No tokenisation here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polyrl.data.examples import ChatExample, Message, PreferenceExample, PromptExample, TokensExample

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
ANSWER_KEYS = ("answer", "solution", "ground_truth", "reference", "target")

Example = ChatExample | TokensExample | PreferenceExample | PromptExample


class RowError(ValueError):
    """A row that does not fit its format; the message is the problem, without file or row."""


@dataclass(frozen=True)
class Format:
    name: str
    detect: Callable[[dict], bool]
    parse: Callable[[dict], Example]


def _content(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)  # OpenAI content parts, text only
    raise RowError(f"{what} must be a string, got {type(value).__name__}")


def _messages(value: Any, what: str, role_key: str = "role", content_key: str = "content", roles=None) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise RowError(f"{what} must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value, start=1):
        if not isinstance(m, dict) or role_key not in m or content_key not in m:
            raise RowError(f"{what} message {i} must be an object with {role_key!r} and {content_key!r}")
        raw_role = m[role_key]
        role = roles.get(str(raw_role).lower()) if roles else raw_role
        if role not in ROLES:
            allowed = sorted(roles) if roles else ROLES
            raise RowError(f"{what} message {i} has unknown role {raw_role!r}; use one of {', '.join(allowed)}")
        msg = {"role": role, "content": _content(m[content_key], f"{what} message {i} content")}
        out.append(msg)
    return out


def _text_or_messages(value: Any, what: str, role: str) -> list[Message]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value, what)


def _answer(row: dict) -> str | None:
    for key in ANSWER_KEYS:
        if row.get(key) is not None:
            return str(row[key])
    return None


def _meta(row: dict) -> dict:
    return {"task": row["task"]} if isinstance(row.get("task"), str) else {}


def _need_assistant(messages: list[Message], what: str) -> None:
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(f"{what} has no assistant message to train on")


def parse_pretokenized(row: dict) -> TokensExample:
    ids = row["input_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise RowError("input_ids must be a non-empty list of non-negative integers")
    if row.get("labels") is not None:
        labels = row["labels"]
        if not isinstance(labels, list) or len(labels) != len(ids):
            raise RowError(f"labels must be a list as long as input_ids ({len(ids)})")
        for t, (i, lab) in enumerate(zip(ids, labels)):
            if lab != -100 and lab != i:
                raise RowError(
                    f"labels[{t}]={lab} is neither -100 nor input_ids[{t}]={i}; labels must be unshifted "
                    "(HF convention: a copy of input_ids with -100 on tokens without loss)"
                )
        mask = [int(lab != -100) for lab in labels]
    elif row.get("loss_mask") is not None:
        mask = row["loss_mask"]
        if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1, True, False) for m in mask):
            raise RowError(f"loss_mask must be a list of 0/1 as long as input_ids ({len(ids)})")
        mask = [int(m) for m in mask]
    else:
        mask = [1] * len(ids)
    return TokensExample(list(ids), mask)


def parse_preference(row: dict) -> PreferenceExample:
    prompt = row.get("prompt")
    if prompt is None:
        # Full conversations (e.g. Anthropic HH): the shared prefix is the prompt.
        chosen = _messages(row["chosen"], "chosen")
        rejected = _messages(row["rejected"], "rejected")
        n = 0
        while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise RowError("chosen and rejected share no prompt; add a 'prompt' field")
        return PreferenceExample(chosen[:n], chosen[n:], rejected[n:])
    prompt_msgs = _text_or_messages(prompt, "prompt", "user")
    chosen = _text_or_messages(row["chosen"], "chosen", "assistant")
    rejected = _text_or_messages(row["rejected"], "rejected", "assistant")
    for what, msgs in (("chosen", chosen), ("rejected", rejected)):
        if msgs[-1]["role"] != "assistant":
            raise RowError(f"{what} must end with an assistant message")
    return PreferenceExample(prompt_msgs, chosen, rejected)


def parse_messages(row: dict) -> ChatExample:
    msgs = _messages(row["messages"], "messages")
    return ChatExample(msgs, _answer(row), _meta(row))


def parse_sharegpt(row: dict) -> ChatExample:
    msgs = _messages(row["conversations"], "conversations", "from", "value", SHAREGPT_ROLES)
    if isinstance(row.get("system"), str) and row["system"] and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": row["system"]})
    return ChatExample(msgs, _answer(row), _meta(row))


def parse_alpaca(row: dict) -> ChatExample:
    instruction = _content(row["instruction"], "instruction")
    extra = row.get("input")
    user = instruction if not extra else f"{instruction}\n\n{_content(extra, 'input')}"
    msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": _content(row["output"], "output")}]
    if isinstance(row.get("system"), str) and row["system"]:
        msgs.insert(0, {"role": "system", "content": row["system"]})
    return ChatExample(msgs, _answer(row), _meta(row))


def parse_prompt_completion(row: dict) -> ChatExample:
    key = "completion" if "completion" in row else "response"
    msgs = _text_or_messages(row["prompt"], "prompt", "user")
    msgs = msgs + _text_or_messages(row[key], key, "assistant")
    if msgs[-1]["role"] != "assistant":
        raise RowError(f"{key} must end with an assistant message")
    answer = _answer(row)
    return ChatExample(msgs, answer, _meta(row))


def parse_prompt(row: dict) -> PromptExample:
    key = "prompt" if "prompt" in row else "question"
    msgs = _text_or_messages(row[key], key, "user")
    meta = {k: v for k, v in row.items() if k not in (key, *ANSWER_KEYS)}
    return PromptExample(msgs, _answer(row), _meta(row).get("task"), meta)


FORMATS: dict[str, Format] = {}


def register_format(fmt: Format) -> None:
    FORMATS[fmt.name] = fmt


for _fmt in (
    Format("pretokenized", lambda r: "input_ids" in r, parse_pretokenized),
    Format("preference", lambda r: "chosen" in r and "rejected" in r, parse_preference),
    Format("messages", lambda r: "messages" in r, parse_messages),
    Format("sharegpt", lambda r: "conversations" in r, parse_sharegpt),
    Format("alpaca", lambda r: "instruction" in r and "output" in r, parse_alpaca),
    Format(
        "prompt_completion", lambda r: "prompt" in r and ("completion" in r or "response" in r), parse_prompt_completion
    ),
    Format("prompt", lambda r: "prompt" in r or "question" in r, parse_prompt),
):
    register_format(_fmt)


def detect(row: dict) -> Format:
    """The first format whose keys match ``row``; RowError listing the keys when none does."""
    for fmt in FORMATS.values():
        if fmt.detect(row):
            return fmt
    raise RowError(
        f"cannot tell the format from keys {sorted(row)}; expected messages, conversations, instruction/output, "
        "prompt/completion, chosen/rejected, input_ids or prompt (or set the format explicitly)"
    )


def parse_row(row: dict, fmt: str = "auto") -> Example:
    """Parse ``row`` with format ``fmt`` ("auto" detects it). Raises RowError naming the problem."""
    if fmt == "auto":
        chosen = detect(row)
    else:
        chosen = FORMATS[fmt]
    try:
        return chosen.parse(row)
    except KeyError as exc:
        raise RowError(f"missing field {exc.args[0]!r} for format {chosen.name!r}") from None


def as_sft(example: Example) -> ChatExample | TokensExample:
    """SFT view: chat or token examples; preference and prompt-only rows are rejected with a reason."""
    if isinstance(example, ChatExample):
        _need_assistant(example.messages, "conversation")
        return example
    if isinstance(example, TokensExample):
        return example
    if isinstance(example, PreferenceExample):
        raise RowError("a preference pair (chosen/rejected) cannot be used for SFT; use --algo dpo")
    if getattr(example, "answer", None) is not None:  # {"question", "answer"}: an RL row (the answer is checked)
        raise RowError(
            "a prompt row with a reference answer is an RL row (the reward checks the answer); for SFT name the "
            "target column completion or response (prompt/completion), or use an RL algo"
        )
    raise RowError("a prompt-only row has no completion to train on; add a completion/response or use an RL algo")


def as_preference(example: Example) -> PreferenceExample:
    if not isinstance(example, PreferenceExample):
        raise RowError("DPO needs preference rows with 'chosen' and 'rejected'")
    return example


def as_prompt(example: Example) -> PromptExample:
    """RL view: the conversation up to the last non-assistant turn; a trailing assistant turn becomes the answer."""
    if isinstance(example, PromptExample):
        return example
    if isinstance(example, ChatExample):
        msgs = list(example.messages)
        answer = example.answer
        if msgs and msgs[-1]["role"] == "assistant":
            last = msgs.pop()
            answer = answer if answer is not None else last["content"]
        if not msgs:
            raise RowError("the conversation has no prompt before the assistant turn")
        return PromptExample(msgs, answer, example.meta.get("task"), dict(example.meta))
    if isinstance(example, PreferenceExample):
        return PromptExample(list(example.prompt), None, None, {})
    raise RowError("pre-tokenized rows cannot be used as RL prompts; give prompt text or messages")
