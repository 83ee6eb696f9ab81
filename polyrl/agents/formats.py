"""Output formats of agentic turns: what each assistant turn of an episode must match, as the grammar the rollout
engine applies (structured outputs, ``polyrl.infer.structured``), so episodes can be constrained as single-turn
rollouts are by ``grpo.rollout_response_format``.

Who declares a turn's format, first match wins:
1. the environment's last ``step`` for the next turn: ``EnvStep.response_format`` (``"text"``: this turn is free);
2. the environment class: ``Environment.response_format`` (every turn);
3. the run: ``--set grpo.rollout_response_format=...`` (every turn of every episode; ``SamplingParams.structured``).
A format is an OpenAI ``response_format`` dict (``{"type": "json_schema", "json_schema": {"name", "schema"}}``,
``{"type": "json_object"}``, ``{"type": "text"}``), a spec string as the run option takes (``json_object``,
``json_schema:{...}``, ``regex:...``, ``choice:a|b``, ``grammar:...``) or a ``StructuredOutputs``.

An environment with tools keeps them under a format: the turn may call a tool (in the chat template's tool-call
syntax, ``ChatRenderer.tool_parser``, the one the rollout parses; arguments constrained to the tools' parameter
schemas) OR answer in the format, the grammar union ``polyrl serve`` uses for ``tool_choice: "auto"`` with a
``response_format`` (``tool_parsers.union_grammar``; one call per turn when the environment sets
``parallel_tool_calls = False``); a whole Lark grammar cannot be combined with tools (ConfigError). The trainer
learns from the engine's unmasked log-probs and reports what the masks removed (``rollout_mask_logmass``), as for
single-turn rollouts.
The agent proxy (``--agent``) applies the same to each call: the request's ``response_format`` (``text.format``),
else the run's, with the request's tools in the session's parser syntax.
Not here: the episode loop (``rollout``), compiling grammars (``polyrl.infer.structured``).
"""

from __future__ import annotations

import json
from typing import Any

from polyrl.agents.tool_parsers import HermesParser, NoCallGrammar, ToolParser, answer_rule
from polyrl.errors import ConfigError, UserError
from polyrl.infer.sampling_params import StructuredOutputs

TEXT = "text"  # a declared free turn (overrides the formats below it)


def to_format(value: Any, where: str) -> StructuredOutputs | str | None:
    """``value`` (see the module docstring) as a ``StructuredOutputs``, ``TEXT`` or None (nothing declared); a
    ConfigError naming ``where`` for anything else."""
    if value is None or isinstance(value, StructuredOutputs):
        return value
    if isinstance(value, str):
        if value.strip() == TEXT:
            return TEXT
        try:
            return StructuredOutputs.from_spec(value) or TEXT
        except UserError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a response_format dict or a spec string, got {type(value).__name__}")
    kind = value.get("type")
    if kind == TEXT:
        return TEXT
    if kind == "json_object":
        return StructuredOutputs("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema", value)
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: the JSON schema is not valid JSON ({exc.msg})") from None
        if not isinstance(schema, dict):
            raise ConfigError(f'{where}: type "json_schema" needs {{"json_schema": {{"schema": {{...}}}}}}')
        return StructuredOutputs.json_schema(schema)
    raise ConfigError(f"{where}: type {kind!r} is not one of text, json_object, json_schema")


def pick(*declared: StructuredOutputs | str | None) -> StructuredOutputs | None:
    """The first declared format (``TEXT``: free), or None when none is."""
    for fmt in declared:
        if fmt is not None:
            return None if fmt == TEXT else fmt
    return None


def turn_grammar(
    fmt: StructuredOutputs | None,
    tools: list[dict[str, Any]],
    tokenizer: Any,
    parallel: bool = True,
    parser: ToolParser | None = None,
) -> StructuredOutputs | None:
    """The grammar of a turn with format ``fmt``: ``fmt`` itself, or with ``tools`` a call of them (several when
    ``parallel``; in ``parser``'s syntax, Hermes by default; ``rollout`` passes the template's) OR ``fmt``."""
    if fmt is None or not tools:
        return fmt
    parser = parser or HermesParser()
    try:
        return StructuredOutputs("lark", parser.union_grammar(tools, parallel, answer_rule(fmt), tokenizer))
    except NoCallGrammar as exc:
        raise ConfigError(f"a format with tools: {exc}") from None


__all__ = ["TEXT", "pick", "to_format", "turn_grammar"]
