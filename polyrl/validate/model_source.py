"""The model the end-to-end levels (sft, rl, serve) run on: ``--model DIR`` or ``--preset NAME`` (default tiny).

A preset is written once per validation run with ``create_model_from_preset`` (random weights, polyrl's own
ChatML tokenizer) into a temporary folder that lives until the process exits, so every level starts from
the same weights. Also the shared options of those levels (``--model``, ``--preset``, ``--task``,
``--quick``). Not here: training or serving.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError

DEFAULT_TASK = "builtin:arithmetic?max=20"
_CREATED: dict[tuple[str, int], Path] = {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model for the sft, rl and serve levels")
    group.add_argument("--model", metavar="DIR", default=None, help="HF model folder (default: --preset)")
    group.add_argument("--preset", default="tiny", help="random-weights model preset when no --model (default tiny)")
    group.add_argument("--task", default=DEFAULT_TASK, help=f"builtin task for sft and rl (default {DEFAULT_TASK})")
    group.add_argument("--seed", type=int, default=0, help="seed for the model, data and sampling (default 0)")
    group.add_argument("--quick", action="store_true", help="fewer ops cases and training steps (CI)")


# the levels that run on the model (--model / --preset) and those that also read --task
MODEL_LEVELS = ("sft", "rl", "serve", "eval")
TASK_LEVELS = ("sft", "rl")


def _model_folder(model: str) -> Path:
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {model}: no config.json there; give an HF model folder or use --preset tiny")
    return path


def check(args: argparse.Namespace, levels: list[str]) -> None:
    """``--model`` / ``--preset`` and ``--task`` errors (a UserError each) before the first level runs, so that a typo
    does not surface only at the sft level, after the ops sweep, with no report written."""
    if not set(levels) & set(MODEL_LEVELS):
        return
    if getattr(args, "model", None):
        _model_folder(args.model)
    else:
        # lazy: torch and polyrl.models load only when a level runs (the validate CLI imports this for its parser)
        from polyrl.models.presets import get_preset

        get_preset(getattr(args, "preset", "tiny") or "tiny")  # unknown names: a UserError listing the presets
    if set(levels) & set(TASK_LEVELS):
        # lazy: polyrl.data loads only when a level that reads --task is chosen
        from polyrl.data import DataConfig

        DataConfig(path=args.task, seed=args.seed)  # an unknown builtin or a missing file


def model_dir(args: argparse.Namespace) -> Path:
    """The folder of the model to validate (creating the preset on first use)."""
    model = getattr(args, "model", None)
    if model:
        return _model_folder(model)
    preset, seed = getattr(args, "preset", "tiny") or "tiny", int(getattr(args, "seed", 0))
    key = (preset, seed)
    if key not in _CREATED:
        # lazy: torch and polyrl.models load only when a level runs (the validate CLI imports this for its parser)
        from polyrl.models.presets import create_model_from_preset, get_preset

        get_preset(preset)  # unknown names: a UserError listing the presets
        root = Path(tempfile.mkdtemp(prefix="polyrl-validate-"))
        atexit.register(shutil.rmtree, root, True)
        _CREATED[key] = create_model_from_preset(preset, root / preset, seed=seed)
    return _CREATED[key]


def describe(args: argparse.Namespace) -> str:
    if getattr(args, "model", None):
        return f"model {args.model}"
    return f"preset {getattr(args, 'preset', 'tiny')} (random weights)"


def load(args: argparse.Namespace, dtype: Any = None) -> tuple[Any, Any, Path]:
    """(DecoderLM on the validation device, tokenizer, folder); fp32 weights unless ``dtype``."""
    # lazy: torch and polyrl.models load only when a level runs (the validate CLI imports this for its parser)
    import torch

    from polyrl.models.checkpoint import load_model, load_tokenizer
    from polyrl.platform import device

    path = model_dir(args)
    model = load_model(path, dtype=dtype or torch.float32, device=device.torch_device())
    return model, load_tokenizer(path), path
