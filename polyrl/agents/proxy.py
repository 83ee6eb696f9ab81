"""Proxy mode's bookkeeping: an agent program (any framework, written against the ``openai`` client) runs its own
loop against polyrl's endpoint; every call it makes is recorded here with the exact token ids and log-probs the
engine sampled, and turned into ``Episode`` s to train on.

``AgentSession`` (one episode, one id in the URL ``.../agents/<id>/v1``):
- ``prompt_for(messages, tools)``: the prompt ids of a call. When the messages are the previous call's messages +
  the reply polyrl returned + new non-assistant messages (the usual agent loop), the prompt is the previous call's
  prompt + its sampled ids (+ eos if it was cut) + the template delta of the new messages (``ChatRenderer``): no
  re-tokenisation of earlier turns, and the prefix cache serves them. Otherwise (the agent rewrote its history) the
  conversation is rendered in full and a new *segment* starts.
- ``record(messages, tools, prompt_ids, continues, token_ids, logprobs, text, masked_logmass, versions)``: appends
  the call to its segment (with partial rollouts, ``versions``: each sampled token's policy version) and returns
  the OpenAI assistant message (``content`` and ``tool_calls``, parsed by the template's family parser from
  ``tool_parsers``, the one ``polyrl serve`` uses).
- ``episodes()``: one ``Episode`` per segment (sampled ids masked 1 with their log-probs, template and tool/user
  tokens masked 0), each with the session's reward (given by ``set_reward``: an HTTP call or the agent function's
  return value); the segments of one session share its ``(group, index)``, so a caller that counts agent runs
  (the evaluation) merges them (``polyrl.agents.train.episode_totals``).
Not here: HTTP (``polyrl.server.agent_proxy``), running agent programs, training.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from polyrl.agents.episode import Episode
from polyrl.agents.tool_parsers import detect_parser


def _norm_calls(calls: Any) -> list[tuple[str, Any]]:
    out = []
    for c in calls or []:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        args = fn.get("arguments", "")
        try:
            args = json.loads(args) if isinstance(args, str) and args.strip() else args
        except json.JSONDecodeError:
            pass
        out.append((fn.get("name"), args))
    return out


def _norm(m: dict[str, Any]) -> tuple:
    """What identifies a message for prefix matching (content None == "", tool calls by name and arguments)."""
    content = m.get("content")
    if isinstance(content, list):  # text parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return (m.get("role"), content or "", _norm_calls(m.get("tool_calls")), m.get("tool_call_id"))


class AgentSession:
    """The recorded calls of one proxy-mode episode (see the module docstring). Thread-safe."""

    def __init__(self, eid: str, renderer: Any, eos_ids: frozenset[int] | set[int], group: int = 0, index: int = 0):
        self.eid, self.renderer, self.eos_ids = eid, renderer, frozenset(eos_ids)
        self.group, self.index = group, index
        self.segments: list[Episode] = []
        self.reward: float | None = None
        self.num_calls = 0
        self.failed: str | None = None
        self._last_messages: list[tuple] | None = None  # normalised messages of the last call + its reply
        # the model family's tool-call format, as polyrl serve parses it (tool_parsers; hermes for the fallback)
        self.parser = getattr(renderer, "tool_parser", None) or detect_parser(getattr(renderer, "template", None))
        self._lock = threading.Lock()

    def prompt_for(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> tuple[list[int], bool]:
        """``(prompt ids, continues)``: ``continues`` when the call extends the current segment (see the docstring)."""
        norm = [_norm(m) for m in messages]
        with self._lock:
            last = self._last_messages
            seg = self.segments[-1] if self.segments else None
            extends = (
                seg is not None
                and last is not None
                and len(norm) > len(last)
                and norm[: len(last)] == last
                and all(m.get("role") != "assistant" for m in messages[len(last) :])
            )
            if not extends:
                return self.renderer.prompt_ids(messages, tools), False
            new = messages[len(last) :]
            tail = [] if seg.ids and seg.ids[-1] in self.eos_ids else [self.renderer.eos_id]
            return seg.context + tail + self.renderer.observation_ids(new), True

    def record(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        prompt_ids: list[int],
        continues: bool,
        token_ids: list[int],
        logprobs: list[float],
        text: str,
        masked_logmass: float | None = None,
        versions: list[int] | None = None,
    ) -> dict[str, Any]:
        """Append one call (its prompt from ``prompt_for``) and return the reply as an OpenAI assistant message.
        ``masked_logmass``: what an output format's masks removed from this call's tokens (None: unconstrained).
        ``versions`` (partial rollouts): the policy version of each sampled token (``Episode.add_turn``)."""
        with self._lock:
            self.num_calls += 1
            reply = self.parser.parse(text, f"call_{self.num_calls}")
            seg = self.segments[-1] if self.segments else None
            # a concurrent call of the same episode may have grown the segment since prompt_for: then start anew
            continues = continues and seg is not None and prompt_ids[: len(seg.context)] == seg.context
            if continues:
                seg.add_observation(prompt_ids[len(seg.context) :])
            else:
                seg = Episode(self.group, self.index, prompt_ids=list(prompt_ids), tools=list(tools or []))
                seg.messages = [dict(m) for m in messages]
                self.segments.append(seg)
            if continues:
                seg.messages.extend(dict(m) for m in messages[len(self._last_messages or []) :])
            seg.add_turn(token_ids, logprobs, versions)
            seg.count("turns")
            if masked_logmass is not None:
                seg.masked_logmass = (seg.masked_logmass or 0.0) + masked_logmass
                seg.count("constrained_turns")
            seg.count("tool_calls", len(reply.get("tool_calls", [])))
            seg.count("invalid_tool_calls", len(reply.get("invalid_tool_calls", [])))
            seg.messages.append(reply)
            self._last_messages = [_norm(m) for m in messages] + [_norm(reply)]
            return reply

    def set_reward(self, reward: float) -> None:
        self.reward = float(reward)

    def episodes(self, failure_reward: float = 0.0, keep_empty: bool = False) -> list[Episode]:
        """One finished ``Episode`` per segment, each with the episode's reward (``failure_reward`` when the agent
        failed or gave none). ``keep_empty``: an agent run that made no call still gives one ``Episode``, without
        turns (untrainable, as an environment episode whose reset failed), carrying that reward."""
        reward = self.reward if self.reward is not None and self.failed is None else failure_reward
        segments = list(self.segments)
        if not segments and keep_empty:
            segments = [Episode(self.group, self.index)]
        for seg in segments:
            seg.reward = reward
            if self.failed is not None:
                seg.end("env_error", self.failed)
            else:
                seg.end("done")
        return segments


__all__ = ["AgentSession"]
