"""GRPO over episodes end to end on the CPU (tiny model, real engine, real env workers): the loss sees exactly the
policy tokens with the engine's log-probs aligned to them (rollout/trainer mismatch ~0), per-turn metrics are
logged, the CLI and fit() take --env, bad settings are ConfigErrors, a resumed agentic run is exact, and ``eval_n``
samples evaluation episodes (pass@k, length)."""

from __future__ import annotations

import json

import pytest

from polyrl.agents.episode import Episode
from polyrl.algorithms.rl_batch import pack_samples
from polyrl.errors import ConfigError


def test_pack_puts_the_loss_on_policy_tokens_only():
    e = Episode(0, 0, prompt_ids=[1, 2, 3])
    e.add_turn([10, 11], [-0.5, -0.6])
    e.add_observation([20, 21, 22])
    e.add_turn([12], [-0.7])
    s = e.to_sample()
    (b,) = pack_samples([s], {"old_logp": [s.logprobs], "adv": [2.0]})
    seq = [1, 2, 3, 10, 11, 20, 21, 22, 12]
    assert b.input_ids.tolist() == seq
    # labels[t] is the token predicted at t: policy tokens only (10, 11, 12), -100 on the prompt and observation
    assert b.labels.tolist() == [-100, -100, 10, 11, -100, -100, -100, 12, -100]
    assert b.mask.tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 0]
    assert b.fields["old_logp"].tolist() == pytest.approx([0, 0, -0.5, -0.6, 0, 0, 0, -0.7, 0])
    assert b.fields["adv"].tolist() == [0, 0, 2, 2, 0, 0, 0, 2, 0]
    assert b.num_target_tokens == 3
    assert [x.tolist() for x in b.per_sample(b.fields["old_logp"])] == [pytest.approx([-0.5, -0.6, -0.7])]


def _raw(model_dir, out, steps=3, save_every=0, algo="grpo", **kw):
    agent = {"env": "guessing", "env_workers": 1, "max_turns": 3, "max_episode_tokens": 256}
    table = {"prompts_per_step": 2, "samples_per_prompt": 3, "max_new_tokens": 6}
    for key, value in kw.items():
        (agent if key in agent else table)[key] = value
    return {
        "algo": algo,
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": "builtin:arithmetic?max=9&n=32"},
        "engine": {"micro_batch_tokens": 512},
        "optim": {"lr": 1e-2, "weight_decay": 0.0},
        "schedule": {"decay": "constant"},
        "train": {"max_steps": steps, "log_every": 100},
        "checkpoint": {"every_n_steps": save_every, "keep_last_k": 0, "save_final": save_every > 0},
        algo: table,
        "agent": agent,
    }


def _run(raw):
    from polyrl import run as runner
    from polyrl.run import config

    return runner.run(config.build(raw))


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_over_episodes_resumes_exactly(tiny_model_dir, tmp_path):
    full = tmp_path / "full"
    summary = _run(_raw(tiny_model_dir, full, steps=3, save_every=2))
    assert summary["status"] == "finished"
    recs = _records(full)
    r = recs[0]
    for key in (
        "episode/turns", "episode/tool_calls", "episode/tool_call_rate", "episode/invalid_tool_calls",
        "episode/length", "episode/policy_tokens", "env_failures", "loss", "grad_norm",
    ):  # fmt: skip
        assert key in r, key
    # 6-token turns are cut and closed with eos, the game answers: every episode runs its 3 turns unless solved
    assert 2.0 <= r["episode/turns"] <= 3.0
    assert r["episode/length"] > r["episode/policy_tokens"] > 6  # observation tokens are in the sequence, not trained
    # the trainer's log-probs at the masked positions equal the engine's recorded ones: ids and old log-probs align
    assert max(x["mismatch_max"] for x in recs) < 1e-3
    resumed = tmp_path / "resumed"
    raw = _raw(tiny_model_dir, resumed, steps=3, save_every=2)
    raw["resume"] = str(full / "checkpoints" / "step-00000002")
    assert _run(raw)["resumed_from_step"] == 2
    a, b = recs[2:], _records(resumed)
    assert [x["step"] for x in b] == [3]
    for key in ("reward", "loss", "grad_norm", "episode/length", "episode/turns", "mismatch_max"):
        assert [x[key] for x in a] == [x[key] for x in b], key


def test_cli_and_fit_take_an_env(tiny_model_dir, tmp_path, capsys):
    from polyrl.cli.main import main
    from polyrl.trainer import fit

    argv = [
        "train", "--algo", "gspo", "--model", str(tiny_model_dir), "--data", "builtin:arithmetic?max=9&n=16",
        "--out", str(tmp_path / "cli"), "--env", "calculator", "--max-turns", "2", "--max-new-tokens", "5",
        "--max-episode-tokens", "200", "--env-workers", "0", "--n", "2", "--prompts-per-step", "2", "--max-steps", "1",
    ]  # fmt: skip
    assert main(argv) == 0
    saved = json.loads((tmp_path / "cli" / "run_config.json").read_text())
    assert saved["agent"]["env"] == "calculator" and saved["agent"]["max_turns"] == 2
    out = capsys.readouterr().out
    assert "episodes: env 'calculator' (1 tool(s))" in out
    assert "reward from the environment 'calculator'" in out and "reward 'exact_match'" not in out  # not the algo's
    summary = fit(
        "grpo", tiny_model_dir, "builtin:arithmetic?max=9&n=16", tmp_path / "fit", train={"max_steps": 1},
        grpo={"max_new_tokens": 5, "samples_per_prompt": 2, "prompts_per_step": 2},
        agent={"env": "guessing", "env_workers": 0, "max_turns": 2, "max_episode_tokens": 200},
    )  # fmt: skip
    assert summary["status"] == "finished"
    assert "episode/turns" in _records(tmp_path / "fit")[0]


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"env": " "}, "must name an environment"),
        ({"env": "calculator", "max_turns": 0}, "max_turns must be a positive integer"),
        ({"env": "calculator", "max_episode_tokens": 8}, "must exceed grpo.max_new_tokens"),
        ({"env": "calculator", "env_timeout": 0}, "env_timeout must be > 0"),
    ],
)
def test_bad_agent_settings_are_config_errors(kw, message):
    from polyrl.agents import AgentConfig
    from polyrl.algorithms.grpo import GRPOConfig

    with pytest.raises(ConfigError, match=message):
        AgentConfig(**kw).check(GRPOConfig(max_new_tokens=16), "grpo")


def test_unknown_env_is_a_config_error(tiny_model_dir, tmp_path):
    from polyrl.agents.env import resolve_env

    with pytest.raises(ConfigError, match="unknown environment 'nope'"):
        resolve_env("nope")
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_env(str(tmp_path / "missing.py") + ":Env")


def test_ppo_over_episodes(tiny_model_dir, tmp_path):
    from polyrl.trainer import fit

    out = tmp_path / "ppo"
    summary = fit(
        "ppo", tiny_model_dir, "builtin:arithmetic?max=9&n=16", out, train={"max_steps": 1},
        ppo={"max_new_tokens": 5, "prompts_per_step": 4},
        agent={"env": "guessing", "env_workers": 0, "max_turns": 2, "max_episode_tokens": 200},
    )  # fmt: skip
    assert summary["status"] == "finished"
    (r,) = _records(out)
    assert r["episode/turns"] == 2.0 and r["mismatch_max"] < 1e-3 and "value_loss" in r
    assert (out / "critic" / "final" / "config.json").is_file()


def test_resume_restores_the_cumulative_failure_counters():
    """A resumed run continues the saved environment- and reward-failure totals (they were saved, not restored)."""
    from types import SimpleNamespace

    from polyrl.agents.train import with_episodes
    from polyrl.run.online import OnlineRun

    run = object.__new__(with_episodes(OnlineRun))  # only the counter plumbing, no model
    run.pool = SimpleNamespace(totals={"error": 0, "timeout": 0})
    run._env_totals = {"error": 0, "timeout": 0, "crash": 0}  # the environment pool's totals (a plain dict on a rank
    # that builds no pool)
    run.proxy, run.limits = None, object()
    saved = {"reward_failures": {"error": 2}, "env_failures": {"timeout": 3, "crash": 1}}
    run.restore_counters(saved)
    assert run.pool.totals == {"error": 2, "timeout": 0}
    assert run.failure_totals == {"error": 0, "timeout": 3, "crash": 1}
    run.agents, run.env_pool = True, None  # proxy mode keeps its own totals
    run.restore_counters(saved)
    assert run.failure_totals == {"timeout": 3, "crash": 1}


# two turns, a 0/1 episode reward (a digit in the last reply): a random tiny model passes on some samples
HAS_DIGIT_ENV = """
from polyrl.agents.env import Environment, EnvStep


class HasDigit(Environment):
    def reset(self, example):
        self.turn = 0
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, message):
        self.turn += 1
        done = self.turn >= 2
        reward = float(done and any(c.isdigit() for c in message.get("content") or ""))
        return EnvStep([{"role": "user", "content": "Again."}], reward, done)
"""


def test_agentic_eval_n_samples_episodes_and_reports_pass_at_k(tiny_model_dir, tmp_path):
    """``eval_n`` K > 1 in an agentic run: beside the greedy episodes, K sampled episodes per eval prompt give the
    sampled mean reward, unbiased pass@k (monotone in k; pass@1 = the mean of a 0/1 reward) and the mean policy tokens
    per episode, at the eval steps only; without eval_n only the greedy metrics."""
    env = tmp_path / "has_digit.py"
    env.write_text(HAS_DIGIT_ENV)
    out = tmp_path / "eval_n"
    raw = _raw(tiny_model_dir, out, steps=2, env=f"{env}:HasDigit", max_turns=2, eval_prompts=4, eval_n=4)
    raw["grpo"]["eval_pass_threshold"] = 1.0
    raw["train"].update(eval_every=1, eval_data="builtin:arithmetic?max=9&n=8")
    _run(raw)
    recs = _records(out)
    assert [r["step"] for r in recs if "eval_pass@4" in r] == [1, 2]
    for r in recs:
        assert 0.0 <= r["eval_reward"] <= 1.0  # the greedy evaluation is still there
        p1, p2, p4 = r["eval_pass@1"], r["eval_pass@2"], r["eval_pass@4"]
        assert 0 < p1 < 1 and p1 <= p2 <= p4 <= 1
        assert p1 == pytest.approx(r["eval_sampled_reward"])  # 0/1 rewards: pass@1 is the mean reward
        assert 0 < r["eval_length"] <= 2 * 6  # two turns of at most 6 policy tokens
    # without eval_n: greedy episodes only
    raw = _raw(tiny_model_dir, tmp_path / "greedy", steps=1, env=f"{env}:HasDigit", max_turns=2, eval_prompts=4)
    raw["train"].update(eval_every=1, eval_data="builtin:arithmetic?max=9&n=8")
    _run(raw)
    (r,) = _records(tmp_path / "greedy")
    assert "eval_reward" in r and not any(k.startswith("eval_pass@") or k == "eval_length" for k in r)


def test_agentic_eval_n_metrics_from_the_episodes():
    """The sampled evaluation's numbers from known episodes (no model): K episodes per prompt at the training
    temperature with the evaluation seeds, pass@k by the unbiased estimator over prompts, length = policy tokens."""
    from math import comb
    from types import SimpleNamespace

    from polyrl.agents.train import with_episodes
    from polyrl.infer.sampling_params import SamplingParams
    from polyrl.run.online import OnlineRun, rollout_seed

    run = object.__new__(with_episodes(OnlineRun))
    run.a = SimpleNamespace(
        eval_n=4, eval_pass_threshold=0.5, temperature=0.8, top_p=0.9, eval_max_new_tokens=None, max_new_tokens=6
    )
    run.cfg = SimpleNamespace(seed=3)
    run.sampling = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6)
    run.eval_set = (None, None, [{"prompt": "a"}, {"prompt": "b"}])
    # prompt 0: rewards 1, 0, 0.5, 0 (two pass); prompt 1: none passes; greedy: one episode per prompt
    rewards = {0: [1.0, 0.0, 0.5, 0.0], 1: [0.0, 0.25, 0.0, 0.0]}
    calls = []

    def episodes(examples, n, sampling, seeds):
        calls.append((n, sampling.temperature, sampling.top_p, seeds))
        out = []
        for g in range(len(examples)):
            for j in range(n):
                e = Episode(g, j, prompt_ids=[1])
                e.add_turn([5] * (g + j + 1), [-0.1] * (g + j + 1))
                e.reward = rewards[g][j] if n > 1 else 0.5
                out.append(e)
        return out

    run.episodes = episodes
    got = run.evaluate()
    assert calls[0] == (1, 0.0, 0.9, None)  # greedy
    assert calls[1] == (4, 0.8, 0.9, [rollout_seed(3, -1, 0), rollout_seed(3, -1, 1)])
    assert got["eval_reward"] == 0.5
    assert got["eval_sampled_reward"] == pytest.approx(1.75 / 8)
    for k in (1, 2, 4):  # prompt 0: c = 2 of n = 4; prompt 1: c = 0
        assert got[f"eval_pass@{k}"] == pytest.approx((1 - comb(2, k) / comb(4, k)) / 2)
    assert got["eval_length"] == pytest.approx(sum(g + j + 1 for g in (0, 1) for j in range(4)) / 8)
