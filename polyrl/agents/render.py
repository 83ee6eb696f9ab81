"""Conversations to token ids through the model's chat template, as an opening prompt and as per-turn deltas.

``ChatRenderer(tokenizer)``:
- ``prompt_ids(messages, tools)``: the opening messages (from ``Environment.reset``) with the generation prompt.
- ``observation_ids(messages)``: the ids to append after an assistant turn that ended with the end-of-turn token
  (EOS) the engine sampled: whatever the template writes after that token (ChatML: a newline), the observation
  messages, and the next generation prompt. Found once per message shape by rendering a fixed two-message
  conversation with and without the observation and taking the text difference, so earlier turns are NEVER
  re-rendered or re-tokenised: an episode's ids are the sampled ids plus these deltas, exactly.
Templates without tool support (no ``tools`` / ``tool_calls`` in the Jinja text, e.g. the tiny presets' ChatML) get
a compact tools block in the system message and assistant ``tool_calls`` written as ``<tool_call>`` text; the
``tool`` role is rendered as whatever the template does with roles. ``prepare_messages`` is that conversion, shared
with ``polyrl serve`` (``polyrl.server.chat``). A template that renders a prefix differently
depending on what follows is a ConfigError. ``tool_parser``: the template's tool-call syntax
(``tool_parsers.detect_parser``: Mistral ``[TOOL_CALLS]``, Llama 3 JSON, else Hermes ``<tool_call>``), the one
that episodes, the agent proxy and ``polyrl serve`` parse replies with and constrain calls to. Not here: sampling,
parsing replies (``tool_parsers``).
"""

from __future__ import annotations

import json
from typing import Any

from polyrl.agents.tool_parsers import ToolParser, detect_parser
from polyrl.agents.tools import assistant_text, tools_system_text
from polyrl.errors import ConfigError

_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def template_supports(template: str | None) -> tuple[bool, bool]:
    """(renders a ``tools`` list, renders assistant ``tool_calls``) for a chat template's Jinja text."""
    t = template or ""
    return "tools" in t, "tool_calls" in t


def _arguments_as_dict(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call whose ``function.arguments`` JSON string is decoded to a dict, as native templates expect
    (Qwen2.5's ``tool_call.arguments | tojson`` would otherwise encode the string twice)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


def prepare_messages(
    messages: list[dict[str, Any]], tools: list[dict] | None, template: str | None
) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """(messages as ``template`` can render them, the ``tools`` argument to pass it or None). One implementation for
    the server and the agent proxy: a template without tool support gets the tools described in the system message
    (``tools_system_text``) and assistant ``tool_calls`` written as ``<tool_call>`` text; a native one gets ``tools``
    and ``tool_calls`` with decoded arguments. ``None`` content becomes ""."""
    native_tools, native_calls = template_supports(template)
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "invalid_tool_calls"}
        if m.get("role") == "assistant" and m.get("tool_calls"):
            if native_calls:
                m["tool_calls"] = [_arguments_as_dict(c) for c in m["tool_calls"]]
            else:
                m = {"role": "assistant", "content": assistant_text(m)}
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if tools and not native_tools:
        block = tools_system_text(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, (tools if tools and native_tools else None)


class ChatRenderer:
    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise ConfigError("agentic RL needs a chat template; use a chat model or set data.chat_template")
        self.native_tools, self.native_calls = template_supports(self.template)
        self.tool_parser: ToolParser = detect_parser(self.template)
        self.eos_text = getattr(tokenizer, "eos_token", None)
        if not self.eos_text:
            raise ConfigError("agentic RL needs a tokenizer with an eos (end-of-turn) token")
        base = self.render(_BASE, None, False)
        cut = base.rfind(self.eos_text)
        if cut < 0:
            raise ConfigError(f"the chat template does not end assistant turns with {self.eos_text!r} (eos)")
        self.after_eos = base[cut + len(self.eos_text) :]  # what the template writes after a turn's eos
        self.eos_id = int(tokenizer.convert_tokens_to_ids(self.eos_text))
        self._base_text = base

    # ---- text ---------------------------------------------------------------------------------------
    def template_messages(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[dict[str, Any]]:
        """``messages`` as this template can render them (tool calls as text, tools in the system prompt)."""
        return prepare_messages(messages, tools, self.template)[0]

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None, generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"tools": tools} if tools and self.native_tools else {}
        try:
            return self.tokenizer.apply_chat_template(
                self.template_messages(messages, tools),
                tokenize=False,
                add_generation_prompt=generation_prompt,
                chat_template=self.template,
                **kwargs,
            )
        except Exception as exc:  # jinja: the template refused these messages
            raise ConfigError(f"the chat template rejected the messages ({type(exc).__name__}: {exc})") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ---- ids ----------------------------------------------------------------------------------------
    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        """The opening prompt: ``messages`` rendered with the generation prompt."""
        return self.encode(self.render(messages, tools, True))

    def observation_text(self, messages: list[dict[str, Any]]) -> str:
        """The text that follows an assistant turn's eos: the template's tail, ``messages``, the next prompt."""
        full = self.render(_BASE + list(messages), None, True)
        if not full.startswith(self._base_text):
            raise ConfigError(
                "the chat template renders earlier turns differently once a new message follows, so observations "
                "cannot be appended as deltas; set data.chat_template to a prefix-consistent template"
            )
        return self.after_eos + full[len(self._base_text) :]

    def observation_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.observation_text(messages))


__all__ = ["ChatRenderer", "prepare_messages", "template_supports"]
