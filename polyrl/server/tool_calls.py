"""Tools and structured outputs of a request: checked into a ``ToolPlan`` (what to render, how to parse, which
grammar constrains the output), or an OpenAI-shaped 400 naming the field.

- ``tools``: ``[{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]``; names
  unique, ``[A-Za-z0-9_-]{1,64}`` as OpenAI requires; other tool types are a 400.
- ``tool_choice``: ``"none"`` (tools are not rendered, nothing is parsed), ``"auto"`` (the default with tools:
  rendered, sampled freely, parsed), ``"required"`` (the output is constrained to one or more calls of the tools,
  each call's arguments to its ``parameters`` schema), ``{"type": "function", "function": {"name"}}`` (constrained
  to calls of that tool). ``parallel_tool_calls: false``: at most one call (constrained, or the first one parsed).
- Structured outputs (one of): ``response_format`` ``{"type": "json_object"}`` / ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` (chat only; ``strict`` or not, the schema is enforced), and vLLM's
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` or ``structured_outputs`` ``{json,
  regex, choice, grammar, json_object}``. While a tool call is forced, its grammar replaces the structured output
  (which shapes text, and a forced reply has none): OpenAI accepts both together, and agents send both.
  With ``tool_choice: "auto"`` (the default with tools) the reply may call a tool OR answer in the format: the grammar
  is the union of the parser's call syntax (its tools' parameter schemas) and the format (``union_grammar``); a JSON
  schema, json_object, regex or choice can be combined, a whole grammar cannot (400, as is a parser that cannot
  write its call syntax as a grammar).
Compilation happens in the engine (``polyrl.infer.structured``, cached per schema); ``compile_plan`` compiles the
plan's grammar first and makes its error a 400 naming the field that asked for it, or the tool
(``tools.N.function.parameters``) whose schema, inside a call grammar, does not compile on its own. Not here:
parsing replies (``polyrl.agents.tool_parsers``), HTTP.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from polyrl.agents.tool_parsers import NoCallGrammar, ToolParser, answer_rule, detect_parser, get_parser
from polyrl.errors import UserError
from polyrl.infer.sampling_params import StructuredOutputs
from polyrl.server.api_errors import bad_request

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]] | None  # rendered into the prompt (None: no tools, or tool_choice none)
    parser: ToolParser | None  # parses the reply into tool_calls (None: plain content)
    parallel: bool
    structured: StructuredOutputs | None  # the grammar the output must match
    param: str | None = None  # the request field that asked for it (named in a 400 when it does not compile)


def check_tools(tools: list[Any] | None, param: str = "tools") -> list[dict[str, Any]] | None:
    """The request's tools in the chat-completions shape, or a 400 naming the bad entry."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request(f"{param} must be a list of function tools", param, "invalid_value")
    out, names = [], set()
    for i, t in enumerate(tools):
        where = f"{param}.{i}"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise bad_request(
                f"{where}: only function tools are supported (type 'function'), got {kind!r}", where, "unsupported"
            )
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function must be an object with a name", f"{where}.function", "invalid_value")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(
                f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}",
                f"{where}.function.name",
                "invalid_value",
            )
        if name in names:
            raise bad_request(f"{where}: two tools are named {name!r}", f"{where}.function.name", "invalid_value")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise bad_request(
                f"{where}.function.parameters must be a JSON schema of type 'object'",
                f"{where}.function.parameters",
                "invalid_value",
            )
        out.append({"type": "function", "function": fn})
    return out or None


def _choice(tool_choice: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """(mode, forced tool name): mode none / auto / required / named."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice", "invalid_value")
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function") if isinstance(tool_choice.get("function"), dict) else tool_choice
        name = fn.get("name")
        known = [t["function"]["name"] for t in tools or []]
        if not isinstance(name, str):
            raise bad_request(
                'tool_choice {"type": "function"} needs the function\'s name: {"type": "function", "function": '
                f'{{"name": ...}}}} (one of: {", ".join(known) or "no tools given"})',
                "tool_choice.function.name",
                "invalid_value",
            )
        if name not in known:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not among the tools ({', '.join(known) or 'none'})",
                "tool_choice",
                "invalid_value",
            )
        return "named", name
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
        "invalid_value",
    )


def _schema_text(schema: Any, param: str) -> dict[str, Any]:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc.msg}", param, "invalid_value") from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema object", param, "invalid_value")
    return schema


def response_format_output(fmt: dict[str, Any] | None, param: str = "response_format") -> StructuredOutputs | None:
    """``response_format`` (chat) or ``text.format`` (Responses, flattened) as a grammar, or None for text."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind is None:
        raise bad_request(
            f"{param}.type is required: text, json_object or json_schema", f"{param}.type", "invalid_value"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs("json_object")
    if kind == "json_schema":
        nested = "json_schema" in fmt  # chat nests it; Responses' text.format is flat
        spec, where = (fmt["json_schema"], f"{param}.json_schema") if nested else (fmt, param)
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request(f"{where}.schema is required for type 'json_schema'", where, "invalid_value")
        return StructuredOutputs.json_schema(_schema_text(spec["schema"], f"{where}.schema"))
    raise bad_request(
        f"{param} type {kind!r} is not supported; use text, json_object or json_schema", f"{param}.type", "unsupported"
    )


def extra_structured(req: Any) -> tuple[StructuredOutputs | None, str | None]:
    """(vLLM's ``guided_*`` fields or its ``structured_outputs`` object as a grammar (at most one given), its field)."""
    found: list[tuple[str, StructuredOutputs]] = []
    so = getattr(req, "structured_outputs", None)
    if so:
        keys = [k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) not in (None, False)]
        if len(keys) != 1:
            raise bad_request(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object",
                "structured_outputs",
                "invalid_value",
            )
        k = keys[0]
        found.append((f"structured_outputs.{k}", _from_field(k, so[k], f"structured_outputs.{k}")))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
        value = getattr(req, field, None)
        if value is not None:
            found.append((field, _from_field(kind, value, field)))
    if getattr(req, "guided_grammar", None) is not None:
        found.append(("guided_grammar", _from_field("grammar", req.guided_grammar, "guided_grammar")))
    if len(found) > 1:
        names = ", ".join(f for f, _ in found)
        raise bad_request(f"give one structured output, not several ({names})", found[1][0], "invalid_value")
    return (found[0][1], found[0][0]) if found else (None, None)


def _from_field(kind: str, value: Any, param: str) -> StructuredOutputs:
    try:
        if kind == "json":
            return StructuredOutputs.json_schema(_schema_text(value, param))
        if kind == "json_object":
            return StructuredOutputs("json_object")
        if kind == "choice":
            if not isinstance(value, list):
                raise UserError(f"{param} must be a list of strings")
            return StructuredOutputs.choice(value)
        if not isinstance(value, str) or not value:
            raise UserError(f"{param} must be a non-empty string")
        return StructuredOutputs(kind, value)
    except UserError as exc:
        raise bad_request(f"{param}: {exc}", param, "invalid_value") from None


def plan_tools(
    req: Any,
    server_parser: str | None,
    template: str | None,
    tokenizer: Any,
    response_format: Any = None,
    format_param: str = "response_format",
) -> ToolPlan:
    """Everything the request asks about tools and output structure (see the module docstring)."""
    tools = check_tools(getattr(req, "tools", None))
    mode, name = _choice(getattr(req, "tool_choice", None), tools)
    parallel = getattr(req, "parallel_tool_calls", None) is not False
    structured = response_format_output(response_format, format_param) if response_format is not None else None
    param = format_param if structured is not None else None
    extra, extra_param = extra_structured(req)
    if structured is not None and extra is not None:
        raise bad_request(
            f"give either {format_param} or a vLLM structured-output field, not both", extra_param, "invalid_value"
        )
    if extra is not None:
        structured, param = extra, extra_param
    if mode == "none":
        return ToolPlan(None, None, parallel, structured, param)
    parser = get_parser(server_parser) if server_parser else detect_parser(template)
    if mode in ("required", "named"):
        # A forced call's grammar replaces any response_format: that one shapes text, and a forced reply has none
        # (OpenAI accepts both together; the openai-agents SDK sends both when an agent has an output_type).
        forced = tools if mode == "required" else [t for t in tools if t["function"]["name"] == name]
        try:
            structured = StructuredOutputs("lark", parser.grammar(forced, parallel and mode == "required", tokenizer))
        except NoCallGrammar as exc:
            raise bad_request(f"tool_choice {mode}: {exc}", "tool_choice", "unsupported") from None
        param = "tool_choice"
    elif structured is not None:
        structured = call_or_answer(parser, tools, parallel, structured, tokenizer, param)
    return ToolPlan(tools, parser, parallel, structured, param)


def call_or_answer(
    parser: ToolParser, tools: list[dict[str, Any]], parallel: bool, fmt: StructuredOutputs, tokenizer: Any, param: str
) -> StructuredOutputs:
    """``tool_choice: "auto"`` with a structured output: calls of ``tools`` in the parser's syntax, or ``fmt``. A
    format that cannot be nested is a 400 naming ``param``; a parser that cannot write its calls, naming tool_choice."""
    try:
        answer = answer_rule(fmt)
    except NoCallGrammar as exc:
        raise bad_request(f'{param} with tools and tool_choice "auto": {exc}', param, "unsupported") from None
    try:
        return StructuredOutputs("lark", parser.union_grammar(tools, parallel, answer, tokenizer))
    except NoCallGrammar as exc:
        raise bad_request(
            f'tool_choice "auto" with {param}: {exc}; send tool_choice "none" (the format only) or "required" (a call)',
            "tool_choice",
            "unsupported",
        ) from None


class _NoGrammarCache(Exception):
    """The engine cannot compile any grammar (llguidance missing, a slow tokenizer): not the request's schema."""


def _compile(llm: Any, structured: StructuredOutputs) -> None:
    """Compile ``structured`` in the engine's grammar cache, made here on first use (prep pool: building llguidance's
    index of the vocabulary takes a second or more, which the event loop must not wait for)."""
    try:
        cache = llm.grammar_cache()
    except UserError as exc:
        raise _NoGrammarCache(str(exc)) from None
    cache.matcher(structured)


async def compile_plan(state: Any, plan: ToolPlan) -> None:
    """Compile the plan's grammar now (in the prep pool; cached in the engine, so the request's sequences reuse it),
    so a grammar llguidance refuses is a 400 naming the field that gave it (as is an engine that cannot compile
    grammars at all)."""
    if plan.structured is None:
        return
    try:
        await state.prep(_compile, state.llm, plan.structured)
    except _NoGrammarCache as exc:
        raise bad_request(f"{plan.param}: {exc}", plan.param, "unsupported") from None
    except UserError as exc:
        if plan.structured.kind == "lark" and plan.tools:  # a call grammar: a tool's schema is the likely culprit
            await _name_bad_tool(state, plan.tools)
        raise bad_request(f"{plan.param}: {exc}", plan.param, "invalid_value") from None


async def _name_bad_tool(state: Any, tools: list[dict[str, Any]]) -> None:
    """400 naming the first tool whose ``parameters`` schema does not compile on its own (the call grammar embeds
    each one, and its error quotes the whole grammar and names tool_choice or the response format)."""
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if fn.get("parameters") is None:
            continue
        try:
            await state.prep(_compile, state.llm, StructuredOutputs.json_schema(fn["parameters"]))
        except UserError as exc:
            where = f"tools.{i}.function.parameters"
            raise bad_request(
                f"{where} (function {fn['name']!r}) is not a JSON schema polyrl can enforce: {exc}",
                where,
                "invalid_value",
            ) from None


__all__ = [
    "ToolPlan",
    "call_or_answer",
    "check_tools",
    "compile_plan",
    "extra_structured",
    "plan_tools",
    "response_format_output",
]
