"""The ``polyrl env`` and ``polyrl check`` outputs: versioned JSON-able reports and their text renderings.

Plain text when stdout is not a terminal (and in golden tests), rich tables when it is. The reports carry the raw
snapshot, so ``polyrl env --json`` from any machine replays as a test fixture (``check --snapshot FILE``). This
module formats; it does not probe, resolve or judge (``probe``, ``resolve``, ``pitfalls``).
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from polyrl import __version__
from polyrl.platform import envvars, kb
from polyrl.platform.fp8 import fp8_gemm_from_facts
from polyrl.platform.pitfalls import Row, ready
from polyrl.platform.resolve import Resolution, torch_info

ENV_SCHEMA = "polyrl.env/1"
CHECK_SCHEMA = "polyrl.check/1"
_ORDER = {"FAIL": 0, "WARN": 1, "SKIP": 2, "OK": 3}


def _polyrl_version() -> str:
    return __version__


def platform_dict(res: Resolution) -> dict[str, Any]:
    p = kb.platform(res.platform)
    return {
        "id": p.id,
        "name": p.name,
        "vendor": p.vendor,
        "device_type": p.device_type,
        "cuda_compatible": p.cuda_compatible,
        "confidence": res.confidence,
        "evidence": list(res.evidence),
        "scores": res.to_dict()["scores"],
        "unverified_facts": sorted(p.unverified),
    }


def _fp8_gemm(runtime: dict[str, Any], t: dict[str, Any]) -> bool | None:
    """FP8 GEMM support of the first device the probe saw (None when torch did not import)."""
    if not runtime.get("ok"):
        return None
    devices = runtime.get("devices") or [{}]
    d = devices[0]
    return fp8_gemm_from_facts(runtime.get("device_type"), d.get("capability"), bool(t.get("hip")), d.get("arch"))


def env_report(snap: dict[str, Any], res: Resolution) -> dict[str, Any]:
    """The ``polyrl env --json`` document (schema ``polyrl.env/1``)."""
    p = kb.platform(res.platform)
    runtime = snap.get("torch_runtime") or {}
    t = torch_info(snap)
    dists = snap.get("distributions") or {}
    env = snap.get("env") or {}
    return {
        "schema": ENV_SCHEMA,
        "polyrl": _polyrl_version(),
        "python": snap.get("python"),
        "os": snap.get("os"),
        "platform": platform_dict(res),
        "torch": {
            "version": t["version"],
            "cuda": t["cuda"],
            "hip": t["hip"],
            "git_version": t["git"],
            "import_ok": bool(runtime.get("ok")),
            "error": runtime.get("error"),
            "device_type": runtime.get("device_type"),
            "bf16": runtime.get("bf16"),
            "fp8_gemm": _fp8_gemm(runtime, t),
        },
        "devices": runtime.get("devices") or [],
        "vendor_packages": [
            {"name": n, "version": d["version"], "local": d.get("local")} for n, d in sorted(dists.items())
        ],
        "triton": snap.get("triton_providers") or [],
        "collectives": {
            "expected": p.collective_backend,
            "library": p.collective_library,
            "available": runtime.get("collectives"),
        },
        "variables": dict(sorted(env.items())),
        "polyrl_variables": [{"name": v.name, "value": env.get(v.name), "help": v.help} for v in envvars.ALL],
        "snapshot": snap,
    }


def check_report(snap: dict[str, Any], res: Resolution, rows: list[Row]) -> dict[str, Any]:
    """The ``polyrl check --json`` document (schema ``polyrl.check/1``)."""
    counts = {s: sum(r.status == s for r in rows) for s in _ORDER}
    return {
        "schema": CHECK_SCHEMA,
        "polyrl": _polyrl_version(),
        "platform": platform_dict(res),
        "deep": bool(snap.get("deep")),
        "ready": ready(rows),
        "counts": counts,
        "rows": [r.to_dict() for r in sorted(rows, key=lambda r: _ORDER[r.status])],
    }


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=False, default=str)


# --- plain text -----------------------------------------------------------------------------------------------------


def _gib(n: Any) -> str:
    return f"{n / 2**30:.1f} GiB" if isinstance(n, (int, float)) and n else "?"


def _device_line(d: dict[str, Any]) -> str:
    cap = d.get("capability")
    cap_s = f", capability {cap[0]}.{cap[1]}" if cap else ""
    return f"{d.get('name')}{cap_s}, {_gib(d.get('total_memory'))}"


def env_text(doc: dict[str, Any]) -> str:
    plat, t = doc["platform"], doc["torch"]
    py, osd = doc.get("python") or {}, doc.get("os") or {}
    lines = [
        f"polyrl {doc['polyrl']}  Python {py.get('version')} ({py.get('implementation')})  "
        f"{osd.get('system')} {osd.get('release')} {osd.get('machine')}",
        f"platform     {plat['name']} ({plat['id']}), confidence {plat['confidence']}",
    ]
    lines += [f"  evidence   {e}" for e in plat["evidence"]]
    if t["import_ok"]:
        torch_s = f"{t['version']} (cuda {t['cuda'] or '-'}, hip {t['hip'] or '-'}, device type {t['device_type']})"
    else:
        torch_s = f"{t['version'] or 'not installed'} -- import failed: {(t['error'] or '').splitlines()[-1:]}"
    lines.append(f"torch        {torch_s}")
    fp8 = {True: "yes (--precision fp8 runs)", False: "no (--precision fp8 is refused)", None: "unknown"}
    lines.append(f"fp8 gemm     {fp8[t.get('fp8_gemm')]}")
    devices = doc["devices"]
    lines.append(f"devices      {len(devices) or 'none'}")
    lines += [f"  [{i}]        {_device_line(d)}" for i, d in enumerate(devices)]
    pkgs = ", ".join(f"{x['name']} {x['version']}" for x in doc["vendor_packages"]) or "none"
    lines.append(f"packages     {pkgs}")
    tri = ", ".join(f"{x['dist']} {x['version']} (backends: {', '.join(x['backends']) or '-'})" for x in doc["triton"])
    lines.append(f"triton       {tri or 'not installed'}")
    col = doc["collectives"]
    avail = ", ".join(col["available"]) if col["available"] is not None else "unknown"
    lines.append(f"collectives  expected {col['expected']} ({col['library']}); available: {avail or 'none'}")
    variables = doc["variables"]
    lines.append("variables    " + (", ".join(f"{k}={v}" for k, v in variables.items()) or "none set"))
    lines += [
        f"  {v['name']:<12} {v['value'] if v['value'] is not None else '(unset)'}" for v in doc["polyrl_variables"]
    ]
    return "\n".join(lines) + "\n"


def check_text(doc: dict[str, Any]) -> str:
    plat = doc["platform"]
    lines = [f"polyrl check: {plat['name']} ({plat['id']}), confidence {plat['confidence']}"]
    for row in doc["rows"]:
        if row["status"] == "OK":
            lines.append(f"  OK    {row['id']}: {row['title']}")
            continue
        lines.append(f"  {row['status']:<5} {row['id']}: {row['message']}")
        if row["next_step"]:
            lines.append(f"        next: {row['next_step']}")
    c = doc["counts"]
    verdict = "READY" if doc["ready"] else "NOT READY"
    lines.append(f"result: {verdict} ({c['FAIL']} fail, {c['WARN']} warn, {c['OK']} ok, {c['SKIP']} skipped)")
    return "\n".join(lines) + "\n"


# --- rich (terminals only) ------------------------------------------------------------------------------------------

_STYLE = {"OK": "green", "WARN": "yellow", "FAIL": "bold red", "SKIP": "dim"}


def print_check_rich(doc: dict[str, Any]) -> None:
    plat = doc["platform"]
    console = Console()
    console.print(f"[bold]polyrl check[/]: {plat['name']} ({plat['id']}), confidence {plat['confidence']}")
    table = Table(show_header=True, header_style="bold")
    table.add_column("status")
    table.add_column("rule")
    table.add_column("detail", overflow="fold")
    for row in doc["rows"]:
        detail = row["title"] if row["status"] == "OK" else row["message"]
        if row["next_step"]:
            detail += f"\n[cyan]next:[/] {row['next_step']}"
        table.add_row(f"[{_STYLE[row['status']]}]{row['status']}[/]", row["id"], detail)
    console.print(table)
    verdict = "[green]READY[/]" if doc["ready"] else "[bold red]NOT READY[/]"
    c = doc["counts"]
    console.print(f"result: {verdict} ({c['FAIL']} fail, {c['WARN']} warn, {c['OK']} ok, {c['SKIP']} skipped)")


def print_env_rich(doc: dict[str, Any]) -> None:
    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    lines = env_text(doc).splitlines()
    Console().print(lines[0])
    for line in lines[1:]:
        indent = "  " if line.startswith(" ") else ""
        key, _, value = line.strip().partition(" ")
        table.add_row(indent + key, value.strip())
    Console().print(table)
