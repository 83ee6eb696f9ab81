"""The ``ops`` level's interface to ``polyrl validate``: its options, its run, its text and Markdown tables.

A level module provides ``add_arguments(parser)`` (options that do not clash with other levels'),
``run_level(args) -> dict`` (JSON-able: ``level``, ``passed``, ``summary``, ``rows``, ``notes``),
``render_text(result)`` and ``render_markdown(result)``. The sweep itself is ``polyrl.validate.ops``.
"""

from __future__ import annotations

import argparse
from typing import Any

COLUMNS = ("op", "impl", "dtype", "shape", "check", "max_abs", "rel_l2", "tol_rel_l2", "finite", "status")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ops level")
    group.add_argument("--dtypes", default="fp32,fp16,bf16", help="comma list of fp32,fp16,bf16 (default: all)")
    group.add_argument("--ops", default="", help="comma list of ops (default: all; e.g. rmsnorm,rope,silu,linear)")
    group.add_argument(
        "--sizes",
        default="",
        help="comma list of tiny,small,large shape sets (default: tiny,small on CPU, all on an accelerator)",
    )
    group.add_argument("--show", choices=("all", "failures"), default="all", help="rows to print (default: all)")


def _split(text: str) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def run_level(args: argparse.Namespace) -> dict[str, Any]:
    from polyrl.errors import ConfigError
    from polyrl.validate import ops

    sizes = tuple(_split(getattr(args, "sizes", ""))) or None
    if sizes and any(s not in ops.SIZES for s in sizes):
        raise ConfigError(f"--sizes takes a comma list of {', '.join(ops.SIZES)}, got {args.sizes!r}")
    rows = ops.run_sweep(dtypes=_split(args.dtypes), ops=_split(args.ops) or None, sizes=sizes)
    summary = ops.summarize(rows)
    notes = []
    if not ops.interpreter_active():
        notes.append("Triton implementations on CPU need TRITON_INTERPRET=1 (set before start) to run.")
    return {
        "level": "ops",
        "passed": summary.get("fail", 0) == 0 and summary.get("error", 0) == 0,
        "summary": summary,
        "rows": rows,
        "notes": notes,
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return "0" if value == 0.0 else f"{value:.2e}"
    return str(value)


def _visible(result: dict[str, Any], show: str) -> list[dict[str, Any]]:
    rows = result["rows"]
    if show == "failures":
        rows = [r for r in rows if r["status"] in ("fail", "error")]
    return rows


def _summary_line(result: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {k}" for k, n in sorted(result["summary"].items()))
    return f"ops: {'PASS' if result['passed'] else 'FAIL'} ({counts})"


def render_text(result: dict[str, Any], show: str = "all") -> str:
    rows = _visible(result, show)
    table = [list(COLUMNS)] + [[_fmt(r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        if r.get("reason"):
            lines.append(f"  {r['op']}/{r['impl']}/{r['dtype']} {r['shape']}: {r['reason']}")
    lines += result.get("notes", []) + [_summary_line(result)]
    return "\n".join(lines)


def render_markdown(result: dict[str, Any], show: str = "all") -> str:
    rows = _visible(result, show)
    cols = COLUMNS + ("reason",)
    out = ["## Ops: implementations vs references", "", _summary_line(result), ""]
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "---|" * len(cols))
    for r in rows:
        cells = [_fmt(r.get(c)).replace("|", "\\|") if c != "reason" else (r.get("reason") or "") for c in cols]
        out.append("| " + " | ".join(cells) + " |")
    for note in result.get("notes", []):
        out += ["", f"_{note}_"]
    return "\n".join(out) + "\n"
