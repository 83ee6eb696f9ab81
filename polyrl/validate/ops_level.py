"""The ``ops`` level's interface to ``polyrl validate``: its options, its run, its text and Markdown tables.

A level module provides ``add_arguments(parser)`` (options that do not clash with other levels'),
``run_level(args) -> dict`` (JSON-able: ``level``, ``passed``, ``summary``, ``rows``, ``notes``),
``render_text(result)`` and ``render_markdown(result)``. The sweep itself is ``polyrl.validate.ops``.
"""

from __future__ import annotations

import argparse
from typing import Any

from polyrl.errors import ConfigError

COLUMNS = ("op", "impl", "dtype", "shape", "check", "max_abs", "rel_l2", "tol_rel_l2", "finite", "status")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ops level")
    group.add_argument("--dtypes", default="fp32,fp16,bf16", help="comma list of fp32,fp16,bf16 (default: all)")
    group.add_argument("--ops", default="", help="comma list of ops (default: all; e.g. rmsnorm,rope,silu,linear)")
    group.add_argument(
        "--sizes",
        default="",
        help="comma list of tiny,small,large shape sets (default: tiny,small; large: real widths, for devices)",
    )
    group.add_argument("--show", choices=("all", "failures"), default="all", help="rows to print (default: all)")


def _split(text: str) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def run_level(args: argparse.Namespace) -> dict[str, Any]:
    # lazy: torch loads only when the level runs (the validate CLI imports every level module for its parser)
    from polyrl.validate import ops

    sizes = tuple(_split(getattr(args, "sizes", ""))) or (("tiny",) if getattr(args, "quick", False) else None)
    if sizes and any(s not in ops.SIZES for s in sizes):
        raise ConfigError(f"--sizes takes a comma list of {', '.join(ops.SIZES)}, got {args.sizes!r}")
    rows = ops.run_sweep(
        dtypes=_split(args.dtypes), ops=_split(args.ops) or None, sizes=sizes, progress=ops.print_progress
    )
    summary = ops.summarize(rows)
    notes = []
    if not ops.interpreter_active():
        notes.append("Triton implementations on CPU need TRITON_INTERPRET=1 (set before start) to run.")
    passed = summary.get("fail", 0) == 0 and summary.get("error", 0) == 0
    bad = [f"{r['op']}/{r['impl']}/{r['dtype']} {r['check']}" for r in rows if r["status"] in ("fail", "error")]
    return {
        "level": "ops",
        "status": "passed" if passed else "failed",
        "passed": passed,
        "reason": "" if passed else f"{len(bad)} failing row(s), e.g. {', '.join(bad[:3])}",
        "summary": summary,
        "metrics": {"sizes": list(sizes) if sizes else "default", "representative": representative(rows)},
        "rows": rows,
        "notes": notes,
    }


def representative(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (op, implementation, dtype) that ran: worst relative L2 and max abs diff over its shapes
    and checks (outputs and gradients), how many checks, whether all were finite, and the verdict."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r["status"] in ("pass", "fail", "error", "info"):
            groups.setdefault((r["op"], r["impl"], r["dtype"]), []).append(r)
    out = []
    for (op, impl, dtype), rs in groups.items():
        measured = [r for r in rs if r.get("rel_l2") is not None]
        grads = [r for r in measured if str(r["check"]).startswith("grad:")]
        statuses = {r["status"] for r in rs}
        out.append(
            {
                "op": op,
                "impl": impl,
                "dtype": dtype,
                "checks": len(rs),
                "max_rel_l2": max((r["rel_l2"] for r in measured), default=None),
                "max_abs": max((r["max_abs"] for r in measured), default=None),
                "grad_max_rel_l2": max((r["rel_l2"] for r in grads), default=None),
                "finite": all(r.get("finite") is not False for r in rs),
                "status": "info" if statuses == {"info"} else ("pass" if statuses <= {"pass", "info"} else "fail"),
                "note": rs[0].get("reason", "") if op == "matmul_tf32" else "",
            }
        )
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return "0" if value == 0.0 else f"{value:.2e}"
    return str(value)


def _visible(result: dict[str, Any], show: str) -> list[dict[str, Any]]:
    rows = result.get("rows", [])  # none when the level failed before checking anything (see "reason")
    if show == "failures":
        rows = [r for r in rows if r["status"] in ("fail", "error")]
    return rows


def _summary_line(result: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {k}" for k, n in sorted(result.get("summary", {}).items()))
    line = f"ops: {'PASS' if result['passed'] else 'FAIL'} ({counts})"
    if not result.get("rows") and result.get("reason"):
        line += f": {result['reason']}"
    return line


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


def table_markdown(result: dict[str, Any], show: str = "all") -> list[str]:
    """The sweep's rows as Markdown table lines."""
    cols = COLUMNS + ("reason",)
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in _visible(result, show):
        cells = [_fmt(r.get(c)).replace("|", "\\|") if c != "reason" else (r.get("reason") or "") for c in cols]
        out.append("| " + " | ".join(cells) + " |")
    return out


def render_markdown(result: dict[str, Any], show: str = "all") -> str:
    out = ["## Ops: implementations vs references", "", _summary_line(result), ""]
    out += table_markdown(result, show)
    for note in result.get("notes", []):
        out += ["", f"_{note}_"]
    return "\n".join(out) + "\n"
