"""Helpers for the platform tests: load snapshot fixtures and apply pitfall-fixture patches.

A pitfall fixture (tests/fixtures/platform/pitfalls/<rule>.json) holds two cases, ``fires`` and ``passes``, each a
platform snapshot (``base``) plus a ``patch`` merged into it: dicts merge key by key, ``null`` deletes a key, any
other value replaces.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "platform"
SNAPSHOTS = FIX / "snapshots"
PITFALLS = FIX / "pitfalls"
GOLDEN = FIX / "golden"
REAL = FIX / "real"


def load_base(pid: str) -> dict[str, Any]:
    return json.loads((SNAPSHOTS / f"{pid}.json").read_text())


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def pitfall_case(rule_id: str, which: str) -> dict[str, Any]:
    case = json.loads((PITFALLS / f"{rule_id}.json").read_text())[which]
    return merge(load_base(case["base"]), case["patch"])


def evaluate(snap: dict[str, Any]):
    from polyrl.platform import pitfalls, resolve

    res = resolve.resolve(snap)
    return res, pitfalls.evaluate(snap, res)


def row(rows, rule_id: str):
    return next(r for r in rows if r.id == rule_id)
