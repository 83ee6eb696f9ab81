"""Tool-call formats per model family: parse a reply into OpenAI ``tool_calls``, stream them, and constrain a
forced call to the tools' parameter schemas. Shared by ``polyrl serve`` and the agent proxy.

Registry (``TOOL_PARSERS``, ``get_parser(name)``, ``detect_parser(chat_template)``):
- ``hermes`` (alias ``qwen``): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks anywhere in
  the reply (Qwen2.5 / Qwen3, Hermes, and what ``render.py``'s system-prompt fallback asks a template-less model
  for). Parsing is ``tools.parse_reply``.
- ``llama3_json``: the whole reply is ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``),
  several separated by ``;`` (Llama 3.1 / 3.2 JSON tool calling). Without the tag, JSON whose objects lack
  ``parameters`` / ``arguments`` is content (an answer in a response format), not a call.
- ``mistral``: after optional content, either the JSON-list form ``[TOOL_CALLS][{"name": ..., "arguments": {...}},
  ...]`` (Mistral v3 tokenizers: Mistral 7B v0.3, Mixtral, Nemo) or the form of tokenizer v11+ (Mistral Small 3.1+,
  Magistral, Devstral): ``[TOOL_CALLS]name[ARGS]{...}`` per call, optionally ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}``,
  several calls one after another. Both parse; a forced call is written in the v11 form when the chat template
  writes ``[ARGS]`` or the tokenizer has ``[ARGS]`` as a special token, else in the list form. ``[TOOL_CALLS]`` and
  ``[ARGS]`` are special tokens, so requests keep special tokens in the text. Call ids are 9 alphanumeric characters
  (a hash of the caller's id), the only ids Mistral's chat templates accept back in the history.

Each parser: ``parse(text, call_prefix)`` -> an OpenAI assistant message (``content``, ``tool_calls``,
``invalid_tool_calls`` for malformed ones, as ``tools.parse_reply``); ``call_start(text)`` / ``holdback(text)`` for
streaming (``ToolCallStream``: text before a call streams as content, a call is sent once it is complete);
``unfinished(text)``: where a reply cut by the token limit left a call half written (``finished_text`` drops it, and
``finish_reason`` keeps such a reply "length": ``polyrl serve`` and the agent proxy answer alike);
``call_rules(tools, parallel, tokenizer)``: Lark rules (llguidance's dialect, ``%json`` for the arguments) whose
rule ``calls`` admits only calls of ``tools`` in this format. From them, ``grammar(...)`` (``start: calls``: for
``tool_choice: required`` or a named function) and ``union_grammar(tools, parallel, answer, ...)`` (``start: calls |
answer``: ``tool_choice: auto`` with a ``response_format``: a call, or an answer in the format; ``answer_rule`` writes
a structured output as that rule). A parser that cannot say its syntax raises ``NoCallGrammar``.
Not here: rendering tools into prompts (``render.py``), HTTP (``polyrl.server.chat``).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from polyrl.agents.tools import CLOSE, OPEN, parse_reply
from polyrl.errors import UserError

# JSON layout of forced calls: the one chat templates render (Python's json.dumps), see infer/structured.py
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _fn(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool)


def _params_schema(tool: dict[str, Any]) -> dict[str, Any]:
    params = _fn(tool).get("parameters")
    if isinstance(params, dict) and params:
        return params
    return {"type": "object", "properties": {}, "additionalProperties": False}  # no parameters: the call takes none


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # their values are JSON data, not schemas
# keywords whose value maps names (a parameter's, a definition's) to schemas: a name is never a keyword
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with every local JSON-pointer ``$ref`` (``#`` or ``#/...``) made relative to ``#`` + ``base``: where
    it now lives. Names under ``properties`` / ``$defs`` are names, even ``default`` or ``enum``; anchors
    (``#name``) resolve anywhere in the document and are left as they are."""
    if isinstance(schema, list):
        return [_rebase_refs(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = "#" + base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebase_refs(sub, base) for name, sub in value.items()}
        else:
            out[key] = value if key in _DATA_KEYWORDS else _rebase_refs(value, base)
    return out


def call_schema(tools: list[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    """A JSON schema admitting ``{"name": <one tool's name>, args_key: <that tool's parameters>}``.

    A parameters schema with local ``$ref``s (pydantic writes nested models as ``#/$defs/Name``) is put whole under
    the call schema's ``$defs`` and referenced from there, its references rebased onto it: nested inside the call
    object they would point into the call schema's root, which has no such definitions."""
    options, defs = [], {}
    for i, t in enumerate(tools):
        params = _params_schema(t)
        if '"$ref"' in json.dumps(params):
            key = f"polyrl_tool_{i}"
            defs[key] = _rebase_refs(params, f"/$defs/{key}")
            params = {"$ref": f"#/$defs/{key}"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": _fn(t)["name"]}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
    return {**schema, "x-guidance": _JSON_STYLE}


def _special_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when ``tokenizer`` has it as one special token (named, or an added token marked special,
    as Mistral's ``[TOOL_CALLS]`` / ``[ARGS]`` are), else None."""
    if tokenizer is None:
        return None
    if text in set(getattr(tokenizer, "all_special_tokens", []) or []):
        return int(tokenizer.convert_tokens_to_ids(text))
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "content", None) == text and getattr(tok, "special", False):
            return int(i)
    return None


def _literal(text: str, tokenizer: Any) -> str:
    """``text`` in a Lark rule: a quoted string, or ``<[id]>`` when the tokenizer has it as one special token (a
    special token never matches text bytes in llguidance)."""
    i = _special_id(tokenizer, text)
    return f"<[{i}]>" if i is not None else json.dumps(text)


def _styled(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with the compact JSON layout (its own ``x-guidance`` options win)."""
    return {**schema, "x-guidance": {**_JSON_STYLE, **(schema.get("x-guidance") or {})}}


class NoCallGrammar(UserError):
    """A parser (or a structured output) that cannot be written as a Lark rule for constrained tool calls."""


def answer_rule(structured: Any) -> str:
    """A structured output (``StructuredOutputs``: ``kind``, ``spec``) as the right side of a Lark rule, for the
    ``answer`` branch of ``union_grammar``: ``json`` / ``json_object`` as ``%json``, ``choice`` as alternatives,
    ``regex`` as a regex literal. A whole grammar (``grammar`` / ``lark``) cannot be nested: ``NoCallGrammar``."""
    kind, spec = structured.kind, structured.spec
    if kind == "json":
        return f"%json {json.dumps(_styled(json.loads(spec)))}"
    if kind == "json_object":
        return f"%json {json.dumps(_styled({'type': 'object'}))}"
    if kind == "choice":
        return " | ".join(json.dumps(c) for c in json.loads(spec))
    if kind == "regex":
        return "/" + re.sub(r"(?<!\\)/", r"\/", spec) + "/"
    raise NoCallGrammar(
        f"a {kind} structured output cannot be combined with tool calls; give a JSON schema, json_object, regex or "
        "choice, or set tool_choice to none or required"
    )


def _holdback_marker(text: str, marker: str) -> int:
    """Where the longest suffix of ``text`` that could begin ``marker`` starts (``len(text)`` if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class ToolParser:
    name = ""
    keep_special_tokens = False  # the call marker is a special token: detokenise with skip_special_tokens=False

    def parse(self, text: str, call_prefix: str = "call") -> dict[str, Any]:
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Where a tool call begins in ``text`` (None: no call has begun)."""
        raise NotImplementedError

    def holdback(self, text: str) -> int:
        """While no call has begun: the position from which ``text`` must be held back (it may begin one)."""
        raise NotImplementedError

    def unfinished(self, text: str) -> int:
        """For a reply cut by the token limit: where the call it left unfinished begins (an opened call, or the
        start of a call marker at the very end), ``len(text)`` when it left none. The part from there on is neither
        a call nor content: it is dropped, as OpenAI never shows a half-written call."""
        return len(text)

    def call_rules(self, tools: list[dict[str, Any]], parallel: bool, tokenizer: Any = None) -> str:
        """Lark rules whose rule ``calls`` admits one call of ``tools`` (several when ``parallel``) in this format."""
        raise NoCallGrammar(f"the {self.name or type(self).__name__} tool-call parser cannot constrain calls")

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, tokenizer: Any = None) -> str:
        """Only calls of ``tools`` (``tool_choice: required`` or a named function)."""
        return "start: calls\n" + self.call_rules(tools, parallel, tokenizer)

    def union_grammar(self, tools: list[dict[str, Any]], parallel: bool, answer: str, tokenizer: Any = None) -> str:
        """Calls of ``tools``, or ``answer`` (a Lark rule's right side, see ``answer_rule``): ``tool_choice: auto``
        with a response format."""
        return f"start: calls | answer\nanswer: {answer}\n" + self.call_rules(tools, parallel, tokenizer)


class HermesParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, call_prefix: str = "call") -> dict[str, Any]:
        return parse_reply(text, call_prefix)

    def call_start(self, text: str) -> int | None:
        i = text.find(OPEN)
        return i if i >= 0 else None

    def holdback(self, text: str) -> int:
        return _holdback_marker(text, OPEN)

    def unfinished(self, text: str) -> int:
        closed = text.rfind(CLOSE)
        tail = closed + len(CLOSE) if closed >= 0 else 0
        opened = text.find(OPEN, tail)  # a block opened after the last closed one (a half <tool_call>{... </tool_)
        return opened if opened >= 0 else _holdback_marker(text, OPEN)

    def call_rules(self, tools: list[dict[str, Any]], parallel: bool, tokenizer: Any = None) -> str:
        schema = json.dumps(call_schema(tools))
        call = f'{_literal(OPEN, tokenizer)} "\\n" %json {schema} "\\n" {_literal(CLOSE, tokenizer)}'
        calls = 'calls: call ("\\n" call)*' if parallel else "calls: call"
        return f"{calls}\ncall: {call}\n"


def _json_sequence(text: str, start: int, sep: str) -> tuple[list[Any], int | None]:
    """The JSON values in ``text`` from ``start``, separated by ``sep`` / whitespace, and where decoding stopped: None
    when the values run to the end, else the index of the first one that does not decode (a cut or malformed one)."""
    dec = json.JSONDecoder()
    out, i, n = [], start, len(text)
    while True:
        while i < n and (text[i].isspace() or text[i] == sep):
            i += 1
        if i >= n:
            return out, None
        try:
            value, i_next = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out, i
        out.append(value)
        i = i_next


def _decode_calls(body: str, args_key: str, sep: str) -> list[Any] | None:
    """The JSON values in ``body`` separated by ``sep`` / whitespace, or None when it is not such a sequence."""
    values, stopped = _json_sequence(body, 0, sep)
    return values if stopped is None else None


def _to_calls(objs: list[Any], args_keys: tuple[str, ...], call_prefix: str) -> tuple[list, list]:
    calls, invalid = [], []
    for obj in objs:
        name = obj.get("name") if isinstance(obj, dict) else None
        args = next((obj[k] for k in args_keys if isinstance(obj, dict) and k in obj), {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = None
        if not isinstance(name, str) or not name.strip() or not isinstance(args, dict):
            invalid.append({"text": json.dumps(obj, ensure_ascii=False), "error": "not a {name, arguments} object"})
            continue
        fn = {"name": name.strip(), "arguments": json.dumps(args, ensure_ascii=False)}
        calls.append({"id": f"{call_prefix}_{len(calls)}", "type": "function", "function": fn})
    return calls, invalid


def _message(content: str | None, calls: list, invalid: list) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": (content or "").strip() or None}
    if calls:
        msg["tool_calls"] = calls
    if invalid:
        msg["invalid_tool_calls"] = invalid
    return msg


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def _body(self, text: str) -> str | None:
        s = text.lstrip()
        if s.startswith(self.TAG):
            s = s[len(self.TAG) :].lstrip()
        return s if s.startswith("{") else None

    def parse(self, text: str, call_prefix: str = "call") -> dict[str, Any]:
        body = self._body(text)
        objs = _decode_calls(body, "parameters", ";") if body is not None else None
        if not objs:
            return _message(text, [], [])
        tagged = text.lstrip().startswith(self.TAG)
        if not tagged and not all(isinstance(o, dict) and ("parameters" in o or "arguments" in o) for o in objs):
            # untagged JSON without arguments is an answer (e.g. a response_format's {"name": ..., "age": ...})
            return _message(text, [], [])
        calls, invalid = _to_calls(objs, ("parameters", "arguments"), call_prefix)
        if not calls:
            return _message(text, [], invalid)
        return _message(None, calls, invalid)

    def call_start(self, text: str) -> int | None:
        return 0 if self._body(text) is not None else None

    def holdback(self, text: str) -> int:
        s = text.lstrip()
        if not s or self.TAG.startswith(s) or (s.startswith(self.TAG) and not s[len(self.TAG) :].strip()):
            return 0  # may still become a call
        return len(text) if s[0] != "{" else 0

    def unfinished(self, text: str) -> int:
        body = self._body(text)
        if body is None:  # no call, or cut in or right after the tag
            return len(text) - len(text.lstrip()) if self.holdback(text) == 0 else len(text)
        tagged = text.lstrip().startswith(self.TAG)
        values, stopped = _json_sequence(text, len(text) - len(body), ";")
        if stopped is None:
            return len(text)
        # a half object: a call after a call, or the first one when tagged (cut with its tag); untagged and first, it
        # may be an answer in a response format cut short: content
        if any(isinstance(v, dict) and ("parameters" in v or "arguments" in v) for v in values):
            return stopped
        return len(text) - len(text.lstrip()) if tagged else len(text)

    def call_rules(self, tools: list[dict[str, Any]], parallel: bool, tokenizer: Any = None) -> str:
        call = f"%json {json.dumps(call_schema(tools, 'parameters'))}"
        calls = 'calls: call ("; " call)*' if parallel else "calls: call"
        return f"{calls}\ncall: {call}\n"


class MistralParser(ToolParser):
    """Both Mistral forms (see the module docstring). ``form``: how a forced call is written, ``"list"`` (v3) or
    ``"v11"``; None = from the tokenizer (v11 when it has ``[ARGS]`` as a special token)."""

    name = "mistral"
    MARK = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"
    keep_special_tokens = True
    # v11: name, then optionally [CALL_ID]id, then [ARGS] (absent when special tokens were skipped), then the JSON
    _V11 = re.compile(r"\s*([^\s\[{]+)\s*(?:\[CALL_ID\]\s*([^\s\[{]*)\s*)?(?:\[ARGS\])?", re.DOTALL)

    def __init__(self, form: str | None = None) -> None:
        if form not in (None, "list", "v11"):
            raise UserError(f"mistral tool-call form must be 'list' or 'v11', got {form!r}")
        self.form = form

    def parse(self, text: str, call_prefix: str = "call") -> dict[str, Any]:
        i = text.find(self.MARK)
        if i < 0:
            return _message(text, [], [])
        objs: list[Any] = []
        invalid: list[dict[str, str]] = []
        for seg in text[i + len(self.MARK) :].split(self.MARK):  # one call (v11) or one list (v3) per marker
            found, error = self._segment(seg)
            if found is None:
                invalid.append({"text": self.MARK + seg, "error": error})
            objs.extend(found or [])
        calls, bad = _to_calls(objs, ("arguments", "parameters"), call_prefix)
        for c in calls:  # Mistral's templates refuse other ids when the call comes back in the history
            c["id"] = hashlib.sha256(c["id"].encode()).hexdigest()[:9]
        return _message(text[:i], calls, invalid + bad)

    def _segment(self, seg: str) -> tuple[list[Any] | None, str]:
        """The call objects after one ``[TOOL_CALLS]`` (None and why when they do not parse)."""
        body = seg.strip()
        if body[:1] in ("[", "{"):  # v3: a JSON list of {name, arguments} (or one object)
            values = _decode_calls(body, "arguments", ",")
            if not values:
                return None, "the tool calls are not a JSON array"
            return [o for v in values for o in (v if isinstance(v, list) else [v])], ""
        m = self._V11.match(seg)
        if m is None:
            return None, "a [TOOL_CALLS] without a function name"
        name, rest = m.group(1), seg[m.end() :]
        try:
            args, end = json.JSONDecoder().raw_decode(rest.lstrip())
        except json.JSONDecodeError as exc:
            return None, f"the arguments of {name!r} are not valid JSON ({exc.msg})"
        if rest.lstrip()[end:].strip():
            return None, f"text after the arguments of {name!r}"
        return [{"name": name, "arguments": args}], ""

    def call_start(self, text: str) -> int | None:
        i = text.find(self.MARK)
        return i if i >= 0 else None

    def holdback(self, text: str) -> int:
        return _holdback_marker(text, self.MARK)

    def unfinished(self, text: str) -> int:
        end = _holdback_marker(text, self.MARK)  # a marker begun at the very end
        last = text.rfind(self.MARK, 0, end)
        if last >= 0 and self._segment(text[last + len(self.MARK) : end])[0] is None:
            return last  # the last call (v11) or list (v3) does not parse: cut inside it
        return end

    def _form(self, tokenizer: Any) -> str:
        if self.form is not None:
            return self.form
        return "v11" if _special_id(tokenizer, self.ARGS) is not None else "list"

    def call_rules(self, tools: list[dict[str, Any]], parallel: bool, tokenizer: Any = None) -> str:
        mark = _literal(self.MARK, tokenizer)
        if self._form(tokenizer) == "v11":
            args = _literal(self.ARGS, tokenizer)
            fns = " | ".join(
                f"{json.dumps(_fn(t)['name'])} {args} %json {json.dumps(_styled(_params_schema(t)))}" for t in tools
            )
            calls = "calls: call+" if parallel else "calls: call"
            return f"{calls}\ncall: {mark} fn\nfn: {fns}\n"
        one = call_schema(tools)
        style = one.pop("x-guidance")
        array = {"type": "array", "items": one, "minItems": 1, "x-guidance": style}
        if "$defs" in one:  # the definitions the calls' $refs point at belong at the root
            array["$defs"] = one.pop("$defs")
        if not parallel:
            array["maxItems"] = 1
        return f"calls: {mark} %json {json.dumps(array)}\n"


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def get_parser(name: str) -> ToolParser:
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise UserError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    return cls()


def detect_parser(chat_template: str | None) -> ToolParser:
    """The format a chat template teaches: ``[TOOL_CALLS]`` -> mistral, ``<|python_tag|>`` / ``"parameters"`` with
    ``ipython`` -> llama3_json, anything else (``<tool_call>``, or no tool support: the fallback) -> hermes."""
    t = chat_template or ""
    if MistralParser.MARK in t:
        return MistralParser("v11" if MistralParser.ARGS in t else "list")
    if Llama3JsonParser.TAG in t or ("ipython" in t and "parameters" in t and OPEN not in t):
        return Llama3JsonParser()
    return HermesParser()


def finished_text(parser: ToolParser | None, text: str, reason: str | None) -> str:
    """The reply without the call it left half written when the token limit cut it (``reason`` "length"): that
    part is neither a call (its arguments are not whole) nor content (it is call markup), as with OpenAI. ``parser``
    None: a reply without tools, kept whole."""
    if parser is None or reason != "length":
        return text
    return text[: parser.unfinished(text)]


def finish_reason(reason: str | None, called: bool) -> str | None:
    """The OpenAI ``finish_reason`` of a reply that ended for the engine's ``reason`` (stop, length, abort) and
    ``called`` tools: "length" whenever the token limit cut it, even with whole calls kept (OpenAI's rule, and what
    marks a Responses reply ``incomplete``); "tool_calls" when it called and ended by itself; an aborted one "stop"."""
    finish = "stop" if reason == "abort" else reason
    return "tool_calls" if called and finish == "stop" else finish


class ToolCallStream:
    """Streams one reply: ``feed(text_so_far)`` returns the content delta that is safe to send now (text before any
    tool call, minus what could still begin one); ``finish(text)`` returns ``(content delta, message)``: the rest of
    the content and the parsed message whose ``tool_calls`` are then sent."""

    def __init__(self, parser: ToolParser, call_prefix: str, parallel: bool = True) -> None:
        self.parser, self.call_prefix, self.parallel = parser, call_prefix, parallel
        self.sent = 0  # characters of the text already sent as content
        self.in_call = False

    def feed(self, text: str) -> str:
        if self.in_call:
            return ""
        start = self.parser.call_start(text)
        if start is not None:
            self.in_call = True
            upto = start
        else:
            upto = self.parser.holdback(text)
        upto = max(upto, self.sent)
        delta, self.sent = text[self.sent : upto], upto
        return delta

    def finish(self, text: str) -> tuple[str, dict[str, Any]]:
        msg = self.parser.parse(text, self.call_prefix)
        if not self.parallel and len(msg.get("tool_calls") or []) > 1:
            msg["tool_calls"] = msg["tool_calls"][:1]
        if not msg.get("tool_calls"):
            rest = text[self.sent :]  # no call after all: everything held back is content
            return rest, msg
        start = self.parser.call_start(text)
        tail = self.parser.parse(text[start:], self.call_prefix).get("content") if start is not None else None
        pre = text[self.sent : start] if start is not None and start > self.sent else ""
        return pre + (tail or ""), msg


__all__ = [
    "TOOL_PARSERS",
    "HermesParser",
    "answer_rule",
    "Llama3JsonParser",
    "MistralParser",
    "NoCallGrammar",
    "ToolCallStream",
    "ToolParser",
    "call_schema",
    "detect_parser",
    "finish_reason",
    "finished_text",
    "get_parser",
]
