"""Tokenise conversations through the tokenizer's chat template, with loss masks on assistant tokens.

Assistant spans are found by rendering the conversation prefix by prefix: for assistant turn i the span starts
where ``render(messages[:i], add_generation_prompt=True)`` ends and stops where ``render(messages[:i+1])`` ends.
Each prefix's tokens must be a prefix of the whole conversation's tokens; a template that breaks this (for example
one that rewrites earlier turns depending on what follows) is reported as a ConfigError rather than silently
producing wrong masks. A row's tool definitions (OpenAI ``tools``) are passed to every render, so they sit in the
prompt and are never trained on; a template that does not write them refuses the row. The same holds for RL prompts
(``encode_prompt``) and preference pairs. Without a chat template a single user -> assistant exchange is plain
concatenation + eos (a row with tools is refused).
Truncation and packing are elsewhere (``dataset.py``, ``packing.py``).
"""

from __future__ import annotations

from typing import Any

from polyrl.data.examples import Message, PreferenceExample, TokenizedSeq
from polyrl.data.formats import RowError
from polyrl.errors import ConfigError

LOSS_POLICIES = ("assistant", "last_assistant", "all")
NO_TEMPLATE_TOOLS = "the row has tools, which need a chat template that renders them; set data.chat_template"


class ChatTokenizer:
    """Wraps a transformers tokenizer (``tokenizer``) and an optional template override (``chat_template``)."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None, loss_on: str = "assistant"):
        if loss_on not in LOSS_POLICIES:
            raise ConfigError(f"loss_on={loss_on!r} is not one of {', '.join(LOSS_POLICIES)}")
        self.tokenizer = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None) or None
        self.loss_on = loss_on
        # Jinja text that never names tool_calls drops them: such rows are refused rather than trained empty
        self.renders_tool_calls = "tool_calls" in (self.template or "")

    # -- primitives -------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def render(self, messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        extra = {"tools": tools} if tools else {}
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=self.template,
                **extra,
            )
        except Exception as exc:  # jinja raises TemplateError and friends for conversations it refuses
            raise RowError(f"the chat template rejected this conversation ({type(exc).__name__}: {exc})") from None

    @property
    def eos_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None)

    # -- conversations ----------------------------------------------------------------------------------------
    def tokenize_messages(
        self, messages: list[Message], loss_from: int = 0, tools: list[dict] | None = None
    ) -> TokenizedSeq:
        """Tokens and loss mask of ``messages``; only assistant turns at index >= ``loss_from`` are trained.
        ``tools`` (OpenAI tool definitions) are rendered by the template into the prompt."""
        out = self.tokenize_many([messages], loss_from, [tools])[0]
        if isinstance(out, RowError):
            raise out
        return out

    def tokenize_many(
        self,
        conversations: list[list[Message]],
        loss_from: int | list[int] = 0,
        tools: list[list[dict] | None] | None = None,
    ) -> list[TokenizedSeq | RowError]:
        """``tokenize_messages`` of each conversation (``loss_from``: one for all, or one per conversation), with
        every rendered text encoded in ONE tokenizer call (the fast tokenizer encodes a list in parallel, as it
        encodes each text alone: the same ids). A conversation the template rejects comes back as its
        ``RowError``, in its place; a template that is not prefix-consistent raises ``ConfigError`` as
        ``tokenize_messages`` does. ``tools``: each conversation's tool definitions (None: none)."""
        starts = loss_from if isinstance(loss_from, list) else [loss_from] * len(conversations)
        row_tools = tools if tools is not None else [None] * len(conversations)
        if self.template is None:
            rows = zip(conversations, starts, row_tools)
            return [self._row(lambda m=m, k=k, t=t: self._plain(m, self._turns(m, k), t)) for m, k, t in rows]
        plans: list[tuple[list[Message], list[int], int, list[tuple[int, int | None, int | None]]] | RowError] = []
        texts: list[str] = []
        for messages, start, tools_ in zip(conversations, starts, row_tools):
            turns = self._turns(messages, start)
            try:
                plan = self._render_plan(messages, turns, len(texts), texts, tools_)
            except RowError as exc:
                plans.append(exc)
                continue
            plans.append((messages, turns, *plan))
        ids = self._encode_many(texts)
        return [p if isinstance(p, RowError) else self._assemble(ids, *p[2:]) for p in plans]

    def _turns(self, messages: list[Message], loss_from: int) -> list[int]:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= loss_from]
        return turns[-1:] if self.loss_on == "last_assistant" else turns

    @staticmethod
    def _row(fn) -> TokenizedSeq | RowError:
        try:
            return fn()
        except RowError as exc:
            return exc

    def _render_plan(
        self, messages: list[Message], turns: list[int], base: int, texts: list[str], tools: list[dict] | None = None
    ) -> tuple[int, list[tuple[int, int | None, int | None]]]:
        """Appends the texts a conversation needs to ``texts`` (the whole conversation first, then per trained
        assistant turn i the prefix up to its generation prompt and, unless it is the last message, the prefix
        through it) and returns (index of the whole text, [(turn, prefix index, end index)]); None = no text (an
        empty prefix has no tokens; the last turn ends where the whole conversation ends)."""
        if not self.renders_tool_calls and any(m.get("tool_calls") for m in messages):
            raise RowError(
                "an assistant message has tool_calls, which the chat template does not render (they would be "
                "trained as an empty turn); set data.chat_template to a template that renders tool_calls (the model's "
                "own, e.g. Qwen2.5's), or write the calls into the message content"
            )
        local = [self.render(messages, add_generation_prompt=False, tools=tools)]
        if tools:
            self._check_tools_rendered(messages, tools, local[0], add_generation_prompt=False)
        parts: list[tuple[int, int | None, int | None]] = []
        if self.loss_on != "all":
            for i in turns:
                start = end = None
                if messages[:i]:
                    local.append(self.render(messages[:i], add_generation_prompt=True, tools=tools))
                    start = base + len(local) - 1
                if i + 1 != len(messages):
                    local.append(self.render(messages[: i + 1], add_generation_prompt=False, tools=tools))
                    end = base + len(local) - 1
                parts.append((i, start, end))
        texts.extend(local)
        return base, parts

    def _check_tools_rendered(
        self, messages: list[Message], tools: list[dict], text: str, add_generation_prompt: bool
    ) -> None:
        """A template that ignores ``tools`` or leaves a tool's name out would train tool calls against tools the
        model never saw: the row is refused. A name counts as rendered when ``text`` (rendered with tools and
        ``add_generation_prompt``) holds it more often than the text rendered without tools (where it may appear in
        the conversation's own calls)."""
        bare = self.render(messages, add_generation_prompt=add_generation_prompt)
        names = [t["function"]["name"] for t in tools]
        missing = [n for n in names if text.count(n) <= bare.count(n)]
        if missing:
            what = ", ".join(map(repr, missing))
            raise RowError(
                f"the row has tools, but the chat template does not render them (no definition of {what} in the "
                "rendered text; "
                "the model would never see the tools it is trained to call); set data.chat_template to a template "
                "that renders tools (the model's own, e.g. Qwen2.5's), or describe the tools in a system message"
            )

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(x) for x in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _assemble(
        self, ids: list[list[int]], full_at: int, parts: list[tuple[int, int | None, int | None]]
    ) -> TokenizedSeq:
        full = ids[full_at]
        if self.loss_on == "all":
            return TokenizedSeq(full, [1] * len(full))
        mask = [0] * len(full)
        for turn, start_at, end_at in parts:
            start = 0 if start_at is None else self._prefix_len(ids[start_at], True, full, turn)
            end = len(full) if end_at is None else self._prefix_len(ids[end_at], False, full, turn)
            for t in range(start, end):
                mask[t] = 1
        return TokenizedSeq(full, mask)

    def _prefix_len(self, part: list[int], gen: bool, full: list[int], turn: int) -> int:
        if full[: len(part)] != part:
            where = "the generation prompt before" if gen else "the end of"
            raise ConfigError(
                f"the chat template does not render conversations prefix-consistently: the tokens up to {where} "
                f"assistant turn {turn + 1} are not a prefix of the whole conversation's tokens, so assistant "
                "spans cannot be masked reliably; use loss_on='last_assistant', or set data.chat_template to a "
                "template that renders earlier turns the same whatever follows"
            )
        return len(part)

    def _plain(self, messages: list[Message], turns: list[int], tools: list[dict] | None = None) -> TokenizedSeq:
        roles = [m["role"] for m in messages]
        if any(m.get("tool_calls") for m in messages):
            raise RowError("an assistant message has tool_calls, which need a chat template; set data.chat_template")
        if tools:
            raise RowError(NO_TEMPLATE_TOOLS)
        if roles not in (["user", "assistant"], ["system", "user", "assistant"]):
            raise ConfigError(
                "the tokenizer has no chat template, so only single user -> assistant rows can be tokenised; "
                "set data.chat_template (a Jinja template) or use a tokenizer that has one"
            )
        prompt = "\n\n".join(m["content"] for m in messages[:-1])
        prompt_ids = self.encode(prompt, add_special_tokens=True)
        answer_ids = self.encode(messages[-1]["content"])
        if self.eos_id is not None:
            answer_ids.append(int(self.eos_id))
        trained = self.loss_on == "all" or bool(turns)
        mask = [int(self.loss_on == "all")] * len(prompt_ids) + [int(trained)] * len(answer_ids)
        return TokenizedSeq(prompt_ids + answer_ids, mask)

    def tokenize_preference(self, ex: PreferenceExample) -> tuple[TokenizedSeq, TokenizedSeq]:
        """(chosen, rejected) sequences, each prompt + continuation, loss on the continuation's assistant turns;
        the pair's tools are rendered into both prompts."""
        n, tools = len(ex.prompt), ex.tools
        chosen = self.tokenize_messages(ex.prompt + ex.chosen, n, tools)
        return chosen, self.tokenize_messages(ex.prompt + ex.rejected, n, tools)

    def encode_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """Token ids to generate from: the template with the generation prompt, else the plain text. ``tools`` (a
        prompt row's tool definitions) are rendered by the template; RowError when it does not render them, or
        when there is no template (as for SFT rows)."""
        if self.template is not None:
            text = self.render(messages, add_generation_prompt=True, tools=tools)
            if tools:
                self._check_tools_rendered(messages, tools, text, add_generation_prompt=True)
            return self.encode(text)
        if tools:
            raise RowError(NO_TEMPLATE_TOOLS)
        return self.encode("\n\n".join(m["content"] for m in messages), add_special_tokens=True)
