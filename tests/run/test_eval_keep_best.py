"""``train.eval_before_train`` (one evaluation of the initial model, logged as step 0, not repeated on resume) and
``train.keep_best`` (``<out>/best`` holds the model of the best-evaluated step, with ``best.json``; it survives
checkpoint pruning and resume), for an offline (SFT) and an online (GRPO) run, and their config errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from polyrl.errors import ConfigError

DATA = "builtin:arithmetic?n=48"
REWARD = "def has_digit(completion, example):\n    return float(any(ch.isdigit() for ch in completion))\n"


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _sft_raw(model_dir: Path, out: Path, **train) -> dict:
    return {
        "algo": "sft",
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": DATA},
        "engine": {"micro_batch_tokens": 256},
        "optim": {"lr": 3e-3},
        "train": {"max_steps": 3, "log_every": 100, "eval_every": 1, "report_to": "none", **train},
        "checkpoint": {"every_n_steps": 1, "keep_last_k": 1, "save_final": True},
    }


def _run(raw: dict) -> dict:
    from polyrl import run as runner
    from polyrl.run import config

    torch.set_num_threads(1)
    return runner.run(config.build(raw))


def _eval_loss_of(model_dir: Path, raw: dict) -> float:
    """The SFT eval loss of the model in ``model_dir`` on the run's eval data (as the run computes it)."""
    from polyrl.models.checkpoint import load_model, load_tokenizer
    from polyrl.run import config
    from polyrl.run.offline import eval_source, evaluate_loss

    cfg = config.build(raw)
    data = eval_source(cfg, cfg.spec, load_tokenizer(str(model_dir)))
    model = load_model(str(model_dir), dtype=torch.float32, device=torch.device("cpu"))
    loss_fn = cfg.spec.make_loss(cfg.algo_config)
    return evaluate_loss(model, data, loss_fn, cfg.spec, cfg.algo_config, torch.device("cpu"))


def test_sft_eval_before_train_and_keep_best(tiny_model_dir, tmp_path):
    out = tmp_path / "sft"
    raw = _sft_raw(tiny_model_dir, out, eval_before_train=True, keep_best="eval_loss")
    summary = _run(raw)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert set(rows[0]) == {"step", "eval_loss"}  # the step-0 row is the evaluation alone
    # step 0 is the initial model's eval loss
    assert rows[0]["eval_loss"] == pytest.approx(_eval_loss_of(tiny_model_dir, raw), rel=1e-5)
    losses = {r["step"]: r["eval_loss"] for r in rows}
    want_step = min(losses, key=losses.get)
    best = json.loads((out / "best" / "best.json").read_text())
    assert best == {"metric": "eval_loss", "mode": "min", "value": losses[want_step], "step": want_step}
    assert summary["best_model"] == str(out / "best") and summary["best_step"] == want_step
    assert summary["best_eval_loss"] == best["value"]
    # the folder is the model of that step: evaluating it gives the logged value; an HF folder like final/
    assert _eval_loss_of(out / "best", raw) == pytest.approx(best["value"], rel=1e-5)
    assert {p.name for p in (out / "final").iterdir()} <= {p.name for p in (out / "best").iterdir()}
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]  # pruning left best alone
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_sft_keep_best_max_keeps_the_initial_model_across_resume(tiny_model_dir, tmp_path):
    """max:eval_loss (the worst loss) on a run whose loss falls: the best is the step-0 model, and a resumed run,
    whose evaluations are all lower, keeps it (the best value rides in the checkpoint)."""
    from polyrl.models.checkpoint import load_model

    out = tmp_path / "sft"
    raw = _sft_raw(tiny_model_dir, out, max_steps=2, eval_before_train=True, keep_best="max:eval_loss")
    _run(raw)
    raw["train"]["max_steps"] = 4
    _run({**raw, "resume": "latest"})
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # step 0 evaluated once, not again on resume
    losses = [r["eval_loss"] for r in rows]
    assert losses == sorted(losses, reverse=True)  # falling: every resumed evaluation is worse for max:
    best = json.loads((out / "best" / "best.json").read_text())
    assert best == {"metric": "eval_loss", "mode": "max", "value": losses[0], "step": 0}
    initial = load_model(str(tiny_model_dir), dtype=torch.float32).state_dict()
    kept = load_model(str(out / "best"), dtype=torch.float32).state_dict()
    assert all(torch.equal(initial[k], kept[k]) for k in initial)


def test_keep_best_without_resumed_state_would_differ(tiny_model_dir, tmp_path):
    """The resumed best value comes from the checkpoint: dropping it there (as an old checkpoint without it)
    makes the resumed run start its tracking afresh and replace the step-0 best (so the test above can fail)."""
    from polyrl.run.best import BestKeeper, BestMetric
    from polyrl.train import parallel as par

    keeper = BestKeeper(BestMetric.parse("max:eval_loss"), tmp_path, lambda p: p.mkdir() or p, par.World(), None)
    keeper.load_state_dict({"metric": "eval_loss", "mode": "max", "value": 5.0, "step": 0})
    assert not keeper.update(3, {"step": 3, "eval_loss": 4.0})
    assert keeper.update(4, {"step": 4, "eval_loss": 6.0})
    assert json.loads((tmp_path / "best" / "best.json").read_text())["step"] == 4
    fresh = BestKeeper(BestMetric.parse("max:eval_loss"), tmp_path, lambda p: p.mkdir() or p, par.World(), None)
    fresh.load_state_dict({"metric": "eval_reward", "mode": "max", "value": 9.0, "step": 1})  # another metric
    assert fresh.value is None
    assert not fresh.update(5, {"step": 5, "loss": 1.0})  # a record without evaluation
    assert fresh.update(5, {"step": 5, "eval_loss": float("-inf")}) is False  # not finite


def test_best_metric_direction_and_names():
    from polyrl.run.best import BestMetric

    assert BestMetric.parse("eval_loss") == BestMetric("eval_loss", "min")
    assert BestMetric.parse("eval_pass@1") == BestMetric("eval_pass@1", "max")
    assert BestMetric.parse("min:eval_length") == BestMetric("eval_length", "min")
    assert BestMetric.parse("max:eval_loss").better(2.0, 1.0)
    assert not BestMetric.parse("eval_loss").better(2.0, 1.0)
    assert not BestMetric.parse("eval_reward").better(1.0, 1.0)  # only a strictly better value replaces the best
    for bad in ("loss", "", "avg:eval_loss", "reward"):
        with pytest.raises(ConfigError, match="keep_best"):
            BestMetric.parse(bad)
    # the eval/... naming (docs, other tools) is answered with the logged name, the direction kept
    with pytest.raises(ConfigError, match="logs it as 'eval_pass@1'; pass --keep-best eval_pass@1$"):
        BestMetric.parse("eval/pass@1")
    with pytest.raises(ConfigError, match="pass --keep-best max:eval_reward$"):
        BestMetric.parse("max:eval/reward")


def test_unknown_keep_best_metric_names_the_closest(tmp_path):
    from polyrl.run.best import BestKeeper, BestMetric
    from polyrl.train import parallel as par

    keeper = BestKeeper(BestMetric.parse("eval_acc"), tmp_path, lambda p: p, par.World(), None)
    with pytest.raises(ConfigError, match=r"'eval_acc' \(did you mean eval_accuracy\?\), which this run's"):
        keeper.check({"eval_reward", "eval_accuracy"})


def test_config_errors(tiny_model_dir, tmp_path):
    from polyrl.run import config

    base = _sft_raw(tiny_model_dir, tmp_path / "x")
    for key, value, flag in (
        ("eval_before_train", True, "--eval-before-train"),
        ("keep_best", "eval_loss", "--keep-best"),
    ):
        raw = _sft_raw(tiny_model_dir, tmp_path / "x", eval_every=0, **{key: value})
        with pytest.raises(ConfigError, match=f"{flag}.*--eval-every N.*--eval-data SPEC"):
            config.build(raw)
    with pytest.raises(ConfigError, match="eval_before_train must be true or false"):
        config.build(_sft_raw(tiny_model_dir, tmp_path / "x", eval_before_train="yes"))
    assert config.build(_sft_raw(tiny_model_dir, tmp_path / "x", keep_best="eval_loss")).train.keep_best == (
        "min:eval_loss"
    )
    # no eval data: the error names --eval-data
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n' * 8)
    raw = {**base, "data": {"path": str(tmp_path / "d.jsonl")}}
    raw["train"] = {**raw["train"], "eval_before_train": True}
    with pytest.raises(ConfigError, match="--eval-data SPEC"):
        _run(raw)
    # a metric this run does not produce: a ConfigError at the first evaluation (here before any training)
    out = tmp_path / "unknown"
    with pytest.raises(ConfigError, match=r"'eval_reward'.*it logs eval_loss"):
        _run(_sft_raw(tiny_model_dir, out, eval_before_train=True, keep_best="eval_reward"))
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    # without eval_before_train too: the loss's metric names from one held-out micro-batch, before step 1 (it failed
    # at the first evaluation, eval_every steps in, after checkpoints were written)
    out = tmp_path / "unknown2"
    with pytest.raises(ConfigError, match=r"'eval_los' \(did you mean eval_loss\?\).*it logs eval_loss"):
        _run(_sft_raw(tiny_model_dir, out, eval_every=3, keep_best="min:eval_los"))
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_cli_flags_reach_the_train_table():
    import argparse

    from polyrl.cli import train as cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--eval-every", "5", "--eval-before-train", "--keep-best", "max:eval_pass@1"])
    got = dict(cli.overrides_from_args(args))
    assert got["train.eval_every"] == 5
    assert got["train.eval_before_train"] is True and got["train.keep_best"] == "max:eval_pass@1"


def _grpo_raw(model_dir: Path, out: Path, reward: Path, lr: float, **train) -> dict:
    return {
        "algo": "grpo",
        "model": str(model_dir),
        "out": str(out),
        "seed": 0,
        "data": {"path": "builtin:arithmetic?n=64"},
        "engine": {"micro_batch_tokens": 256},
        "optim": {"lr": lr},
        "train": {"max_steps": 1, "log_every": 100, "eval_every": 1, "report_to": "none", **train},
        "checkpoint": {"every_n_steps": 0, "keep_last_k": 0, "save_final": False},
        "grpo": {
            "reward": f"{reward}:has_digit",
            "reward_workers": 0,
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "max_new_tokens": 6,
            "eval_prompts": 6,
            "eval_n": 2,
        },
    }


def test_grpo_eval_before_train_is_the_initial_policy_and_keep_best(tiny_model_dir, tmp_path):
    reward = tmp_path / "r.py"
    reward.write_text(REWARD)
    out = tmp_path / "grpo"
    _run(_grpo_raw(tiny_model_dir, out, reward, 1e-2, eval_before_train=True, keep_best="eval_pass@1"))
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1]
    # the same evaluation of the initial policy: a run whose one update changes nothing (lr 1e-30), evaluated after
    ref = tmp_path / "ref"
    _run(_grpo_raw(tiny_model_dir, ref, reward, 1e-30))
    (after,) = _rows(ref)
    evals = {k: v for k, v in after.items() if k.startswith("eval_")}
    assert evals and {k: rows[0][k] for k in evals} == evals
    assert set(rows[0]) == {"step", *evals}
    best = json.loads((out / "best" / "best.json").read_text())
    p1 = {r["step"]: r["eval_pass@1"] for r in rows}
    want = 1 if p1[1] > p1[0] else 0  # ties keep the earlier step
    assert best == {"metric": "eval_pass@1", "mode": "max", "value": p1[want], "step": want}
    if want == 1:  # the last step: best/ holds the final model's weights
        from polyrl.models.checkpoint import load_model

        final = load_model(str(out / "final"), dtype=torch.float32).state_dict()
        kept = load_model(str(out / "best"), dtype=torch.float32).state_dict()
        assert all(torch.equal(final[k], kept[k]) for k in final)


def test_grpo_unknown_keep_best_metric_fails_at_start_up(tiny_model_dir, tmp_path):
    reward = tmp_path / "r.py"
    reward.write_text(REWARD)
    out = tmp_path / "grpo"
    with pytest.raises(ConfigError, match=r"'eval_pass@4'.*eval_pass@1, eval_pass@2.*eval_reward"):
        _run(_grpo_raw(tiny_model_dir, out, reward, 1e-2, keep_best="eval_pass@4"))
    assert not (out / "metrics.jsonl").exists()  # before any step


DIGITS_ENV = """
from polyrl.agents.env import Environment, EnvStep


class DigitsEnv(Environment):
    def reset(self, example):
        self.turn = 0
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, message):
        self.turn += 1
        text = message.get("content") or ""
        return EnvStep([{"role": "user", "content": "Again."}], sum(c.isdigit() for c in text) / max(len(text), 1),
                       self.turn >= 2)
"""


def _agentic_raw(model_dir: Path, out: Path, env: str, lr: float, **train) -> dict:
    raw = _grpo_raw(model_dir, out, Path("unused.py"), lr, **train)
    raw["grpo"] = {
        "reward": "exact_match",
        "reward_workers": 0,
        "prompts_per_step": 2,
        "samples_per_prompt": 2,
        "max_new_tokens": 6,
        "eval_prompts": 4,
    }
    raw["train"]["eval_data"] = "builtin:arithmetic?max=9&n=8"
    raw["engine"]["micro_batch_tokens"] = 512
    raw["agent"] = {"env": env, "env_workers": 1, "max_turns": 2, "max_episode_tokens": 256}
    return raw


def test_agentic_eval_before_train_and_keep_best(tiny_model_dir, tmp_path):
    """Episodes share the mechanism: the step-0 row is the greedy episodes of the initial policy (the eval of a
    run whose one update changes nothing), and keep-best follows the episode eval reward."""
    import polyrl.agents  # noqa: F401  (registers the [agent] table)

    (tmp_path / "digits_env.py").write_text(DIGITS_ENV)
    env = f"{tmp_path / 'digits_env.py'}:DigitsEnv"
    out = tmp_path / "agentic"
    _run(_agentic_raw(tiny_model_dir, out, env, 5e-2, eval_before_train=True, keep_best="eval_reward"))
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1]
    ref = tmp_path / "ref"
    _run(_agentic_raw(tiny_model_dir, ref, env, 1e-30))
    (after,) = _rows(ref)
    evals = {k: v for k, v in after.items() if k.startswith("eval_")}
    assert "eval_reward" in evals and {k: rows[0][k] for k in evals} == evals
    best = json.loads((out / "best" / "best.json").read_text())
    r = {row["step"]: row["eval_reward"] for row in rows}
    want = 1 if r[1] > r[0] else 0
    assert best == {"metric": "eval_reward", "mode": "max", "value": r[want], "step": want}


def test_metrics_of_a_run_that_starts_over_keep_no_step_0_row(tmp_path):
    """A run resumed with no checkpoint yet starts at step 0 and evaluates before training again: the step-0 row
    of the attempt before is dropped (one step-0 row); a run resumed past step 0 keeps it."""
    import io

    from polyrl.train.metrics import MetricsLogger

    def logger(start: int) -> MetricsLogger:
        return MetricsLogger(tmp_path, 4, start_step=start, stream=io.StringIO(), report_to="none")

    log = logger(0)
    for step in (0, 1, 2):
        log.log({"step": step, "eval_loss": 1.0 / (step + 1)})
    log.close(print_table=False)
    assert [r["step"] for r in logger(1).history] == [0, 1]
    assert logger(0).history == [] and (tmp_path / "metrics.jsonl").read_text() == ""


def test_lora_keep_best_is_an_adapter_folder(tiny_model_dir, tmp_path):
    """A LoRA run's best is a PEFT adapter folder, like its final, with best.json of the lowest eval loss."""
    from polyrl.models.lora import is_adapter_dir

    out = tmp_path / "lora"
    raw = _sft_raw(tiny_model_dir, out, max_steps=2, keep_best="eval_loss")
    raw["lora"] = {"r": 4, "alpha": 8}
    _run(raw)
    best = json.loads((out / "best" / "best.json").read_text())
    assert is_adapter_dir(out / "best") and is_adapter_dir(out / "final")
    losses = {r["step"]: r["eval_loss"] for r in _rows(out) if "eval_loss" in r}
    assert best["value"] == min(losses.values()) and losses[best["step"]] == best["value"]


def test_eval_data_file_is_read_whatever_split_the_training_data_picks(tiny_model_dir, tmp_path):
    # data.split picks a split of the training data (a folder's train_sft.jsonl here, ultrachat's train_sft on the
    # hub); the SFT eval data kept it, and a single --eval-data file, which has no splits, was refused for it
    from polyrl.models.checkpoint import load_tokenizer
    from polyrl.run import config
    from polyrl.run.offline import eval_source

    row = '{"prompt": "1+1=", "completion": "2"}\n'
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train_sft.jsonl").write_text(row * 8)
    (tmp_path / "val.jsonl").write_text(row * 3)
    raw = _sft_raw(tiny_model_dir, tmp_path / "x", eval_data=str(tmp_path / "val.jsonl"))
    raw["data"] = {"path": str(tmp_path / "d"), "split": "train_sft"}
    cfg = config.build(raw)
    data = eval_source(cfg, cfg.spec, load_tokenizer(str(tiny_model_dir)))
    assert data.stats.rows == 3 and data.stats.bad_rows == 0


def test_eval_data_is_read_whole_when_the_training_data_holds_rows_out(tiny_model_dir, tmp_path):
    # data.holdout splits the training data; --eval-data took it too and evaluated on the eval file minus that
    # fraction (its "train" part): 2 of 4 rows here, silently. Both loops read the eval spec through eval_data_config.
    from polyrl.models.checkpoint import load_tokenizer
    from polyrl.run import config
    from polyrl.run.offline import eval_data_config, eval_source

    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n' * 8)
    (tmp_path / "val.jsonl").write_text("".join(f'{{"prompt": "{i}+1=", "completion": "{i + 1}"}}\n' for i in range(4)))
    raw = _sft_raw(tiny_model_dir, tmp_path / "x", eval_data=str(tmp_path / "val.jsonl"))
    raw["data"] = {"path": str(tmp_path / "d.jsonl"), "holdout": 0.5, "limit": 6}
    cfg = config.build(raw)
    data = eval_source(cfg, cfg.spec, load_tokenizer(str(tiny_model_dir)))
    assert data.stats.rows == 4 and data.stats.bad_rows == 0
    dcfg = eval_data_config(cfg)  # the online eval set's settings too
    assert (dcfg.path, dcfg.holdout, dcfg.limit, dcfg.split) == (str(tmp_path / "val.jsonl"), 0.0, None, None)
