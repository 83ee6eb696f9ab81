"""The result every validation level returns, and its generic text / Markdown rendering.

A level's ``run_level(args)`` returns a JSON-able dict made with ``level_result``: ``level``, ``status``
(``passed`` / ``failed`` / ``skipped``), ``passed`` (False only when failed), ``reason`` (why it failed or
was skipped), ``metrics`` (name -> number or short text), ``checks`` (named assertions with the measured
value, the limit it was held to and pass/fail/info), ``notes``; the CLI adds ``time_s``. A level that cannot
run here (one device, a missing package) raises ``LevelSkipped(reason)``.

Not here: the levels themselves, the report file (``report.py``), the ops table (``ops_level.py``).
"""

from __future__ import annotations

from typing import Any

STATUSES = ("passed", "failed", "skipped")


class LevelSkipped(Exception):
    """Raised by a level that cannot run on this machine; the message is the reason the report shows."""


def check(name: str, ok: bool | None, value: Any, limit: str = "", detail: str = "") -> dict[str, Any]:
    """One named assertion: ``ok`` True = pass, False = fail, None = informational (never fails the level)."""
    status = "info" if ok is None else ("pass" if ok else "fail")
    return {"name": name, "status": status, "value": value, "limit": limit, "detail": detail}


def level_result(
    level: str,
    checks: list[dict[str, Any]],
    metrics: dict[str, Any] | None = None,
    notes: list[str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A passed/failed result from its checks (failed when any check failed; the reason names them)."""
    failed = [c["name"] for c in checks if c["status"] == "fail"]
    result = {
        "level": level,
        "status": "failed" if failed else "passed",
        "passed": not failed,
        "reason": f"failed checks: {', '.join(failed)}" if failed else "",
        "metrics": metrics or {},
        "checks": checks,
        "notes": notes or [],
    }
    result.update(extra)
    return result


def skipped(level: str, reason: str) -> dict[str, Any]:
    return {"level": level, "status": "skipped", "passed": True, "reason": reason, "metrics": {}, "checks": []}


def errored(level: str, exc: BaseException) -> dict[str, Any]:
    """A level that raised an unexpected error: failed, with the error as the reason."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    return {"level": level, "status": "failed", "passed": False, "reason": text, "metrics": {}, "checks": []}


def fmt(value: Any) -> str:
    """Numbers as a report shows them: 3 significant digits, scientific below 1e-3, ints as they are."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value == 0.0:
            return "0"
        if abs(value) < 1e-3 or abs(value) >= 1e6:
            return f"{value:.2e}"
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt(v) for v in value)
    return str(value)


def headline(result: dict[str, Any]) -> str:
    """``sft: PASSED (12.3 s)`` or ``serve: SKIPPED -- <reason>``."""
    t = result.get("time_s")
    took = f" ({t:.1f} s)" if isinstance(t, (int, float)) else ""
    reason = f" -- {result['reason']}" if result.get("reason") else ""
    return f"{result['level']}: {result['status'].upper()}{took}{reason}"


def render_text(result: dict[str, Any], show: str = "all") -> str:
    lines = [headline(result)]
    for c in result.get("checks", []):
        limit = f" (limit {c['limit']})" if c.get("limit") else ""
        detail = f" -- {c['detail']}" if c.get("detail") else ""
        lines.append(f"  {c['status'].upper():4}  {c['name']}: {fmt(c['value'])}{limit}{detail}")
    for key, value in result.get("metrics", {}).items():
        if not isinstance(value, (dict, list)) or isinstance(value, list) and len(value) <= 8:
            lines.append(f"  {key}: {fmt(value)}")
    lines += [f"  note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return fmt(value).replace("|", "\\|").replace("\n", " ")


def render_markdown(result: dict[str, Any], show: str = "all", title: str | None = None) -> str:
    out = [f"### {title or result['level']}", "", f"**{result['status'].upper()}**"]
    if isinstance(result.get("time_s"), (int, float)):
        out[-1] += f" in {result['time_s']:.1f} s"
    if result.get("reason"):
        out[-1] += f" — {result['reason']}"
    out.append("")
    if result.get("checks"):
        out += ["| check | value | limit | result |", "|---|---|---|---|"]
        for c in result["checks"]:
            value = _cell(c["value"]) + (f" ({_cell(c['detail'])})" if c.get("detail") else "")
            out.append(f"| {_cell(c['name'])} | {value} | {_cell(c['limit'] or '-')} | {c['status']} |")
        out.append("")
    scalars = {k: v for k, v in result.get("metrics", {}).items() if not isinstance(v, (dict, list))}
    if scalars:
        out += [f"- {k}: {_cell(v)}" for k, v in scalars.items()] + [""]
    out += [f"_{n}_\n" for n in result.get("notes", [])]
    return "\n".join(out)
