"""``polyrl validate [LEVEL ...] [--levels a,b] [--model DIR | --preset tiny] [--out DIR] [--quick]``.

Runs the chosen levels of ``polyrl.validate.LEVELS`` (default: all, in registry order), prints each, and
writes ``report.json`` (schema ``polyrl.validate/1``), ``report.md`` and ``matrix_row.json`` into ``--out``
(``--json FILE`` / ``--md FILE`` write single files too). Each level reports passed / failed / skipped with a
reason; an unexpected error inside a level fails that level and the run goes on. Exit 0 when no level
failed, 1 when one did, 2 for a usage error. Examples::
    polyrl validate --preset tiny --out runs/validate                  # everything this machine can do
    polyrl validate --levels platform,ops,sft --quick                  # the CI subset
    polyrl validate ops --dtypes fp32,bf16 --ops rmsnorm --sizes large # one level, its own options

This module parses, dispatches and writes files; the checks live in ``polyrl.validate``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from polyrl.errors import ConfigError, UserError
from polyrl.validate import LEVELS, environment, markdown, model_source, report
from polyrl.validate import result as res


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("level", nargs="*", help=f"levels to run (default: all): {', '.join(LEVELS)}")
    parser.add_argument("--levels", default="", help="comma list of levels (same as the positional form)")
    parser.add_argument("--out", metavar="DIR", help="write report.json, report.md and matrix_row.json here")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    parser.add_argument("--md", metavar="FILE", help="also write the report as Markdown to FILE")
    model_source.add_arguments(parser)
    for module_name, _ in LEVELS.values():
        importlib.import_module(module_name).add_arguments(parser)
    parser.add_argument("--ops-sizes", dest="sizes", help="alias of --sizes (ops level)")


def _chosen(args: argparse.Namespace) -> list[str]:
    names = list(args.level) + [n.strip() for n in args.levels.split(",") if n.strip()]
    unknown = [n for n in names if n not in LEVELS]
    if unknown:
        raise ConfigError(f"unknown validation level(s) {unknown}; choose from {', '.join(LEVELS)}")
    return [n for n in LEVELS if n in names] if names else list(LEVELS)


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one level; skips and unexpected errors become results, user errors propagate (exit 2)."""

    module = importlib.import_module(LEVELS[name][0])
    t0 = time.perf_counter()
    try:
        out = module.run_level(args)
    except res.LevelSkipped as exc:
        out = res.skipped(name, str(exc))
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - one broken level must not hide the others' results
        if os.environ.get("POLYRL_DEBUG") == "1":
            traceback.print_exc()
        out = res.errored(name, exc)
    out["time_s"] = time.perf_counter() - t0
    for key, default in (("reason", ""), ("metrics", {}), ("checks", []), ("notes", [])):
        out.setdefault(key, default)
    return out


def _render_text(name: str, result: dict[str, Any], show: str) -> str:
    module = importlib.import_module(LEVELS[name][0])
    if result["status"] != "skipped" and hasattr(module, "render_text"):
        return module.render_text(result, show) + f"\n{res.headline(result)}"
    return res.render_text(result, show)


def _options(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    return {
        "levels": names,
        "model": model_source.describe(args),
        "task": args.task,
        "quick": bool(args.quick),
        "collectives_cpu_procs": args.collectives_cpu_procs,
        "ops_sizes": args.sizes or "default",
    }


def _write(path: str | Path, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    print(f"wrote {path}")


def run(args: argparse.Namespace) -> int:
    names = _chosen(args)
    model_source.check(args, names)  # --model / --preset / --task mistakes before the first level runs
    if not args.sizes and not args.quick and len(names) > 1:
        args.sizes = "tiny,small"  # the full validate keeps the sweep short; --sizes large for real widths
    show = getattr(args, "show", "all")
    env = environment.collect()
    levels: dict[str, dict[str, Any]] = {}
    for name in names:
        print(f"== {name}: {LEVELS[name][1]}", flush=True)
        levels[name] = run_one(name, args)
        print(_render_text(name, levels[name], show), flush=True)
    doc = report.build(levels, env, _options(args, names), list(LEVELS))
    problems = report.validate(doc)
    if problems:  # a bug here, not the user's: say so loudly but still write what we have
        print(f"warning: the report does not follow {report.SCHEMA}: {problems}")
    text = json.dumps(doc, indent=1, default=str) + "\n"
    md = markdown.render(doc)
    if args.out:
        out = Path(args.out)
        _write(out / "report.json", text)
        _write(out / "report.md", md)
        _write(out / "matrix_row.json", json.dumps(doc["matrix_row"]) + "\n")
        print(f"copy {out / 'report.json'} to compat/{report.file_name(doc)} to add it to the matrix")
    if args.json:
        _write(args.json, text)
    if args.md:
        _write(args.md, md)
    statuses = ", ".join(f"{n} {r['status']}" for n, r in levels.items())
    print(f"validate: {'PASS' if doc['passed'] else 'FAIL'} ({statuses})")
    return 0 if doc["passed"] else 1
