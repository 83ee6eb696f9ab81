"""``polyrl env [--json]``: describe this machine -- platform and evidence, torch build, devices, vendor packages,
Triton providers, collective backends and the relevant variables. Describes only; ``polyrl check`` judges."""

from __future__ import annotations

import argparse
import sys

from polyrl.platform import probe, report, resolve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the versioned JSON document (schema polyrl.env/1)")
    parser.add_argument("--deep", action="store_true", help="also read smi headers and run a tensor op on the device")


def run(args: argparse.Namespace) -> int:
    snap = probe.collect(deep=args.deep)
    doc = report.env_report(snap, resolve.resolve(snap))
    if args.json:
        print(report.to_json(doc))
    elif sys.stdout.isatty():
        report.print_env_rich(doc)
    else:
        sys.stdout.write(report.env_text(doc))
    return 0
