"""GRPO / GSPO / PPO over episodes: ``polyrl train --algo grpo --env calculator`` (or ``fit(..., grpo={"env": ...})``).

``with_episodes(run_cls)`` makes an ``OnlineRun`` class (``OnlineRun`` itself for GRPO/GSPO, ``PPORun`` for PPO)
whose ``collect`` rolls out episodes instead of single completions; everything after it is the online loop as it
is: each episode is ONE training ``Sample`` (opening prompt + every later token, ``mask`` on the policy's sampled
tokens only, ``logprobs`` = the engine's log-probs of exactly those tokens: the old log-probs, no re-tokenisation),
``group`` = its prompt, so GRPO's group advantages compare the ``samples_per_prompt`` episodes of one prompt, and the
loss, the mismatch measurement, checkpoints and exact resume are the online loop's. The episode reward is the
environment's (``reward`` is unused). Metrics per step: ``reward``, ``episode/turns``, ``episode/tool_calls``,
``episode/tool_call_rate`` (episodes with at least one call), ``episode/invalid_tool_calls``,
``episode/tool_errors``, ``episode/length``, status fractions, ``env_failures``; evaluation (``train.eval_every``)
runs greedy episodes on the held-out prompts (``eval_reward``, ``eval_tool_call_rate``).
Not here: the episode loop (``rollout``), the loss and advantages (``polyrl.algorithms``). One process only.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any

from polyrl.errors import ConfigError


@contextmanager
def rollout_window(policy: Any):
    """The rollout engine ready to sample (eval mode, KV cache allocated), restored afterwards (cache released when
    the policy releases it for training; requests aborted after a failure)."""
    net = policy.rollout_net
    was_training = net.training
    net.eval()
    if not policy.llm.kv.allocated:
        policy.llm.reallocate()
    try:
        yield policy.llm
    except BaseException:
        policy.llm.abort_all()
        raise
    finally:
        if policy.release_kv:
            policy.llm.release()
        net.train(was_training)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


class EpisodeSteps:
    """Mixin placed before an ``OnlineRun`` class (see ``with_episodes``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from polyrl.agents.pool import EnvPool
        from polyrl.agents.render import ChatRenderer
        from polyrl.agents.rollout import EpisodeLimits

        a = self.a
        if self.world.distributed:
            raise ConfigError("agentic runs (--env) train in one process for now; drop --nproc-per-node")
        from polyrl.data.dataset import chat_tokenizer

        self.renderer = ChatRenderer(self.tokenizer, chat_tokenizer(self.cfg.data, self.tokenizer).template)
        self.limits = EpisodeLimits(a.max_turns, a.max_new_tokens, a.max_episode_tokens)
        self.env_pool = EnvPool(a.env, a.env_workers, a.env_timeout)
        self.print(
            f"episodes: env {a.env!r} ({len(self.env_pool.tools)} tool(s)), at most {a.max_turns} turns of "
            f"{a.max_new_tokens} tokens, {a.max_episode_tokens} tokens per episode"
        )

    def episodes(self, examples: list[dict], n: int, sampling: Any, seeds: list[int] | None) -> list[Any]:
        from polyrl.agents.rollout import run_episodes

        with rollout_window(self.policy) as llm:
            return run_episodes(
                llm, self.env_pool, self.renderer, examples, n, sampling, seeds, self.limits, self.a.failure_reward
            )

    def collect(self, step: int) -> tuple[list[Any], list[float], dict[str, float]]:
        from polyrl.agents.rollout import episode_metrics
        from polyrl.algorithms.online import rollout_seed

        t0 = time.perf_counter()
        idx = self.data.take(self.a.prompts_per_step)
        seeds = [rollout_seed(self.cfg.seed, step, k) for k in range(len(idx))]
        before = sum(self.env_pool.totals.values())
        eps = self.episodes([self.views[i] for i in idx], self.a.samples_per_prompt, self.sampling, seeds)
        t1 = time.perf_counter()
        kept = [e for e in eps if e.trainable]
        samples = [e.to_sample() for e in kept]
        rewards = [e.reward for e in kept]
        policy_tokens = [float(sum(e.mask)) for e in kept]
        all_rewards = [e.reward for e in eps]
        m = {
            "reward": _mean(all_rewards),
            "reward_std": float(sum((r - _mean(all_rewards)) ** 2 for r in all_rewards) / max(len(eps) - 1, 1)) ** 0.5,
            "response_length": _mean(policy_tokens),
            "response_length_max": max(policy_tokens, default=0.0),
            "truncated_fraction": _mean([float(e.status == "max_tokens") for e in eps]),
            "rollout_s": t1 - t0,
            "rollout_tokens_per_s": sum(policy_tokens) / max(t1 - t0, 1e-9),
            "env_failures": float(sum(self.env_pool.totals.values()) - before),
            "env_failures_total": float(sum(self.env_pool.totals.values())),
            "episodes_untrainable": float(len(eps) - len(kept)),
            **episode_metrics(eps),
        }
        bad = next((e for e in eps if e.status == "env_error"), None)
        if bad is not None:
            self.print(f"step {step + 1}: environment failure ({int(m['env_failures'])} this step): {bad.error}")
        if not samples:
            raise ConfigError(f"step {step + 1}: no episode could start (every reset failed: {bad and bad.error})")
        return samples, rewards, m

    def evaluate(self) -> dict[str, float]:
        from polyrl.agents.rollout import episode_metrics

        _, _, views = self.eval_set
        params = self.sampling.clone(temperature=0.0, max_tokens=self.a.eval_max_new_tokens or self.a.max_new_tokens)
        eps = self.episodes(list(views), 1, params, None)
        m = episode_metrics(eps)
        return {
            "eval_reward": _mean([e.reward for e in eps]),
            "eval_tool_call_rate": m.get("episode/tool_call_rate", 0.0),
            "eval_turns": m.get("episode/turns", 0.0),
        }

    def data_state(self) -> dict[str, Any]:
        state = super().data_state()
        pool = getattr(self, "env_pool", None)
        state["env_failures"] = dict(pool.totals) if pool is not None else {}
        return state

    def run(self) -> dict[str, Any]:
        try:
            return super().run()
        finally:
            self.env_pool.close()


_CLASSES: dict[type, type] = {}


def with_episodes(run_cls: type) -> type:
    """``run_cls`` (an ``OnlineRun`` subclass) with ``EpisodeSteps`` in front: its rollouts are episodes."""
    if run_cls not in _CLASSES:
        _CLASSES[run_cls] = type(f"Episode{run_cls.__name__}", (EpisodeSteps, run_cls), {})
    return _CLASSES[run_cls]


__all__ = ["EpisodeSteps", "rollout_window", "with_episodes"]
