"""The validation report document (schema ``polyrl.validate/1``), its schema check and its matrix row.

``build(levels, env, options)`` assembles what ``polyrl validate`` writes to ``report.json``::

    schema, polyrl, created (ISO time), date (YYYY-MM-DD), machine {os, arch, system},
    platform {id, name, vendor, device_type, cuda_compatible, confidence, evidence, ...},
    versions {polyrl, python, torch, triton {version, provider, backends} | null, transformers,
              runtime {cuda, hip}, driver, collective_backend},
    devices [{index, type, name, ...}], options {levels, model, quick, ...},
    levels {name: {level, status, passed, reason, time_s, metrics, checks, ...}},
    passed (no level failed), not_validated [str], matrix_row {...}

``validate(doc)`` lists what is wrong with a document (the tests and ``polyrl compat render`` use it), so a
hand-edited or older file fails with a message rather than a KeyError. Not here: running levels (the CLI),
Markdown (``markdown.py``), the matrix page (``compat.py``).
"""

from __future__ import annotations

import re
import time
from typing import Any

from polyrl.validate.environment import slug

SCHEMA = "polyrl.validate/1"

# What polyrl never validates with this command, whatever the machine (the report lists them explicitly).
NEVER_VALIDATED = (
    "multi-node training and collectives across hosts",
    "long-run convergence, or equivalence of converged models with other accelerators",
    "data-parallel / FSDP training (the collectives level checks the primitives only)",
    "performance targets (measured by `polyrl bench`, not here)",
    "algorithms other than SFT and one GRPO step (DPO, GSPO, PPO)",
    "serving under load (one chat and one streaming request only)",
)

_TOP = {
    "schema": str,
    "polyrl": str,
    "created": str,
    "date": str,
    "machine": dict,
    "platform": dict,
    "versions": dict,
    "devices": list,
    "options": dict,
    "levels": dict,
    "passed": bool,
    "not_validated": list,
    "matrix_row": dict,
}
_LEVEL = {"level": str, "status": str, "passed": bool, "reason": str, "metrics": dict, "checks": list}
_VERSIONS = ("polyrl", "python", "torch", "triton", "transformers", "runtime", "driver")
_PLATFORM = ("id", "name", "device_type", "confidence", "evidence")


def not_validated(levels: dict[str, dict[str, Any]], all_levels: list[str], model: str) -> list[str]:
    """Skipped and unrequested levels with their reasons, then the scope polyrl never validates here."""
    out = []
    for name in all_levels:
        result = levels.get(name)
        if result is None:
            out.append(f"{name} level: not requested in this run")
        elif result["status"] == "skipped":
            out.append(f"{name} level: skipped -- {result['reason']}")
    ops = levels.get("ops")
    if ops and ops.get("rows"):
        skipped_impls = sorted(
            {f"{r['op']}/{r['impl']}" for r in ops["rows"] if r["status"] in ("skipped", "unavailable")}
        )
        if skipped_impls:
            out.append(f"kernel implementations not run on this device: {', '.join(skipped_impls)}")
    out.append(f"models other than the one validated ({model})")
    out.extend(NEVER_VALIDATED)
    return out


def matrix_row(doc: dict[str, Any]) -> dict[str, Any]:
    """One line of the compatibility matrix: where, when, with what, and each level's status."""
    v, p = doc["versions"], doc["platform"]
    devs = doc["devices"]
    triton = v.get("triton") or {}
    runtime = v.get("runtime") or {}
    rt = f"CUDA {runtime['cuda']}" if runtime.get("cuda") else (f"HIP {runtime['hip']}" if runtime.get("hip") else "")
    return {
        "platform": p["id"],
        "platform_name": p["name"],
        "device": devs[0]["name"] if devs else "unknown",
        "device_count": len(devs) if devs and devs[0].get("type") != "cpu" else 0,
        "date": doc["date"],
        "polyrl": v["polyrl"],
        "torch": v["torch"],
        "triton": f"{triton['version']} ({triton['provider']})" if triton else None,
        "runtime": rt or None,
        "driver": v.get("driver"),
        "levels": {name: r["status"] for name, r in doc["levels"].items()},
        "passed": sorted(n for n, r in doc["levels"].items() if r["status"] == "passed"),
        "model": doc["options"].get("model"),
    }


def build(
    levels: dict[str, dict[str, Any]],
    env: dict[str, Any],
    options: dict[str, Any],
    all_levels: list[str],
    now: float | None = None,
) -> dict[str, Any]:
    """The full report document for ``levels`` run on the machine ``env`` (``environment.collect()``)."""
    now = time.time() if now is None else now
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "polyrl": env["versions"]["polyrl"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)),
        "date": time.strftime("%Y-%m-%d", time.localtime(now)),
        "machine": env["machine"],
        "platform": {k: v for k, v in env["platform"].items() if k != "scores"},
        "versions": env["versions"],
        "devices": env["devices"],
        "options": options,
        "levels": levels,
        "passed": all(r["status"] != "failed" for r in levels.values()),
        "not_validated": not_validated(levels, all_levels, str(options.get("model"))),
    }
    doc["matrix_row"] = matrix_row(doc)
    return doc


def validate(doc: Any) -> list[str]:
    """Problems with a report document (empty when it follows ``polyrl.validate/1``)."""
    if not isinstance(doc, dict):
        return ["the report is not a JSON object"]
    if doc.get("schema") != SCHEMA:
        return [f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}"]
    errors = [_type_error(k, doc, t) for k, t in _TOP.items()]
    errors = [e for e in errors if e]
    if errors:
        return errors
    errors += [f"versions.{k} missing" for k in _VERSIONS if k not in doc["versions"]]
    errors += [f"platform.{k} missing" for k in _PLATFORM if k not in doc["platform"]]
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", doc["date"]):
        errors.append(f"date {doc['date']!r} is not YYYY-MM-DD")
    for name, result in doc["levels"].items():
        if not isinstance(result, dict):
            errors.append(f"levels.{name} is not an object")
            continue
        errors += [f"levels.{name}.{e}" for e in (_type_error(k, result, t) for k, t in _LEVEL.items()) if e]
        if result.get("status") not in ("passed", "failed", "skipped"):
            errors.append(f"levels.{name}.status is {result.get('status')!r}, expected passed/failed/skipped")
        elif result["status"] != "passed" and not result.get("reason"):
            errors.append(f"levels.{name} is {result['status']} without a reason")
    return errors


def _type_error(key: str, obj: dict[str, Any], typ: type) -> str:
    if key not in obj:
        return f"{key} missing"
    if not isinstance(obj[key], typ):
        return f"{key} should be {typ.__name__}, is {type(obj[key]).__name__}"
    return ""


def file_name(doc: dict[str, Any]) -> str:
    """``<platform>-<device slug>-<date>.json``, the name of this report in ``compat/``."""
    return f"{doc['platform']['id']}-{slug(doc['matrix_row']['device'])}-{doc['date']}.json"
