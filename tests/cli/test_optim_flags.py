"""``polyrl train --optim / --optim-offload`` name ``optim.name`` / ``optim.offload``; bad values stop at parsing."""

from __future__ import annotations

import argparse

import pytest

from polyrl.cli import train
from polyrl.errors import ConfigError
from polyrl.run.config import resolve


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser.parse_args(argv)


def test_optim_flags_reach_the_resolved_config(tiny_model_dir):
    m = str(tiny_model_dir)
    args = _parse(
        ["--model", m, "--out", "o", "--data", "builtin:arithmetic", "--optim", "adamw8bit", "--optim-offload", "cpu"]
    )
    keys = dict(train.overrides_from_args(args))
    assert keys["optim.name"] == "adamw8bit" and keys["optim.offload"] == "cpu"
    cfg = resolve(None, train.overrides_from_args(args))
    assert cfg.optim.name == "adamw8bit" and cfg.optim.offload == "cpu"
    default = resolve(
        None, train.overrides_from_args(_parse(["--model", m, "--out", "o", "--data", "builtin:arithmetic"]))
    )
    assert default.optim.name == "adamw" and default.optim.offload == "none"
    # relaunching under torchrun keeps them
    assert dict(train.overrides_from_args(_parse(train.relaunch_argv(args))))["optim.name"] == "adamw8bit"


def test_bad_optim_values(tiny_model_dir):
    with pytest.raises(SystemExit):
        _parse(["--optim", "adam8"])
    with pytest.raises(ConfigError, match="leave optim.impl = auto"):
        resolve(
            None,
            [
                ("model", str(tiny_model_dir)),
                ("out", "o"),
                ("data.path", "x"),
                ("optim.name", "adamw8bit"),
                ("optim.impl", "fused"),
            ],
        )
