"""``polyrl validate [LEVEL ...] [--levels a,b] [--json F] [--md F]``: run validation levels, print, write a report.

Levels come from ``polyrl.validate.LEVELS`` (today: ``ops``); each adds its own options, e.g.
``polyrl validate ops --dtypes fp32,bf16 --ops rmsnorm,rope --json report.json --md report.md``.
Exit code 0 when every chosen level passed, 1 when one failed, 2 for a usage error.
This module only parses, dispatches and writes files; the checks live in ``polyrl.validate``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform as _pyplatform
import time
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError
from polyrl.validate import LEVELS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("level", nargs="*", help=f"levels to run (default: all): {', '.join(LEVELS)}")
    parser.add_argument("--levels", default="", help="comma list of levels (same as the positional form)")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
    parser.add_argument("--md", metavar="FILE", help="write the report as Markdown")
    for module_name, _ in LEVELS.values():
        importlib.import_module(module_name).add_arguments(parser)


def _chosen(args: argparse.Namespace) -> list[str]:
    names = list(args.level) + [n.strip() for n in args.levels.split(",") if n.strip()]
    unknown = [n for n in names if n not in LEVELS]
    if unknown:
        raise ConfigError(f"unknown validation level(s) {unknown}; choose from {', '.join(LEVELS)}")
    return [n for n in LEVELS if n in names] if names else list(LEVELS)


def machine_summary() -> dict[str, Any]:
    """What ran the report: device, torch/triton versions, python (the platform level adds more)."""
    import torch

    from polyrl import __version__
    from polyrl.platform import device

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - absent or broken triton is a fact, not an error
        triton_version = None
    return {
        "polyrl": __version__,
        "device_type": device.device_type(),
        "device_name": device.name(),
        "device_count": device.count(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": _pyplatform.python_version(),
        "os": _pyplatform.platform(),
    }


def run(args: argparse.Namespace) -> int:
    names = _chosen(args)
    report: dict[str, Any] = {"schema": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    report["machine"] = machine_summary()
    report["levels"] = {}
    markdown = [f"# polyrl validation report\n\nMachine: `{json.dumps(report['machine'])}`\n"]
    show = getattr(args, "show", "all")
    for name in names:
        module = importlib.import_module(LEVELS[name][0])
        result = module.run_level(args)
        report["levels"][name] = result
        print(module.render_text(result, show))
        markdown.append(module.render_markdown(result, show))
    report["passed"] = all(r["passed"] for r in report["levels"].values())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text("\n".join(markdown))
        print(f"wrote {args.md}")
    print(f"validate: {'PASS' if report['passed'] else 'FAIL'} ({', '.join(names)})")
    return 0 if report["passed"] else 1
