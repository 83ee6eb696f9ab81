"""``polyrl check [--json] [--deep] [--snapshot FILE]``: OK / WARN / FAIL rows for the known install pitfalls, each
with a rule id and a next step. Exit 0 when ready (no FAIL), 1 when not. Plain check takes a few seconds (one
torch import in a subprocess); ``--deep`` also reads smi headers and runs a tensor op on the device."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from polyrl.errors import UserError
from polyrl.platform import pitfalls, probe, report, resolve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the versioned JSON document (schema polyrl.check/1)")
    parser.add_argument("--deep", action="store_true", help="also read smi headers and run a tensor op on the device")
    parser.add_argument(
        "--snapshot",
        metavar="FILE",
        help="judge a saved `polyrl env --json` output (or bare snapshot) instead of this machine",
    )


def load_snapshot(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read snapshot {path}: {exc}; give a file written by `polyrl env --json`") from exc
    snap = doc.get("snapshot", doc) if isinstance(doc, dict) else None
    if not isinstance(snap, dict) or "torch_runtime" not in snap:
        raise UserError(f"{path} holds no probe snapshot; give a file written by `polyrl env --json`")
    return snap


def run(args: argparse.Namespace) -> int:
    snap = load_snapshot(args.snapshot) if args.snapshot else probe.collect(deep=args.deep)
    res = resolve.resolve(snap)
    rows = pitfalls.evaluate(snap, res)
    doc = report.check_report(snap, res, rows)
    if args.json:
        print(report.to_json(doc))
    elif sys.stdout.isatty():
        report.print_check_rich(doc)
    else:
        sys.stdout.write(report.check_text(doc))
    return 0 if doc["ready"] else 1
