"""``report.md``: a validation report in the shape a community member would write by hand.

Sections: summary, validation environment (versions, devices, platform evidence), installation check,
operator validation (a table per op / implementation / dtype with the worst relative L2 and max abs diff,
representative numbers, the TF32 note, the full sweep folded away), end-to-end results (each other level's
checks and numbers), what was not validated, and the matrix row. Input is the ``polyrl.validate/1`` document
only, so a report from any machine renders the same. Not here: running anything.
"""

from __future__ import annotations

import json
from typing import Any

from polyrl.validate import ops_level
from polyrl.validate import result as res

E2E_TITLES = {
    "collectives": "Collective communication",
    "sft": "End-to-end SFT",
    "rl": "Rollout and GRPO step",
    "serve": "Serving (OpenAI API)",
    "eval": "Model-level eval gate (fast path vs reference)",
}


def _versions(doc: dict[str, Any]) -> list[str]:
    v, p = doc["versions"], doc["platform"]
    devs = doc["devices"]
    triton = v.get("triton")
    rt = v.get("runtime") or {}
    lines = [
        f"- polyrl: {v['polyrl']}",
        f"- Platform: {p['name']} (`{p['id']}`), confidence {p['confidence']}",
        f"- Accelerator: {devs[0]['name'] if devs else 'unknown'}"
        + (f", capability {devs[0]['capability']}" if devs and devs[0].get("capability") else ""),
        f"- Visible devices: {len(devs) if devs and devs[0].get('type') != 'cpu' else 0}"
        + (f" (CPU, {devs[0].get('cores')} cores)" if devs and devs[0].get("type") == "cpu" else ""),
        f"- OS: {doc['machine'].get('os')}",
        f"- Python: {v['python']}",
        f"- PyTorch: {v['torch']}",
    ]
    if rt.get("cuda"):
        lines.append(f"- torch.version.cuda: {rt['cuda']}")
    if rt.get("hip"):
        lines.append(f"- torch.version.hip: {rt['hip']}")
    lines.append(f"- Driver: {v.get('driver') or 'not reported'}")
    if triton:
        backends = ", ".join(triton.get("backends") or []) or "-"
        lines.append(f"- Triton: {triton['version']} from `{triton['provider']}` (backends: {backends})")
    else:
        lines.append("- Triton: not installed")
    lines.append(f"- transformers: {v.get('transformers') or 'not installed'}")
    lines.append(f"- Collective backend: {v.get('collective_backend')}")
    lines.append(f"- Validated with: {doc['options'].get('model')}; levels {', '.join(doc['levels'])}")
    lines += ["", "Platform evidence:", ""] + [f"- {e}" for e in p.get("evidence", [])]
    return lines


def _platform(doc: dict[str, Any]) -> list[str]:
    level = doc["levels"].get("platform")
    if not level:
        return []
    out = ["## Installation check", "", f"**{level['status'].upper()}** — `polyrl check`: "]
    counts = level["metrics"].get("check_counts") or {}
    out[-1] += ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no rows"
    out.append("")
    for row in level.get("check_rows", []):
        if row["status"] != "OK":
            out.append(f"- {row['status']} `{row['id']}`: {row['title']}")
    for c in level.get("checks", []):
        if c["name"] != "polyrl check: no FAIL rows":
            out.append(f"- {c['status']}: {c['name']} ({res.fmt(c['value'])})")
    return out + [""]


def _ops(doc: dict[str, Any]) -> list[str]:
    level = doc["levels"].get("ops")
    if not level:
        return []
    out = ["## Operator validation", ""]
    if level["status"] == "skipped":
        return out + [f"Skipped: {level['reason']}", ""]
    counts = ", ".join(f"{n} {k}" for k, n in sorted((level.get("summary") or {}).items()))
    out += [
        f"**{level['status'].upper()}** ({counts}). Every implementation against the op's plain-PyTorch reference "
        "run in fp64 on the same inputs, outputs and every gradient, over awkward shapes.",
        "",
        "| op | implementation | dtype | checks | worst rel L2 | worst max abs | worst grad rel L2 | finite | result |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rep = level["metrics"].get("representative") or []
    for r in rep:
        if r["op"] == "matmul_tf32":
            continue
        cells = [r["op"], r["impl"], r["dtype"], r["checks"], r["max_rel_l2"], r["max_abs"], r["grad_max_rel_l2"]]
        out.append("| " + " | ".join(res.fmt(c) for c in cells) + f" | {res.fmt(r['finite'])} | {r['status']} |")
    out += ["", "Representative numbers:", ""]
    out += _representative(rep)
    skipped = sorted(
        {f"{r['op']}/{r['impl']}" for r in level.get("rows", []) if r["status"] in ("skipped", "unavailable")}
    )
    if skipped:
        out += ["", f"Not run here: {', '.join(skipped)} (see the full table for the reasons)."]
    out += ["", *[f"_{n}_" for n in level.get("notes", [])]]
    out += ["", "<details><summary>Full operator table</summary>", "", *ops_level.table_markdown(level)]
    out += ["", "</details>", ""]
    return out


def _representative(rep: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rep:
        if r["op"] == "matmul_tf32":
            out.append(
                f"- TF32: fp32 matmul with TF32 allowed vs disallowed differs by rel L2 {res.fmt(r['max_rel_l2'])}"
                + (f" ({r['note']})" if r.get("note") else "")
            )
        elif r["impl"] != "reference" or not any(x["op"] == r["op"] and x["impl"] != "reference" for x in rep):
            grad = f", gradients {res.fmt(r['grad_max_rel_l2'])}" if r.get("grad_max_rel_l2") is not None else ""
            out.append(
                f"- {r['op']} ({r['impl']}) {r['dtype']}: rel L2 {res.fmt(r['max_rel_l2'])}{grad}, "
                f"max abs {res.fmt(r['max_abs'])}"
            )
    finite = all(r["finite"] for r in rep)
    out.append(f"- All tested outputs and gradients finite: {'yes' if finite else 'NO'}")
    return out


def _e2e(doc: dict[str, Any]) -> list[str]:
    names = [n for n in doc["levels"] if n in E2E_TITLES]
    if not names:
        return []
    out = ["## End-to-end results", ""]
    for name in names:
        out.append(res.render_markdown(doc["levels"][name], title=E2E_TITLES[name]))
    return out


def render(doc: dict[str, Any]) -> str:
    """The whole ``report.md`` for a ``polyrl.validate/1`` document."""
    row = doc["matrix_row"]
    statuses = ", ".join(f"{n} {r['status']}" for n, r in doc["levels"].items())
    out = [
        f"# polyrl validation: {row['device']} ({doc['platform']['name']})",
        "",
        f"{doc['date']} — overall **{'PASS' if doc['passed'] else 'FAIL'}** ({statuses}). "
        f"Generated by `polyrl validate` (schema `{doc['schema']}`).",
        "",
        "## Validation environment",
        "",
        *_versions(doc),
        "",
        *_platform(doc),
        *_ops(doc),
        *_e2e(doc),
        "## Not validated",
        "",
        "This report does not claim complete coverage. Not validated here:",
        "",
        *[f"- {item}" for item in doc["not_validated"]],
        "",
        "## Matrix row",
        "",
        "```json",
        json.dumps(row),
        "```",
        "",
    ]
    return "\n".join(out)
