"""``polyrl.trainer.fit``: every algorithm through the Python API, the same run as ``polyrl train`` (outputs,
summary, metrics), with tables given as dicts or config dataclasses, and errors that name the setting."""

from __future__ import annotations

import json

import pytest

from polyrl.errors import ConfigError
from polyrl.train import OptimConfig
from polyrl.trainer import fit


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_dpo_through_fit_raises_the_reward_margin(tiny_model_dir, tmp_path):
    out = tmp_path / "dpo"
    summary = fit(
        "dpo",
        model=tiny_model_dir,
        data={"path": "builtin:arithmetic-pref?max=9&n=32", "max_seq_len": 64},
        out=out,
        optim=OptimConfig(lr=2e-3, weight_decay=0.0),  # a dataclass works as well as a dict
        engine={"micro_batch_tokens": 512},
        schedule={"decay": "constant"},
        train={"max_steps": 8, "log_every": 100, "save_final_model": False},
        dpo={"beta": 0.5},
    )
    recs = _records(out)
    assert summary["status"] == "finished" and summary["algo"] == "dpo" and len(recs) == 8
    assert recs[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # log 2 at the reference
    assert sum(r["rewards/margins"] for r in recs[-3:]) / 3 > 0.1 and recs[-1]["loss"] < 0.6


def test_ppo_through_fit_trains_critic_then_policy(tiny_model_dir, tmp_path):
    out = tmp_path / "ppo"
    summary = fit(
        "ppo",
        model=str(tiny_model_dir),
        data="builtin:arithmetic?max=9&n=64",
        out=out,
        seed=3,
        optim={"lr": 2e-3},
        train={"max_steps": 3, "log_every": 100},
        ppo={"reward": "exact_match", "reward_workers": 0, "prompts_per_step": 2, "samples_per_prompt": 2,
             "max_new_tokens": 4, "critic_warmup_steps": 1},
    )  # fmt: skip
    recs = _records(out)
    assert summary["status"] == "finished" and summary["algo"] == "ppo"
    assert [r["policy_updated"] for r in recs] == [0.0, 1.0, 1.0]
    assert all("value_loss" in r for r in recs) and (out / "critic" / "final" / "config.json").is_file()
    assert json.loads((out / "run_config.json").read_text())["seed"] == 3


def test_fit_errors_name_the_setting(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="unknown setting"):
        fit("sft", model=tiny_model_dir, data="builtin:arithmetic", out=tmp_path / "a", optimizer={"lr": 1})
    with pytest.raises(ConfigError, match="must be a dict or a config dataclass"):
        fit("sft", model=tiny_model_dir, data="builtin:arithmetic", out=tmp_path / "b", optim=0.1)
    with pytest.raises(ConfigError, match="grpo.temperature"):
        fit("grpo", model=tiny_model_dir, data="builtin:arithmetic", out=tmp_path / "c", grpo={"temperature": 0})


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"algo": "SFT"}, "unknown algorithm 'SFT' (did you mean sft?)"),
        ({"algo": "dpoo"}, "unknown algorithm 'dpoo' (did you mean dpo?)"),
        ({"model": None}, "fit(model=...) must be a folder path (str or Path), got None"),
        ({"out": None}, "fit(out=...) must be a folder path (str or Path), got None"),
        ({"data": 3}, "fit(data=...) cannot be of type int; give a data spec"),
        ({"data": []}, "fit(data=...) got no rows"),
        ({"data": [{"prompt": "q", "completion": "a"}, "x"]}, "row 2 is a str; each row must be a dict"),
        ({"max_steps": 3}, "max_steps is a setting of the train table: pass train={'max_steps': 3}"),
        ({"learning_rate": 1e-3}, "lr is a setting of the optim table: pass optim={'lr': 0.001}"),
        ({"train": OptimConfig()}, "fit(train=OptimConfig(...)): the train table is a LoopConfig; pass the "
                                   "OptimConfig as optim=..."),
    ],
)  # fmt: skip
def test_fit_argument_mistakes_name_the_fix(tiny_model_dir, tmp_path, kwargs, problem):
    args = {"algo": "sft", "model": tiny_model_dir, "data": "builtin:arithmetic", "out": tmp_path / "run", **kwargs}
    with pytest.raises(ConfigError) as err:
        fit(args.pop("algo"), **args)
    assert problem in str(err.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


ROWS = [{"prompt": f"What is {i} + 1?", "completion": str(i + 1)} for i in range(6)]
QUICK = {
    "engine": {"micro_batch_tokens": 256},
    "train": {"max_steps": 1, "log_every": 100, "save_final_model": False},
}


def test_rows_in_memory_are_the_data_and_the_summary_is_summary_json(tiny_model_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "rows"
    summary = fit("sft", model=tiny_model_dir, data=ROWS, out=out, **QUICK)
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["data_sequences"] == len(ROWS)
    (written,) = out.glob("data-*.jsonl")
    assert [json.loads(line) for line in written.read_text().splitlines()] == ROWS
    assert json.loads((out / "run_config.json").read_text())["data"]["path"] == str(written)
    # a datasets.Dataset of the same rows is the same file (named by content), read on resume
    again = fit("sft", model=tiny_model_dir, data=datasets.Dataset.from_list(ROWS), out=out, resume="latest",
                **{**QUICK, "train": {**QUICK["train"], "max_steps": 2}})  # fmt: skip
    assert again["steps"] == 2 and again["resumed_from_step"] == 1 and len(list(out.glob("data-*.jsonl"))) == 1
    with pytest.raises(ConfigError, match=r"DatasetDict of splits; pick one, e.g. data=ds\['train'\]"):
        fit("sft", model=tiny_model_dir, data=datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS)), out=out)


def test_rows_for_an_out_that_cannot_be_entered_or_is_a_file_name_it(tiny_model_dir, tmp_path, unenterable_dir):
    # fit() writes in-memory rows under out before the config check: its own probe of out was a PermissionError
    # traceback under a folder the user may not enter (check_writable_dir, which says so, came after it)
    with pytest.raises(ConfigError, match=r"--out .* cannot be reached: .*locked may not be entered"):
        fit("sft", model=tiny_model_dir, data=ROWS, out=unenterable_dir / "run")
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="is a file; the run directory must be a folder"):
        fit("sft", model=tiny_model_dir, data=ROWS, out=tmp_path / "f")


def test_arguments_override_the_config_file_key_by_key(tiny_model_dir, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        'algo = "dpo"\nmodel = "/nowhere"\nout = "/nowhere"\n'
        "[optim]\nlr = 0.5\nweight_decay = 0.0\n[train]\nmax_steps = 5\n[data]\nmax_seq_len = 96\n"
    )
    out = tmp_path / "over"
    fit("sft", model=tiny_model_dir, data="builtin:arithmetic?n=8", out=out, config=config, optim={"lr": 1e-3},
        **QUICK)  # fmt: skip
    resolved = json.loads((out / "run_config.json").read_text())
    assert (resolved["algo"], resolved["model"], resolved["out"]) == ("sft", str(tiny_model_dir), str(out))
    assert resolved["optim"]["lr"] == 1e-3 and resolved["optim"]["weight_decay"] == 0.0  # the file's other keys stay
    assert resolved["train"]["max_steps"] == 1 and resolved["data"]["max_seq_len"] == 96
    assert resolved["data"]["path"] == "builtin:arithmetic?n=8"
