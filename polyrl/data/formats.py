"""Dataset formats: detect a row's format from its keys (or force one) and parse it into a canonical example.

Formats (registry ``FORMATS``, checked in this order by ``detect``):
  pretokenized  {"input_ids": [...], "labels": [...] | "loss_mask": [...]}   (labels unshifted, HF style)
  preference    {"prompt"?: str | msgs, "chosen": str | msgs, "rejected": str | msgs, "tools"?: [...]}
  messages      {"messages": [{"role", "content"}, ...], "tools"?: [...]}       (OpenAI)
  sharegpt      {"conversations": [{"from": "human" | "gpt" | ..., "value"}], "system"?: str, "tools"?: [...]}
  alpaca        {"instruction", "input"?, "output", "system"?}
  prompt_completion {"prompt": str | msgs, "completion" | "response": str | msgs}
  prompt        {"prompt" | "question": str | msgs, "answer" | "solution" | "ground_truth"?: str, "tools"?}  (RL)
A parser raises ``RowError`` with the problem; the caller adds the file and row. No tokenisation here.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polyrl.data.examples import ChatExample, Message, PreferenceExample, PromptExample, TokensExample

ROLES = ("system", "user", "assistant", "tool")
# role names of other formats (ShareGPT's from, OpenAI's developer) -> ours; matched case-insensitively in both the
# messages and the conversations format
ROLE_ALIASES = {
    **{r: r for r in ROLES},
    "developer": "system",
    "human": "user",
    "gpt": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
}
ANSWER_KEYS = ("answer", "solution", "ground_truth", "reference", "target")
# keys other datasets use -> ours, in order of preference; named when a row fits no format (or not the algorithm)
KEY_HINTS: dict[str, tuple[str, ...]] = {
    "query": ("prompt",),
    "problem": ("prompt",),
    "input": ("instruction", "prompt"),
    "response": ("output", "completion"),
    "output": ("completion",),
    "reply": ("completion", "output"),
    "accepted": ("chosen",),
    "preferred": ("chosen",),
    "chosen_response": ("chosen",),
    "rejected_response": ("rejected",),
    "dispreferred": ("rejected",),
    "label": ("answer",),
    "conversation": ("messages",),
    "dialog": ("messages",),
    "chat": ("messages",),
}
# message keys passed on to the chat template besides role and content (OpenAI tool calling)
MESSAGE_EXTRAS = ("tool_calls", "tool_call_id", "name")

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
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):  # OpenAI content parts
        other = sorted({str(p.get("type")) for p in value if p.get("type") != "text"})
        if other:
            raise RowError(f"{what} has parts of type {', '.join(other)}; polyrl trains on text: keep only text parts")
        return "".join(str(p.get("text", "")) for p in value)
    raise RowError(f"{what} must be a string (or a list of text parts), got {type(value).__name__}")


def _role(raw: Any, what: str) -> str:
    role = ROLE_ALIASES.get(str(raw).lower()) if isinstance(raw, str) else None
    if role is None:
        raise RowError(f"{what} has unknown role {raw!r}; use one of {', '.join(ROLES)}")
    return role


def _message(m: Any, what: str, role_key: str, content_key: str) -> Message:
    """One message: ``{role, content}`` or ShareGPT's ``{from, value}`` (either in either format)."""
    if isinstance(m, dict) and role_key not in m and {"role", "from"} & set(m):
        role_key, content_key = ("role", "content") if "role" in m else ("from", "value")
    if not isinstance(m, dict) or role_key not in m or content_key not in m:
        got = f"keys {sorted(m)}" if isinstance(m, dict) else type(m).__name__
        raise RowError(f"{what} must be an object with {role_key!r} and {content_key!r}, got {got}")
    role = _role(m[role_key], what)
    content = m[content_key]
    if content is None and role == "assistant" and m.get("tool_calls"):
        content = ""  # OpenAI: an assistant turn that only calls tools has content null
    msg: Message = {"role": role, "content": _content(content, f"{what} content")}
    for key in MESSAGE_EXTRAS:
        if m.get(key) is not None:
            msg[key] = m[key]
    if "tool_calls" in msg:
        msg["tool_calls"] = _tool_calls(msg["tool_calls"], what)
    return msg


def _tool_calls(calls: Any, what: str) -> list[dict]:
    """OpenAI ``tool_calls`` with each ``function.arguments`` JSON string decoded to the object chat templates
    expect (HF templates write ``arguments | tojson``; a string would be encoded twice)."""
    if not isinstance(calls, list):
        raise RowError(f"{what} tool_calls must be a list of calls")
    out = []
    for k, call in enumerate(calls, start=1):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RowError(f"{what} tool call {k} must be {{type: function, function: {{name, arguments}}}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise RowError(f"{what} tool call {k} arguments are not valid JSON ({exc.msg})") from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _tools(row: dict) -> list[dict] | None:
    """A row's OpenAI ``tools`` (``[{type: function, function: {name, description?, parameters?}}]``, or that list
    as a JSON string, as some datasets store it); None when absent or empty."""
    tools = row.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else []
        except json.JSONDecodeError as exc:
            raise RowError(f"tools is a string that is not valid JSON ({exc.msg}); give a list of tools") from None
    if not isinstance(tools, list):
        raise RowError(
            f"tools must be a list of {{type: function, function: {{name, description, parameters}}}}, "
            f"got {type(tools).__name__}"
        )
    for k, tool in enumerate(tools, start=1):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name.strip():
            got = f"keys {sorted(tool)}" if isinstance(tool, dict) else type(tool).__name__
            raise RowError(
                f"tools item {k} must be {{type: function, function: {{name, description, parameters}}}} with a "
                f"non-empty function name, got {got}"
            )
    return tools or None


def _messages(value: Any, what: str, role_key: str = "role", content_key: str = "content") -> list[Message]:
    if not isinstance(value, list) or not value:
        raise RowError(f"{what} must be a non-empty list of messages, got {_kind(value)}")
    return [_message(m, f"{what} message {i}", role_key, content_key) for i, m in enumerate(value, start=1)]


def _kind(value: Any) -> str:
    return "an empty list" if value == [] else "an empty string" if value == "" else type(value).__name__


def _text_or_messages(value: Any, what: str, role: str) -> list[Message]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list):
        raise RowError(f"{what} must be a string or a list of messages, got {type(value).__name__}")
    return _messages(value, what)


def _not_empty(messages: list[Message], what: str) -> None:
    """A trained or prompted text that is empty (or only whitespace) is a data mistake, not a target."""
    if all(not m["content"].strip() and not m.get("tool_calls") for m in messages):
        raise RowError(f"{what} is empty; fill it in or remove the row")


def _answer(row: dict) -> str | None:
    for key in ANSWER_KEYS:
        if row.get(key) is not None:
            return str(row[key])
    return None


def _meta(row: dict) -> dict:
    return {"task": row["task"]} if isinstance(row.get("task"), str) else {}


def _need_assistant(messages: list[Message], what: str) -> None:
    assistant = [m for m in messages if m["role"] == "assistant"]
    if not assistant:
        roles = ", ".join(m["role"] for m in messages)
        raise RowError(f"{what} has no assistant message to train on (its roles: {roles})")
    _not_empty(assistant, "every assistant message")


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
        return _pair(chosen[:n], chosen[n:], rejected[n:], _tools(row))
    prompt_msgs = _text_or_messages(prompt, "prompt", "user")
    chosen = _text_or_messages(row["chosen"], "chosen", "assistant")
    rejected = _text_or_messages(row["rejected"], "rejected", "assistant")
    return _pair(prompt_msgs, chosen, rejected, _tools(row))


def _pair(
    prompt: list[Message], chosen: list[Message], rejected: list[Message], tools: list[dict] | None
) -> PreferenceExample:
    for what, msgs in (("chosen", chosen), ("rejected", rejected)):
        if msgs[-1]["role"] != "assistant":
            raise RowError(f"{what} must end with an assistant message")
        _not_empty(msgs, what)
    if chosen == rejected:
        raise RowError("chosen and rejected are the same, so the pair teaches nothing; remove the row")
    return PreferenceExample(prompt, chosen, rejected, tools)


def parse_messages(row: dict) -> ChatExample:
    msgs = _messages(row["messages"], "messages")
    return ChatExample(msgs, _answer(row), _meta(row), _tools(row))


def parse_sharegpt(row: dict) -> ChatExample:
    msgs = _messages(row["conversations"], "conversations", "from", "value")
    if isinstance(row.get("system"), str) and row["system"] and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": row["system"]})
    return ChatExample(msgs, _answer(row), _meta(row), _tools(row))


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
    completion = _text_or_messages(row[key], key, "assistant")
    if completion[-1]["role"] != "assistant":
        raise RowError(f"{key} must end with an assistant message")
    _not_empty(completion, key)
    msgs = msgs + completion
    answer = _answer(row)
    return ChatExample(msgs, answer, _meta(row))


def parse_prompt(row: dict) -> PromptExample:
    key = "prompt" if "prompt" in row else "question"
    msgs = _text_or_messages(row[key], key, "user")
    _not_empty(msgs, key)
    meta = {k: v for k, v in row.items() if k not in (key, *ANSWER_KEYS)}
    return PromptExample(msgs, _answer(row), _meta(row).get("task"), meta, _tools(row))


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


def rename_hint(keys: Any, accept: Any = None) -> str:
    """``; rename 'query' to 'prompt'``: the fewest renames of ``KEY_HINTS`` that make ``keys`` a row of a format in
    ``accept`` (format names; default any); '' when no rename does."""
    keys = [k for k in keys if isinstance(k, str)]
    options = [[(k, None), *((k, new) for new in KEY_HINTS[k] if new not in keys)] for k in keys if k in KEY_HINTS]
    best: list[tuple[str, str]] | None = None
    for choice in itertools.product(*options):
        renames = [(k, new) for k, new in choice if new is not None]
        if not renames or (best is not None and len(renames) >= len(best)):
            continue
        renamed = {dict(renames).get(k, k): None for k in keys}
        fmt = next((f for f in FORMATS.values() if f.detect(renamed)), None)
        if fmt is not None and (accept is None or fmt.name in accept):
            best = renames
    if not best:
        return ""
    return "; rename " + ", ".join(f"{k!r} to {new!r}" for k, new in best)


def detect(row: dict) -> Format:
    """The first format whose keys match ``row``; RowError listing the keys (and the renames that would make a
    format, ``query`` -> ``prompt``) when none does."""
    for fmt in FORMATS.values():
        if fmt.detect(row):
            return fmt
    hint = rename_hint(row)
    if "text" in row and not hint:
        raise RowError(
            "a 'text' row is plain text (continued pretraining), which polyrl does not train on as such; give "
            "messages or prompt/completion, or tokenize it into input_ids (pretokenized rows train on every token)"
        )
    raise RowError(
        f"cannot tell the format from keys {sorted(row)}{hint}; expected messages, conversations, instruction/output, "
        "prompt/completion, chosen/rejected, input_ids or prompt/question (or set data.format)"
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


PURPOSE_FORMATS = {
    "sft": ("pretokenized", "messages", "sharegpt", "alpaca", "prompt_completion"),
    "dpo": ("preference",),
    "rl": ("messages", "sharegpt", "alpaca", "prompt_completion", "prompt"),
}


def view_hint(purpose: str, keys: Any) -> str:
    """The renames that would make a row of ``keys`` a row for ``purpose`` (sft / dpo / rl); '' when none."""
    return rename_hint(keys, PURPOSE_FORMATS.get(purpose))


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
        return PromptExample(msgs, answer, example.meta.get("task"), dict(example.meta), example.tools)
    if isinstance(example, PreferenceExample):
        return PromptExample(list(example.prompt), None, None, {}, example.tools)
    raise RowError("pre-tokenized rows cannot be used as RL prompts; give prompt text or messages")
