"""Multi-turn episodes on the real engine (tiny model): the recorded ids are exactly the sampled ids plus the
template deltas, the mask covers exactly the policy's tokens, limits end episodes, a failing env is counted, and the
step-boundary hook of partial rollouts runs between engine steps, each token recording its policy version."""

from __future__ import annotations

import pytest

from polyrl.agents.env import register_env
from polyrl.agents.pool import EnvPool
from polyrl.agents.render import ChatRenderer
from polyrl.agents.rollout import EpisodeLimits, episode_metrics, run_episodes
from polyrl.infer import SamplingParams

EXAMPLES = [{"prompt": f"game {i}", "metadata": {"hi": 1000}} for i in range(3)]


class _Recorder:
    """Records every request's prompt ids and every finished request's sampled ids / log-probs."""

    def __init__(self, llm):
        self.llm, self.prompts, self.sampled = llm, {}, {}
        self._add, self._step = llm.add_request, llm.step

    def __enter__(self):
        def add(prompt, params=None, request_id=None, stream=False):
            rid = self._add(prompt, params, request_id, stream)
            self.prompts[rid] = list(prompt)
            return rid

        def step(ahead=False):
            outs = self._step(ahead)
            for o in outs:
                if o.finished:
                    self.sampled[o.request_id] = (list(o.outputs[0].token_ids), list(o.outputs[0].logprobs))
            return outs

        self.llm.add_request, self.llm.step = add, step
        return self

    def __exit__(self, *exc):
        del self.llm.add_request, self.llm.step


# The random tiny model seldom samples eos: a band of frequent token ids ends a turn instead (finish_reason
# "stop", the id kept, as eos would be).
STOP_IDS = list(range(200, 1400))


def _sampling():
    return SamplingParams(temperature=1.0, stop_token_ids=STOP_IDS)


def test_episode_ids_are_exactly_sampled_plus_deltas(tiny_llm):
    renderer = ChatRenderer(tiny_llm.tokenizer)
    limits = EpisodeLimits(max_turns=3, max_new_tokens=12, max_episode_tokens=400)
    with EnvPool("guessing", workers=0) as pool, _Recorder(tiny_llm) as rec:
        eps = run_episodes(tiny_llm, pool, renderer, EXAMPLES, 2, _sampling(), [11, 12, 13], limits)
    assert [(e.group, e.index) for e in eps] == [(g, j) for g in range(3) for j in range(2)]
    multi = 0
    for k, e in enumerate(eps):
        assert e.finished and e.num_turns >= 1
        opening = renderer.render(e.messages[:1], None, True)
        assert e.prompt_ids == renderer.encode(opening)
        assert len(e.mask) == len(e.ids) and sum(e.mask) == len(e.logprobs)
        cursor = 0
        for t, (start, end) in enumerate(e.turns):
            rid = f"episode-{k}-turn-{t}"
            # the turn's request prompt is the whole episode so far, never re-tokenised
            assert rec.prompts[rid] == e.prompt_ids + e.ids[:start]
            ids, lps = rec.sampled[rid]
            assert e.ids[start:end] == ids
            assert e.logprobs[cursor : cursor + len(ids)] == lps
            cursor += len(ids)
            assert e.mask[start:end] == [1] * len(ids)
            if t > 0:  # the tokens between turns are the template delta of the user observation, masked
                prev_end = e.turns[t - 1][1]
                obs = renderer.observation_ids([[m for m in e.messages if m["role"] == "user"][t]])
                cut = [] if e.ids[prev_end - 1] in STOP_IDS else [renderer.eos_id]  # a turn cut at max_new_tokens
                assert e.ids[prev_end:start] == cut + obs
                assert e.mask[prev_end:start] == [0] * (start - prev_end)
        assert sum(e.mask) == sum(end - start for start, end in e.turns)
        multi += e.num_turns > 1
        if e.status == "max_turns":
            assert e.num_turns == 3
    assert multi >= 3, [e.num_turns for e in eps]
    m = episode_metrics(eps)
    assert m["episode/turns"] == sum(e.num_turns for e in eps) / len(eps)


def test_same_seeds_same_episodes_and_prefix_cache_is_used(tiny_llm):
    renderer = ChatRenderer(tiny_llm.tokenizer)
    limits = EpisodeLimits(max_turns=3, max_new_tokens=12, max_episode_tokens=400)
    with EnvPool("guessing", workers=0) as pool:
        hits0 = tiny_llm.block_manager.hit_tokens
        a = run_episodes(tiny_llm, pool, renderer, EXAMPLES, 2, _sampling(), [5, 6, 7], limits)
        assert tiny_llm.block_manager.hit_tokens > hits0  # later turns reuse the cached conversation
        tiny_llm.reset_prefix_cache()
        b = run_episodes(tiny_llm, pool, renderer, EXAMPLES, 2, _sampling(), [5, 6, 7], limits)
    assert [e.ids for e in a] == [e.ids for e in b]
    flat = [x for e in b for x in e.logprobs]
    assert [x for e in a for x in e.logprobs] == pytest.approx(flat, abs=1e-5)


def test_step_boundary_hook_and_per_token_versions(tiny_llm):
    """Partial rollouts' hook: ``between_steps(llm, steps)`` is called between every two engine steps of the loop
    (never after the last); a version swap there (weights unchanged here, so the episodes stay the plain ones) stamps
    the later tokens: a turn running at the swap keeps version 0 for the tokens it had, 1 for the rest; template and
    observation tokens carry the version of the sampled token before them; the Sample gets them per completion id."""
    renderer = ChatRenderer(tiny_llm.tokenizer)
    # turns of 8 tokens (the tiny model seldom samples eos): the second turn's prefill is engine step 9
    limits = EpisodeLimits(max_turns=3, max_new_tokens=8, max_episode_tokens=400)
    sampling = SamplingParams(temperature=1.0)
    calls, running, steps_run = [], {}, []
    plain_step = tiny_llm.step

    def counting(ahead=False):
        steps_run.append(1)
        return plain_step(ahead)

    def hook(llm, steps):
        calls.append(steps)
        if steps == 12:
            running.update({rid: len(q.seqs[0].output_token_ids) for rid, q in llm._requests.items()})
            llm.swap_weights(lambda: None, 1)

    with EnvPool("guessing", workers=0) as pool:
        plain = run_episodes(tiny_llm, pool, renderer, EXAMPLES, 2, sampling, [11, 12, 13], limits)
        tiny_llm.policy_version, tiny_llm.step = 0, counting
        try:
            eps = run_episodes(tiny_llm, pool, renderer, EXAMPLES, 2, sampling, [11, 12, 13], limits, 0.0, hook)
        finally:
            tiny_llm.policy_version = None
            del tiny_llm.step
    assert calls == list(range(1, len(steps_run))) and len(calls) > 12  # every boundary, not after the last step
    assert all(e.versions is None and e.to_sample().token_versions is None for e in plain)
    spanning = 0
    for k, (e, p) in enumerate(zip(eps, plain)):
        assert e.ids == p.ids and e.mask == p.mask  # the weights did not change
        assert len(e.versions) == len(e.ids) and e.versions == sorted(e.versions) and set(e.versions) <= {0, 1}
        assert e.to_sample().token_versions == e.versions
        for t, (a, b) in enumerate(e.turns):
            rid = f"episode-{k}-turn-{t}"
            if rid in running:
                old = running[rid]
                assert e.versions[a:b] == [0] * old + [1] * (b - a - old)
                spanning += 0 < old < b - a
            if b < len(e.ids):  # the template / observation tokens after the turn: its last token's version
                nxt = e.turns[t + 1][0] if t + 1 < e.num_turns else len(e.ids)
                assert e.versions[b:nxt] == [e.versions[b - 1]] * (nxt - b)
    assert spanning == len(eps)  # every episode's second turn was running at the swap


def test_episode_versions_are_all_or_none():
    from polyrl.agents.episode import Episode

    e = Episode(0, 0, prompt_ids=[1, 2])
    e.add_turn([3, 4], [-0.1, -0.2], [0, 1])
    e.add_observation([5, 6])
    e.add_turn([7], [-0.3], [2])
    assert e.versions == [0, 1, 1, 1, 2] and e.to_sample().token_versions == [0, 1, 1, 1, 2]
    with pytest.raises(ValueError, match="every turn of an episode records policy versions"):
        e.add_turn([8], [-0.4])
    with pytest.raises(ValueError, match="2 tokens came with 1 policy versions"):
        Episode(0, 0).add_turn([3, 4], [-0.1, -0.2], [0])


def test_token_budget_and_turn_truncation(tiny_llm):
    renderer = ChatRenderer(tiny_llm.tokenizer)
    with EnvPool("guessing", workers=0) as pool:
        eps = run_episodes(
            tiny_llm, pool, renderer, EXAMPLES, 1, SamplingParams(temperature=1.0), [1, 2, 3],
            EpisodeLimits(max_turns=4, max_new_tokens=5, max_episode_tokens=400),
        )  # fmt: skip
        # 5 tokens never reach eos: each cut turn is closed with eos (masked) and the environment answers it
        assert [e.num_turns for e in eps] == [4, 4, 4] and {e.status for e in eps} == {"max_turns"}
        for e in eps:
            assert e.metrics["truncated_turns"] == 4.0
            for _start, end in e.turns[:-1]:
                assert e.ids[end] == renderer.eos_id and e.mask[end] == 0 and e.mask[end - 1] == 1
        budget = len(eps[0].prompt_ids) + 20
        eps = run_episodes(
            tiny_llm, pool, renderer, EXAMPLES, 1, _sampling(), [1, 2, 3],
            EpisodeLimits(max_turns=50, max_new_tokens=12, max_episode_tokens=budget),
        )  # fmt: skip
    for e in eps:
        assert e.num_tokens <= budget + 1
        assert e.status in ("max_tokens", "done")


def test_failing_env_is_counted_never_fatal(tiny_llm, tmp_path):
    src = tmp_path / "bad_env.py"
    src.write_text(
        "import time\n"
        "class Bad:\n"
        "    tools = []\n"
        "    def reset(self, example):\n"
        "        self.p = example['prompt']\n"
        "        if self.p.endswith('1'):\n"
        "            raise RuntimeError('reset broke')\n"
        "        return [{'role': 'user', 'content': 'go'}]\n"
        "    def step(self, message):\n"
        "        if self.p.endswith('2'):\n"
        "            time.sleep(120)\n"
        "        return 'not an EnvStep'\n"
    )
    register_env("bad-test", f"{src}:Bad")
    renderer = ChatRenderer(tiny_llm.tokenizer)
    examples = [{"prompt": f"game {i}"} for i in range(3)]
    with EnvPool("bad-test", workers=1, timeout=3.0) as pool:
        eps = run_episodes(
            tiny_llm, pool, renderer, examples, 1, _sampling(), [1, 2, 3],
            EpisodeLimits(max_turns=2, max_new_tokens=8, max_episode_tokens=300), failure_reward=-1.0,
        )  # fmt: skip
        totals = dict(pool.totals)
    assert [e.status for e in eps] == ["env_error"] * 3
    assert [e.reward for e in eps] == [-1.0] * 3
    assert eps[1].error.startswith("error: RuntimeError: reset broke") and not eps[1].trainable
    assert eps[0].error.startswith("invalid") and eps[0].trainable
    kinds = eps[2].error.split(":")[0]
    assert kinds in ("timeout", "lost") and eps[2].trainable
    assert totals["error"] == 1 and totals["invalid"] == 1 and totals["timeout"] == 1
