"""Which platform a probe snapshot describes: a pure function from the snapshot to a ``Resolution``.

Evidence is scored per platform from the knowledge base, never by ``if vendor == ...``: a fact shared by several
platforms (``/dev/kfd`` for ROCm and Hygon, ``nvidia-smi`` shipped by CUDA-compatible stacks) is split between
them, and a device name or smi header that contradicts a platform's pattern counts against it. Vendor extension
device types (npu, musa, mlu, xpu) decide first, because their CUDA-alias shims make ``torch.cuda`` answer.
Among ``torch.cuda`` stacks the best-scored specific platform wins; a CUDA device that no platform claims
resolves to the generic "cuda-compatible" platform, which runs the generic CUDA path. ``POLYRL_PLATFORM``
overrides everything. This module reads no files and runs nothing.
"""

from __future__ import annotations

import fnmatch
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from polyrl.errors import UserError
from polyrl.platform import kb

MIN_SCORE = 3.0  # below this, a specific platform is not claimed
HIGH_SCORE = 8.0

# Weights of each kind of evidence (split between the platforms that share the fact).
W_RUNTIME_TYPE = 10.0  # torch reports this vendor device type
W_EXTENSION = 4.0  # the vendor extension module is installed
W_SHIM = 2.0
W_NODE = 4.0
W_SMI = 2.0
W_SMI_HEADER = 5.0
W_SDK_ENV = 2.0
W_SDK_PATH = 1.0
W_SUFFIX = 3.0
W_SUFFIX_WEAK = 2.0  # a label that only a public wheel carries (cu124)
W_HIP = 3.0
W_NAME = 6.0
W_NAME_MISMATCH = -6.0
W_NAME_MISMATCH_UNVERIFIED = -2.0


@dataclass
class Resolution:
    platform: str
    confidence: str  # "forced", "high", "medium" or "low"
    evidence: list[str]
    scores: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        ranked = sorted(((s, p) for p, s in self.scores.items() if s), reverse=True)
        return {
            "platform": self.platform,
            "confidence": self.confidence,
            "evidence": list(self.evidence),
            "scores": {p: round(s, 2) for s, p in ranked},
        }


def torch_info(snap: dict[str, Any]) -> dict[str, Any]:
    """torch's version, cuda and hip strings from the runtime probe or, failing that, ``torch/version.py``."""
    runtime = snap.get("torch_runtime") or {}
    vfile = snap.get("torch_version_file") or {}
    dist = (snap.get("distributions") or {}).get("torch") or {}
    version = runtime.get("version") or vfile.get("version") or dist.get("version")
    return {"version": version, "cuda": vfile.get("cuda"), "hip": vfile.get("hip"), "git": vfile.get("git_version")}


def _label(version: str | None) -> str:
    return version.split("+", 1)[1] if version and "+" in version else ""


class _Scores:
    def __init__(self, os_name: str) -> None:
        self.table = {pid: p for pid, p in kb.platforms().items() if not p.os or not os_name or os_name in p.os}
        self.score: dict[str, float] = defaultdict(float)
        self.why: dict[str, list[tuple[float, str]]] = defaultdict(list)

    def add(self, pids: list[str], weight: float, text: str) -> None:
        """Share ``weight`` between ``pids`` (a fact several platforms claim says less about each)."""
        pids = [p for p in pids if p in self.table]
        for pid in pids:
            w = weight / len(pids)
            self.score[pid] += w
            hedge = "" if w < 0 else _hedge_tag(self.table[pid], text)
            self.why[pid].append((w, text + hedge))


def _hedge_tag(p: kb.Platform, text: str) -> str:
    return "" if not any(f"[{fact}]" in text for fact in p.unverified) else " (unverified knowledge-base fact)"


def _strip(text: str) -> str:
    return re.sub(r" \[[a-z_]+\]", "", text)


def _score(snap: dict[str, Any]) -> _Scores:
    sc = _Scores((snap.get("os") or {}).get("system", ""))
    plats = sc.table.values()
    runtime = snap.get("torch_runtime") or {}
    rt_type = runtime.get("device_type") if runtime.get("ok") else None
    if rt_type and rt_type not in ("cpu", "cuda"):
        sc.add(
            [p.id for p in plats if p.device_type == rt_type], W_RUNTIME_TYPE, f"torch reports device type '{rt_type}'"
        )
    modules = snap.get("modules") or {}
    for p in plats:
        if p.vendor_extension and (modules.get(p.vendor_extension) or {}).get("found"):
            sc.add([p.id], W_EXTENSION, f"torch extension module {p.vendor_extension} is installed [vendor_extension]")
    shims = set(snap.get("loaded_shims") or []) | set(runtime.get("shims_loaded") or [])
    for shim in sorted(shims):
        sc.add([p.id for p in plats if shim in p.shim_modules], W_SHIM, f"shim {shim} is loaded [shim_modules]")
    counted: set[str] = set()  # each pattern counts once: eight /dev/davinci* nodes are one fact
    for node in snap.get("device_nodes") or []:
        pats = {pat for p in plats for pat in p.device_nodes if fnmatch.fnmatch(node, pat)}
        if pats and not pats <= counted:
            counted |= pats
            owners = [p.id for p in plats if pats & set(p.device_nodes)]
            sc.add(owners, W_NODE, f"device node {node} exists [device_nodes]")
    for tool, info in sorted((snap.get("smi") or {}).items()):
        owners = [p.id for p in plats if tool in p.smi_tools]
        sc.add(owners, W_SMI, f"{tool} is on PATH [smi_tools]")
        header = (info or {}).get("header")
        if header:
            for p in plats:
                if p.smi_header and tool in p.smi_tools:
                    if re.search(p.smi_header, header):
                        sc.add([p.id], W_SMI_HEADER, f"the {tool} header matches the {p.id} pattern [smi_header]")
                    elif p.verified("smi_header"):
                        sc.add([p.id], -W_SMI_HEADER, f"the {tool} header does not match the {p.id} pattern")
    env = snap.get("env") or {}
    for var in sorted(env):
        owners = [p.id for p in plats if var in p.sdk_env]
        sc.add(owners, W_SDK_ENV, f"SDK variable {var} is set [sdk_env]")
    for path in snap.get("sdk_paths") or []:
        sc.add([p.id for p in plats if path in p.sdk_paths], W_SDK_PATH, f"SDK path {path} exists [sdk_paths]")
    tinfo = torch_info(snap)
    label = _label(tinfo["version"])
    if label and label != "cpu":
        for p in plats:
            if p.wheel_suffix and re.search(p.wheel_suffix, label):
                weight = W_SUFFIX if p.wheel_suffix_required else W_SUFFIX_WEAK
                sc.add([p.id], weight, f"torch {tinfo['version']} carries the {p.id} label [wheel_suffix]")
    if tinfo["hip"]:
        sc.add([p.id for p in plats if p.torch_hip], W_HIP, f"torch.version.hip is {tinfo['hip']} [torch_hip]")
    for dev in (runtime.get("devices") or []) if runtime.get("ok") else []:
        name = str(dev.get("name") or "")
        for p in plats:
            if not p.device_name or p.generic or (rt_type and p.device_type != rt_type):
                continue
            if re.search(p.device_name, name):
                sc.add([p.id], W_NAME, f"device name '{name}' matches the {p.id} pattern [device_name]")
            else:
                weight = W_NAME_MISMATCH if p.verified("device_name") else W_NAME_MISMATCH_UNVERIFIED
                sc.add([p.id], weight, f"device name '{name}' does not match the {p.id} pattern")
        break  # one device is enough: nodes of one host are alike
    return sc


def _confidence(score: float) -> str:
    return "high" if score >= HIGH_SCORE else "medium" if score >= 2 * MIN_SCORE - 1 else "low"


def resolve(snap: dict[str, Any]) -> Resolution:
    """The platform of ``snap`` with a confidence and the evidence for it (pure: reads only ``snap``)."""
    table = kb.platforms()
    forced = ((snap.get("env") or {}).get("POLYRL_PLATFORM") or "").strip()
    if forced:
        if forced not in table:
            raise UserError(f"POLYRL_PLATFORM={forced!r} is not a known platform; use one of: {', '.join(table)}")
        return Resolution(forced, "forced", [f"POLYRL_PLATFORM={forced} overrides detection"])
    sc = _score(snap)
    runtime = snap.get("torch_runtime") or {}
    rt_type = runtime.get("device_type") if runtime.get("ok") else None
    candidates = [
        p for p in sc.table.values() if not p.generic and (rt_type in (None, "cpu") or p.device_type == rt_type)
    ]
    ranked = sorted(candidates, key=lambda p: -sc.score[p.id])  # stable: file order breaks ties
    scores = dict(sc.score)
    if ranked and sc.score[ranked[0].id] >= MIN_SCORE:
        best = ranked[0]
        why = [_strip(t) for w, t in sorted(sc.why[best.id], key=lambda x: -x[0]) if w > 0]
        return Resolution(best.id, _confidence(sc.score[best.id]), why, scores)
    if rt_type == "cuda":
        names = sorted({str(d.get("name")) for d in runtime.get("devices") or []})
        why = [f"torch.cuda reaches {runtime.get('count', 0)} device(s) named {', '.join(names) or '?'}"]
        why.append("no specific platform's facts match them; the generic CUDA path applies")
        return Resolution("cuda-compatible", "medium", why, scores)
    if rt_type == "mps":
        return Resolution("mps", "high", ["torch reports device type 'mps'"], scores)
    if rt_type == "cpu":
        why = ["torch imports and reports no accelerator", "no device node, smi tool or vendor package of a platform"]
        if ranked and sc.score[ranked[0].id] > 0:
            why[1] = f"weak signs of {ranked[0].id} only (score {sc.score[ranked[0].id]:.1f} < {MIN_SCORE})"
        return Resolution("cpu", "high" if not ranked or sc.score[ranked[0].id] <= 1 else "medium", why, scores)
    return Resolution("cpu", "low", ["torch could not be asked and no accelerator was found"], scores)
