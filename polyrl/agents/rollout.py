"""Many episodes at once on the rollout engine: each turn of each live episode is one engine request, so turns of
different episodes batch together (continuous batching across turns and episodes), and a turn's prompt is exactly
the episode's ids so far, so the prefix cache serves the conversation already computed.

``run_episodes(llm, pool, renderer, examples, n, sampling, seeds, limits, failure_reward)``:
1. ``pool.reset`` every episode (``n`` per example); the opening messages -> ``renderer.prompt_ids`` (with tools).
2. Every live episode adds a request: prompt = ``episode.context`` (never re-tokenised), ``max_tokens`` = the
   smaller of ``limits.max_new_tokens`` and what is left of ``limits.max_episode_tokens``, seed =
   ``turn_seed(seeds[group], index, turn)`` (reproducible whatever else is in the batch: exact resume).
3. Engine steps; each finished turn appends the sampled ids and log-probs (mask 1), parses the reply with the
   template's tool-call parser (``renderer.tool_parser``: Hermes ``<tool_call>``, Llama 3 JSON or Mistral
   ``[TOOL_CALLS]``, as ``polyrl serve`` parses them) into an OpenAI assistant message, and the turns that
   finished in the same engine step go to ``pool.step`` together. A turn cut at ``max_new_tokens`` gets the
   end-of-turn id appended (mask 0: not sampled) and counts in ``truncated_turns``; the environment still answers
   it. The observation is appended as ``renderer.observation_ids`` (mask 0), then the episode goes back to 2,
   unless it is done, at ``max_turns``, out of tokens or its env failed.
Partial rollouts (async RL, ``polyrl.run.async_rollout.PartialRollouts``): ``between_steps(llm, steps)`` is called at
every engine-step boundary while turns are in flight (``steps``: the engine steps of this call so far), as
``LLM.generate`` calls it; there the producer may load newer weights (``LLM.swap_weights``): the turns in flight
go on (their KV cache kept), the outputs of the step it read come with the next ``step()``, and every turn records
the engine's version per sampled token (``Episode.versions``, from ``CompletionOutput.token_versions``), so one
turn can span two versions; a turn started after the update is prefilled by the new weights (the swap forgets the
prefix cache).
Output formats (``formats``): each turn's request carries the grammar of its format (the last ``EnvStep``'s, else
the environment's, else the run's ``sampling.structured``; with tools, a call OR the format), so every assistant
turn is constrained; the engine's log-probs stay unmasked and ``Episode.masked_logmass`` sums what the masks removed.
A format an environment returns that does not compile ends its episode as ``env_error`` (``invalid``).
Per-episode metrics: ``turns``, ``tool_calls``, ``invalid_tool_calls`` (unparseable ``<tool_call>`` blocks),
``tool_errors``, ``constrained_turns`` and whatever the environment reports. Not here: training, the proxy
(``proxy``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polyrl.agents.episode import Episode
from polyrl.agents.formats import pick, turn_grammar
from polyrl.agents.tool_parsers import HermesParser
from polyrl.errors import ConfigError, UserError


@dataclass
class EpisodeLimits:
    max_turns: int = 4  # assistant turns per episode
    max_new_tokens: int = 128  # per turn
    max_episode_tokens: int = 1024  # the whole episode, opening prompt included

    def __post_init__(self) -> None:
        for key in ("max_turns", "max_new_tokens", "max_episode_tokens"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{key} must be a positive integer, got {v!r}")


def turn_seed(seed: int, index: int, turn: int) -> int:
    """The sampling seed of turn ``turn`` of episode ``index`` of a prompt seeded ``seed``: a pure function."""
    return ((seed * 1_000_003 + index) * 10_007 + turn) % (2**62)


def run_episodes(
    llm: Any,
    pool: Any,
    renderer: Any,
    examples: list[dict[str, Any]],
    n: int,
    sampling: Any,
    seeds: list[int] | None = None,
    limits: EpisodeLimits | None = None,
    failure_reward: float = 0.0,
    between_steps: Any = None,
) -> list[Episode]:
    """``n`` episodes per example, grouped by example (see the module docstring); episodes in (group, index) order.
    ``between_steps(llm, steps)``: called between two engine steps while turns are in flight (partial rollouts)."""
    limits = limits or EpisodeLimits()
    eps = [Episode(g, j) for g in range(len(examples)) for j in range(n)]
    tools = list(pool.tools)
    parser = getattr(renderer, "tool_parser", None) or HermesParser()
    if parser.keep_special_tokens:  # its call marker is a special token: the reply's text must keep it
        sampling = sampling.clone(skip_special_tokens=False)
    grammars = _TurnGrammars(
        tools, renderer.tokenizer, getattr(pool, "response_format", None), getattr(sampling, "structured", None),
        getattr(pool, "parallel_tool_calls", True), parser,
    )  # fmt: skip
    opened = pool.reset([(k, examples[e.group]) for k, e in enumerate(eps)])
    pending: dict[str, int] = {}
    for k, e in enumerate(eps):
        res = opened[k]
        if not res.ok:
            _fail(e, res, failure_reward, pool, k)
            continue
        e.messages, e.tools = list(res.value), tools
        e.prompt_ids = renderer.prompt_ids(e.messages, tools)
        if len(e.prompt_ids) >= min(limits.max_episode_tokens, llm.max_model_len):
            e.end("max_tokens", f"the opening prompt has {len(e.prompt_ids)} tokens")
            pool.release(k)
            continue
        _submit(llm, e, k, sampling.clone(structured=grammars.get(None)), seeds, limits, pending)
    steps = 0
    while pending:
        if steps and between_steps is not None:  # a step boundary with turns in flight (not after the last step)
            between_steps(llm, steps)  # may swap the weights: what it read of the step in flight comes with step()
        # ahead: the device decodes the next launch while this loop runs the environments for the last one
        finished = [o for o in llm.step(ahead=True) if o.finished and o.request_id in pending]
        steps += 1
        to_env = []
        for out in finished:
            k = pending.pop(out.request_id)
            e, c = eps[k], out.outputs[0]
            e.add_turn(c.token_ids, c.logprobs, getattr(c, "token_versions", None))
            e.count("turns")
            mass = getattr(c, "masked_logmass", None)  # None: an unconstrained turn
            if mass is not None:
                e.masked_logmass = (e.masked_logmass or 0.0) + mass
                e.count("constrained_turns")
            msg = parser.parse(c.text, f"call_{e.num_turns}")
            e.count("tool_calls", len(msg.get("tool_calls", [])))
            e.count("invalid_tool_calls", len(msg.get("invalid_tool_calls", [])))
            e.messages.append(msg)
            if c.finish_reason != "stop":  # cut by max_tokens before its end-of-turn token
                e.count("truncated_turns")
                if len(e.context) + 1 >= _budget(llm, limits):
                    e.end("max_tokens")
                    pool.release(k)
                    continue
                e.add_observation([renderer.eos_id])  # close the turn as the template would (masked: not sampled)
            to_env.append((k, msg))
        if not to_env:
            continue
        results = pool.step(to_env)
        for k, _ in to_env:
            e, res = eps[k], results[k]
            if not res.ok:
                _fail(e, res, failure_reward, pool, k)
                continue
            st = res.value
            e.reward += st.reward
            for key, v in st.metrics.items():
                e.count(key, v)
            e.messages.extend(st.messages)
            if st.done:
                e.end("done")
            elif e.num_turns >= limits.max_turns:
                e.end("max_turns")
            else:
                obs = renderer.observation_ids(st.messages)
                if len(e.context) + len(obs) + 1 > _budget(llm, limits):
                    e.end("max_tokens")
                else:
                    e.add_observation(obs)
                    try:
                        params = sampling.clone(structured=grammars.get(st.response_format))
                        _submit(llm, e, k, params, seeds, limits, pending)
                    except UserError as exc:  # the format the environment asked for does not compile: its failure
                        e.reward = failure_reward
                        e.count("env_failures")
                        e.end("env_error", f"invalid: the response_format of step() does not compile: {exc}")
                        if hasattr(pool, "totals"):
                            pool.totals["invalid"] = pool.totals.get("invalid", 0) + 1
            if e.finished:
                pool.release(k)
    return eps


class _TurnGrammars:
    """The grammar of a turn per declared step format (``formats.pick`` order), each built once per call."""

    def __init__(
        self, tools: list, tokenizer: Any, env_format: Any, run_format: Any, parallel: bool, parser: Any
    ) -> None:
        self.tools, self.tokenizer, self.parallel, self.parser = tools, tokenizer, parallel, parser
        self.env_format, self.run_format = env_format, run_format
        self._built: dict[Any, Any] = {}

    def get(self, step_format: Any) -> Any:
        if step_format not in self._built:
            fmt = pick(step_format, self.env_format, self.run_format)
            self._built[step_format] = turn_grammar(fmt, self.tools, self.tokenizer, self.parallel, self.parser)
        return self._built[step_format]


def _budget(llm: Any, limits: EpisodeLimits) -> int:
    return min(limits.max_episode_tokens, llm.max_model_len)


def _submit(
    llm: Any, e: Episode, k: int, sampling: Any, seeds: list[int] | None, limits: EpisodeLimits, pending: dict
) -> None:
    room = _budget(llm, limits) - len(e.context)
    params = sampling.clone(n=1, max_tokens=min(limits.max_new_tokens, room))
    if seeds is not None:
        params = params.clone(seed=turn_seed(int(seeds[e.group]), e.index, e.num_turns))
    rid = llm.add_request(e.context, params, request_id=f"episode-{k}-turn-{e.num_turns}")
    pending[rid] = k


def _fail(e: Episode, res: Any, failure_reward: float, pool: Any, k: int) -> None:
    e.reward = failure_reward
    e.count("env_failures")
    e.end("env_error", f"{res.kind}: {res.value}")
    pool.release(k)


def episode_metrics(eps: list[Episode]) -> dict[str, float]:
    """Step metrics over episodes: means of the per-episode counters, lengths, status fractions."""
    if not eps:
        return {}
    n = len(eps)
    keys = sorted({k for e in eps for k in e.metrics})
    out = {f"episode/{k}": sum(e.metrics.get(k, 0.0) for e in eps) / n for k in keys}
    turns = sum(e.num_turns for e in eps)
    out["episode/tool_call_rate"] = sum(e.metrics.get("tool_calls", 0.0) > 0 for e in eps) / n
    out["episode/tool_calls_per_turn"] = sum(e.metrics.get("tool_calls", 0.0) for e in eps) / max(turns, 1)
    out["episode/length"] = sum(e.num_tokens for e in eps) / n
    out["episode/policy_tokens"] = sum(sum(e.mask) for e in eps) / n
    for s in ("done", "max_turns", "max_tokens", "env_error"):
        out[f"episode/status_{s}"] = sum(e.status == s for e in eps) / n
    return out


__all__ = ["EpisodeLimits", "episode_metrics", "run_episodes", "turn_seed"]
