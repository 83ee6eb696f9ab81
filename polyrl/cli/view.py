"""``polyrl view RUN_DIR [--out FILE.html] [--serve [--port P]]``: the run viewer.

Writes one self-contained HTML page (default ``RUN_DIR/viewer.html``): curves of the run's metrics and a browser of
the rollouts and agent episodes it sampled (``rollouts.jsonl``). ``--serve`` serves the page on localhost instead
(re-rendered per request: a reload shows a live run's new steps) until Ctrl-C. A thin wrapper over
``polyrl.run.viewer``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from polyrl.errors import ConfigError
from polyrl.run.config import nearest_existing
from polyrl.run.viewer import MAX_ROLLOUT_STEPS, RUN_FILES, serve, write_page


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's --out directory (metrics.jsonl, rollouts.jsonl)")
    parser.add_argument("--out", default=None, help="the HTML file to write (default RUN_DIR/viewer.html)")
    parser.add_argument("--serve", action="store_true", help="serve the page on localhost until Ctrl-C")
    parser.add_argument("--port", type=int, default=8765, help="--serve's port (default 8765; 0 = any free one)")
    parser.add_argument("--host", default="127.0.0.1", help="--serve's address (default 127.0.0.1: this machine)")
    parser.add_argument(
        "--rollout-steps",
        type=int,
        default=MAX_ROLLOUT_STEPS,
        help=f"at most this many steps of rollouts in the page, evenly spaced (default {MAX_ROLLOUT_STEPS})",
    )


# what names a parent folder as the run directory around the given one: files only a polyrl run writes under these
# names (a summary.json, which many tools write, or a rollouts.jsonl could be anyone's, and would name a wrong folder)
PARENT_MARKERS = ("run_config.json", "metrics.jsonl")


def check_run_dir(run_dir: str) -> None:
    """Refuse what is not a run directory, saying which folder to give instead: a missing path, a file, or a folder
    inside a run (``OUT/final``, ``OUT/checkpoints/step-N``) whose run directory is a parent (one holding
    ``PARENT_MARKERS``)."""
    path = Path(run_dir)
    existing, blocked = nearest_existing(Path(os.path.abspath(path)))
    if blocked is not None:  # Path.exists raises there (PermissionError) instead of saying False
        raise ConfigError(
            f"{run_dir} cannot be reached: {existing} may not be entered ({blocked.strerror or blocked}); give a run "
            "directory you can read"
        )
    if not path.exists():
        raise ConfigError(
            f"{run_dir} does not exist; give the --out directory of a polyrl train run (it holds metrics.jsonl)"
        )
    if not path.is_dir():
        raise ConfigError(
            f"{run_dir} is a file; give the --out directory of a polyrl train run, the folder that holds metrics.jsonl"
        )
    if any((path / name).exists() for name in RUN_FILES):
        return
    # the parents on disk, not in the spelling: `polyrl view .` inside runs/sft/final has no parents as written
    for parent in Path(os.path.abspath(path)).parents:
        if any((parent / name).is_file() for name in PARENT_MARKERS):
            shown = parent if path.is_absolute() else os.path.relpath(parent)
            raise ConfigError(f"{run_dir} is a folder inside the run directory {shown}; run `polyrl view {shown}`")


def run(args: argparse.Namespace) -> int:
    check_run_dir(args.run_dir)
    if args.serve:
        serve(args.run_dir, args.port, args.host, args.rollout_steps)
        return 0
    path = write_page(args.run_dir, args.out, args.rollout_steps)
    print(f"wrote {path} (open it in a browser)")
    return 0
