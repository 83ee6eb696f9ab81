"""A number that ``polyrl CMD --help`` gives as a default is the default: for every command (and ``bench`` NAME) the
argument's own default, for ``polyrl train`` (whose flags default to None and leave the key alone) the default of
the config key the flag sets, in a GRPO run and an SFT run."""

from __future__ import annotations

import argparse
import importlib
import json
import re

import pytest

import polyrl.agents  # noqa: F401 - registers the [agent] table into run, as the CLI does
from polyrl.cli import main as cli
from polyrl.cli import train
from polyrl.run import config as rc

NUMBER = re.compile(r"\(default:? (-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)(?=[\s;:,)])")


def _parser(name: str) -> argparse.ArgumentParser:
    parser = cli.Parser(prog=f"polyrl {name}")
    importlib.import_module(cli.COMMANDS[name][0]).add_arguments(parser)
    return parser


def _actions(parser: argparse.ArgumentParser, prog: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{prog} {name}")
        else:
            yield prog, action


def _said(action: argparse.Action) -> float | None:
    match = NUMBER.search(action.help or "")
    return float(match.group(1)) if match else None


def _config_default(cfg: rc.RunConfig, dest: str):
    if dest in train.FLAG_KEYS:
        obj = cfg
        for part in train.FLAG_KEYS[dest].split("."):
            obj = getattr(obj, part)
        return obj
    if dest in train.RL_FLAG_KEYS:
        return getattr(cfg.algo_config, train.RL_FLAG_KEYS[dest])
    raise KeyError(dest)


def _check(name: str) -> tuple[list[str], int]:
    """(disagreements, numbers checked) of one command's help."""
    wrong, seen = [], 0
    for prog, action in _actions(_parser(name), f"polyrl {name}"):
        said = _said(action)
        if said is None or action.default is None:  # None: resolved when the command runs (validate's --quick)
            continue
        seen += 1
        if not isinstance(action.default, (int, float)) or float(action.default) != said:
            wrong.append(f"{prog} {action.option_strings}: help says default {said:g}, argparse has {action.default!r}")
    return wrong, seen


@pytest.mark.parametrize("name", [n for n in cli.COMMANDS if n != "train"])
def test_numeric_defaults_in_help_are_the_arguments_defaults(name):
    wrong, _ = _check(name)
    assert not wrong, "\n".join(wrong)


def test_the_scan_finds_numeric_defaults():
    assert _check("serve")[1] >= 3
    assert _said(argparse.Action(["--x"], "x", help="(default 127.0.0.1)")) is None
    assert _said(argparse.Action(["--x"], "x", help="rate (default 2e-3, for random weights)")) == 0.002


def test_numeric_defaults_in_train_help_are_the_configs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    base = {"model": str(tmp_path), "out": str(tmp_path / "out"), "data": {"path": "builtin:arithmetic"}}
    cfgs = [rc.build({**base, "algo": algo}) for algo in ("grpo", "sft")]
    wrong, seen = [], 0
    for _, action in _actions(_parser("train"), "polyrl train"):
        said = _said(action)
        if said is None or action.dest == "epochs":  # epochs: unset means one pass
            continue
        seen += 1
        for cfg in cfgs:
            if action.dest in train.RL_FLAG_KEYS and not hasattr(cfg.algo_config, "max_staleness"):
                continue  # an RL flag: the SFT config has no such key
            value = _config_default(cfg, action.dest)
            if not isinstance(value, (int, float)) or float(value) != said:
                wrong.append(f"{action.option_strings} ({cfg.algo}): help says default {said:g}, config has {value!r}")
    assert seen >= 6, seen
    assert not wrong, "\n".join(wrong)
