"""The platform knowledge base: ``platforms.toml`` and ``pitfalls.toml`` loaded into frozen dataclasses.

Data only: which platform a machine is lives in ``resolve``, what is wrong with it in ``pitfalls``. This module
validates the files (every field present, ``unverified`` names real fields, regexes compile) so a typo in the
data fails at load, not in a user's ``polyrl check``. It imports nothing heavy.
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

KB_DIR = Path(__file__).resolve().parent
SEVERITIES = ("fail", "warn")


@dataclass(frozen=True)
class Platform:
    id: str
    name: str
    vendor: str
    noun: str
    device_type: str
    cuda_compatible: bool
    collective_backend: str
    collective_library: str
    visible_devices: tuple[str, ...]
    smi_tools: tuple[str, ...]
    smi_header: str
    sdk_env: tuple[str, ...]
    sdk_paths: tuple[str, ...]
    sdk_setup: str
    sdk_required: bool
    device_nodes: tuple[str, ...]
    wheel_suffix: str
    wheel_suffix_required: bool
    torch_hip: bool
    vendor_extension: str
    extension_dist: str
    extension_match: str
    triton_dists: tuple[str, ...]
    triton_backend: str
    triton_suffix: str
    device_name: str
    allocator_env: tuple[str, ...]
    shim_modules: tuple[str, ...]
    os: tuple[str, ...]
    generic: bool
    unverified: frozenset[str]

    def verified(self, fact: str) -> bool:
        """Whether ``fact`` (a field name) is a verified fact of this platform."""
        if fact not in _FACT_NAMES:
            raise KeyError(f"{fact!r} is not a platform fact")
        return fact not in self.unverified

    def hedge(self, *facts: str) -> str:
        """Return "reportedly " when any of ``facts`` is unverified, else "" (prefix for a sentence on them)."""
        return "" if all(self.verified(f) for f in facts) else "reportedly "


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    title: str
    message: str
    next_step: str


_FACT_NAMES = frozenset(f.name for f in fields(Platform)) - {"id", "unverified"}
_REGEX_FIELDS = ("smi_header", "wheel_suffix", "triton_suffix", "device_name")


def _load(name: str) -> dict[str, Any]:
    with open(KB_DIR / name, "rb") as fh:
        return tomllib.load(fh)


def _platform(pid: str, raw: dict[str, Any]) -> Platform:
    expected = _FACT_NAMES | {"unverified"}
    missing, extra = expected - raw.keys(), raw.keys() - expected
    if missing or extra:
        raise ValueError(f"platforms.toml [{pid}]: missing fields {sorted(missing)}, unknown fields {sorted(extra)}")
    bad = set(raw["unverified"]) - _FACT_NAMES
    if bad:
        raise ValueError(f"platforms.toml [{pid}]: unverified lists unknown facts {sorted(bad)}")
    for key in _REGEX_FIELDS:
        re.compile(raw[key])
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    values["unverified"] = frozenset(raw["unverified"])
    return Platform(id=pid, **values)


@functools.lru_cache(maxsize=1)
def platforms() -> dict[str, Platform]:
    """Every platform by id, in file order (specific platforms before the generic fallbacks)."""
    data = _load("platforms.toml")
    return {pid: _platform(pid, raw) for pid, raw in data["platforms"].items()}


def platform(pid: str) -> Platform:
    """The platform ``pid``; KeyError names the valid ids."""
    table = platforms()
    if pid not in table:
        raise KeyError(f"unknown platform {pid!r}; valid: {', '.join(table)}")
    return table[pid]


@functools.lru_cache(maxsize=1)
def smi_args() -> dict[str, tuple[str, ...]]:
    """Arguments that make each smi tool print its header (used by deep probes only)."""
    return {tool: tuple(args) for tool, args in _load("platforms.toml").get("smi_args", {}).items()}


@functools.lru_cache(maxsize=1)
def rules() -> tuple[Rule, ...]:
    """Every pitfall rule, in file order (the order `polyrl check` prints them)."""
    out = []
    for raw in _load("pitfalls.toml")["rule"]:
        rule = Rule(**raw)
        if rule.severity not in SEVERITIES:
            raise ValueError(f"pitfalls.toml {rule.id}: severity must be one of {SEVERITIES}")
        out.append(rule)
    ids = [r.id for r in out]
    if len(set(ids)) != len(ids):
        raise ValueError("pitfalls.toml: duplicate rule ids")
    return tuple(out)


def all_env_names() -> tuple[str, ...]:
    """Every environment variable any platform's facts name (visible devices, SDK, allocator), sorted."""
    names: set[str] = set()
    for p in platforms().values():
        names.update(p.visible_devices, p.sdk_env, p.allocator_env)
    return tuple(sorted(names))
