"""``polyrl bench NAME``: our engine and named baselines in one run, printed as ratios.

Benchmarks are registered in ``polyrl.bench.BENCHES``; each module has ``add_arguments`` and ``run``.
"""

from __future__ import annotations

import argparse
import importlib

from polyrl.bench import BENCHES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, (module_name, help_text) in BENCHES.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_bench_module=module_name)
        try:
            importlib.import_module(module_name).add_arguments(p)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            p.set_defaults(_bench_missing=True)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "_bench_missing", False):
        print(f"polyrl bench {args.bench}: not available in this build.")
        return 2
    return int(importlib.import_module(args._bench_module).run(args) or 0)
