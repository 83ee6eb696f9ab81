"""The pitfall rule engine: each rule of ``kb/pitfalls.toml`` has a check here, registered under its id.

A check reads the snapshot, the resolution and the platform's knowledge-base entry and returns ``None`` (OK),
``Fire(params)`` (the rule's severity: WARN or FAIL) or ``Skip(reason)`` (could not be evaluated). The words come
from the TOML templates, filled with the check's params; the checks themselves hold no user-facing sentences
beyond short facts. Pure: no probing, no I/O. Deciding the platform is ``resolve``'s job.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from polyrl.platform import kb
from polyrl.platform.resolve import Resolution, torch_info

MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 6)
_HIDE_ALL = ("", "-1", "none", "nodevfiles")


@dataclass
class Fire:
    params: dict[str, Any] = field(default_factory=dict)
    hedge_facts: tuple[str, ...] = ()


@dataclass
class Skip:
    reason: str


@dataclass
class Ctx:
    snap: dict[str, Any]
    res: Resolution
    p: kb.Platform

    @property
    def runtime(self) -> dict[str, Any]:
        return self.snap.get("torch_runtime") or {}

    @property
    def env(self) -> dict[str, str]:
        return self.snap.get("env") or {}

    @property
    def torch(self) -> dict[str, Any]:
        return torch_info(self.snap)

    def dist(self, name: str) -> dict[str, Any] | None:
        return (self.snap.get("distributions") or {}).get(name)


Check = Callable[[Ctx], "Fire | Skip | None"]
CHECKS: dict[str, Check] = {}


def check(rule_id: str) -> Callable[[Check], Check]:
    def deco(fn: Check) -> Check:
        CHECKS[rule_id] = fn
        return fn

    return deco


@dataclass
class Row:
    id: str
    status: str  # "OK", "WARN", "FAIL" or "SKIP"
    title: str
    message: str = ""
    next_step: str = ""

    def to_dict(self) -> dict[str, str]:
        return {
            "id": self.id,
            "status": self.status,
            "title": self.title,
            "message": self.message,
            "next_step": self.next_step,
        }


# --- small facts shared by several checks -----------------------------------------------------------------------


def _release(version: str | None) -> tuple[int, ...]:
    """(2, 10, 0) from "2.10.0.post4+cpu"; () when unparsable."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    return tuple(int(x) for x in m.groups() if x is not None) if m else ()


def _label(version: str | None) -> str:
    return version.split("+", 1)[1] if version and "+" in version else ""


def _hardware(ctx: Ctx) -> list[str]:
    """Signs of this platform's hardware that do not depend on torch: its device nodes and smi tools."""
    nodes = [n for n in ctx.snap.get("device_nodes") or [] if any(fnmatch.fnmatch(n, g) for g in ctx.p.device_nodes)]
    tools = [t for t in ctx.snap.get("smi") or {} if t in ctx.p.smi_tools]
    return nodes[:2] + [f"{t} on PATH" for t in tools[:1]]


def _cpu_build(ctx: Ctx) -> bool:
    """torch is a CPU-only build while the platform needs a CUDA/HIP (or xpu) build of torch itself."""
    if ctx.p.vendor_extension or ctx.p.generic or ctx.p.device_type in ("cpu", "mps"):
        return False
    t = ctx.torch
    if t["version"] is None:
        return False
    label = _label(t["version"])
    if label and ctx.p.wheel_suffix and re.search(ctx.p.wheel_suffix, label) and label != "cpu":
        return False
    vfile = ctx.snap.get("torch_version_file") or {}
    return label == "cpu" or (bool(vfile) and not vfile.get("cuda") and not vfile.get("hip") and not vfile.get("xpu"))


def _replaced(ctx: Ctx) -> bool:
    v = ctx.torch["version"]
    return bool(ctx.p.wheel_suffix_required and v and not re.search(ctx.p.wheel_suffix, _label(v)))


def _no_runtime(ctx: Ctx) -> Skip | None:
    return None if ctx.runtime.get("ok") else Skip("torch did not import, see torch-import-failed")


def _is_accelerator(p: kb.Platform) -> bool:
    return p.device_type not in ("cpu", "mps")


# --- the checks, in pitfalls.toml order ----------------------------------------------------------------------------


@check("python-too-old")
def _python(ctx: Ctx) -> Fire | None:
    found = (ctx.snap.get("python") or {}).get("version", "")
    if _release(found) and _release(found)[:2] < MIN_PYTHON:
        return Fire({"found": found, "minimum": ".".join(map(str, MIN_PYTHON))})
    return None


def _autoload_failure(ctx: Ctx) -> tuple[str, str] | None:
    text = (ctx.runtime.get("error") or "") + "\n" + (ctx.runtime.get("traceback") or "")
    m = re.search(r"Failed to load the backend extension: ([^\s.]+)", text)
    if not m:
        return None
    cause = text.split("The above exception was the direct cause")[0].strip().splitlines()
    return m.group(1), (cause[-1].strip() if cause else "")


@check("torch-import-failed")
def _torch_import(ctx: Ctx) -> Fire | None:
    if ctx.runtime.get("ok") or _autoload_failure(ctx):
        return None
    error = (ctx.runtime.get("error") or "unknown error").strip().splitlines()
    return Fire({"error": error[-1] if error else "unknown error"})


@check("torch-plugin-autoload-failed")
def _torch_autoload(ctx: Ctx) -> Fire | None:
    if ctx.runtime.get("ok"):
        return None
    found = _autoload_failure(ctx)
    if not found:
        return None
    return Fire({"plugin": found[0], "error": found[1], "torch": ctx.torch["version"] or "?"})


@check("torch-too-old")
def _torch_old(ctx: Ctx) -> Fire | Skip | None:
    v = ctx.torch["version"]
    if not v:
        return Skip("torch is not installed")
    if _release(v)[:2] < MIN_TORCH:
        return Fire({"found": v, "minimum": ".".join(map(str, MIN_TORCH))})
    return None


@check("vendor-torch-replaced")
def _torch_replaced(ctx: Ctx) -> Fire | None:
    if not _replaced(ctx) or _cpu_build(ctx):
        return None
    label = re.sub(r"[\^\$\\()?+*{}\[\]]|\bd\b", "", ctx.p.wheel_suffix).replace("|", "' or '+")
    return Fire({"found": ctx.torch["version"], "label": label}, ("wheel_suffix", "wheel_suffix_required"))


@check("vendor-extension-mismatch")
def _ext_mismatch(ctx: Ctx) -> Fire | None:
    ext = ctx.dist(ctx.p.extension_dist) if ctx.p.extension_dist else None
    tv = ctx.torch["version"]
    if ctx.p.extension_match != "release" or not ext or not tv:
        return None
    er, tr = _release(ext["version"]), _release(tv)
    if er[:3] == tr[:3]:
        return None
    return Fire(
        {
            "extension": ctx.p.extension_dist,
            "ext_version": ext["version"],
            "torch_version": tv,
            "torch_release": ".".join(map(str, tr)),
            "ext_release": ".".join(map(str, er)),
        },
        ("extension_match",),
    )


@check("vendor-extension-missing")
def _ext_missing(ctx: Ctx) -> Fire | None:
    mod = ctx.p.vendor_extension
    if not mod or ((ctx.snap.get("modules") or {}).get(mod) or {}).get("found"):
        return None
    evidence = ", ".join(_hardware(ctx)) or "; ".join(ctx.res.evidence[:2])
    return Fire({"extension": mod, "dist": ctx.p.extension_dist, "evidence": evidence, "torch": ctx.torch["version"]})


def _expected_triton(p: kb.Platform) -> str:
    return p.triton_dists[0] if p.triton_dists else "the Triton build for this platform"


@check("triton-multiple-providers")
def _triton_many(ctx: Ctx) -> Fire | None:
    provs = ctx.snap.get("triton_providers") or []
    if len(provs) < 2:
        return None
    return Fire(
        {
            "count": len(provs),
            "dists": ", ".join(f"{x['dist']} {x['version']}" for x in provs),
            "uninstall": " ".join(sorted({x["dist"] for x in provs})),
            "expected": _expected_triton(ctx.p),
        }
    )


@check("triton-wrong-build")
def _triton_wrong(ctx: Ctx) -> Fire | None:
    provs = ctx.snap.get("triton_providers") or []
    p = ctx.p
    if len(provs) != 1 or not p.triton_dists:
        return None
    prov = provs[0]
    facts: list[str] = []
    if prov["dist"] not in p.triton_dists:
        facts.append("triton_dists")
    if p.triton_suffix and not re.search(p.triton_suffix, prov.get("local") or ""):
        facts.append("triton_suffix")
    if p.triton_backend and prov.get("backends") and p.triton_backend not in prov["backends"]:
        facts.append("triton_backend")
    if not facts:
        return None
    expected = _expected_triton(p)
    if "triton_backend" in facts:
        expected += f" with a triton/backends/{p.triton_backend} backend"
    return Fire(
        {"found": f"{prov['dist']} {prov['version']}", "found_dist": prov["dist"], "expected": expected}, tuple(facts)
    )


@check("triton-missing")
def _triton_missing(ctx: Ctx) -> Fire | None:
    if ctx.snap.get("triton_providers") or not ctx.p.triton_dists or not _is_accelerator(ctx.p):
        return None
    return Fire({"expected": _expected_triton(ctx.p)}, ("triton_dists",))


@check("sdk-env-not-sourced")
def _sdk(ctx: Ctx) -> Fire | None:
    p = ctx.p
    present = [s for s in ctx.snap.get("sdk_paths") or [] if s in p.sdk_paths]
    if not p.sdk_required or not present or any(v in ctx.env for v in p.sdk_env):
        return None
    hedge = "" if p.verified("sdk_setup") else "(unverified) "
    return Fire(
        {"path": present[0], "vars": ", ".join(p.sdk_env), "setup": p.sdk_setup, "hedge_cap": hedge}, ("sdk_env",)
    )


@check("foreign-visible-devices")
def _foreign_visible(ctx: Ctx) -> Fire | None:
    p = ctx.p
    if not p.visible_devices:
        return None
    every = sorted({v for q in kb.platforms().values() for v in q.visible_devices})
    foreign = [v for v in every if v in ctx.env and v not in p.visible_devices]
    if not foreign:
        return None
    var = foreign[0]
    return Fire({"var": var, "value": ctx.env[var], "own": " or ".join(p.visible_devices)}, ("visible_devices",))


@check("visible-devices-hide-all")
def _hide_all(ctx: Ctx) -> Fire | None:
    for var in ctx.p.visible_devices:
        if var in ctx.env and ctx.env[var].strip().lower() in _HIDE_ALL:
            return Fire({"var": var, "value": ctx.env[var]})
    return None


@check("cuda-alias-shim")
def _shim(ctx: Ctx) -> Fire | None:
    if ctx.p.device_type == "cuda" or not _is_accelerator(ctx.p):
        return None
    shims = sorted(set(ctx.snap.get("loaded_shims") or []) | set(ctx.runtime.get("shims_loaded") or []))
    if ctx.runtime.get("cuda_alias") and not shims:
        shims = ["torch.cuda is patched"]
    if not shims:
        return None
    return Fire({"modules": ", ".join(shims), "device_type": ctx.p.device_type})


def _driver_cuda(ctx: Ctx) -> str | None:
    for tool, info in sorted((ctx.snap.get("smi") or {}).items()):
        m = re.search(r"CUDA Version:\s*(\d+\.\d+)", (info or {}).get("header") or "")
        if m and tool in ctx.p.smi_tools:
            return m.group(1)
    return None


@check("driver-older-than-runtime")
def _driver(ctx: Ctx) -> Fire | Skip | None:
    runtime_cuda = ctx.torch["cuda"]
    if not ctx.p.cuda_compatible or not runtime_cuda or ctx.torch["hip"]:
        return None
    driver = _driver_cuda(ctx)
    too_old = any("too old" in w and "driver" in w.lower() for w in ctx.runtime.get("warnings") or [])
    if driver and _release(driver) < _release(runtime_cuda) or too_old:
        return Fire({"driver": driver or "an older version", "runtime": runtime_cuda})
    if driver or (ctx.runtime.get("ok") and ctx.runtime.get("count")):
        return None
    return Skip("run `polyrl check --deep` to read the driver version")


@check("cpu-torch-on-accelerator")
def _cpu_torch(ctx: Ctx) -> Fire | None:
    hw = _hardware(ctx)
    if not hw or not _cpu_build(ctx):
        return None
    return Fire({"found": ctx.torch["version"], "evidence": ", ".join(hw)})


@check("accelerator-invisible")
def _invisible(ctx: Ctx) -> Fire | Skip | None:
    p = ctx.p
    hw = _hardware(ctx)
    if not _is_accelerator(p) or p.generic or not hw:
        return None
    skip = _no_runtime(ctx)
    if skip:
        return skip
    ext_missing = p.vendor_extension and not ((ctx.snap.get("modules") or {}).get(p.vendor_extension) or {}).get(
        "found"
    )
    if ctx.runtime.get("count") or _cpu_build(ctx) or _replaced(ctx) or ext_missing:
        return None
    hidden = [f"{v}={ctx.env[v]!r}" for v in p.visible_devices if v in ctx.env]
    reason = f" ({', '.join(hidden)})" if hidden else ""
    smi = p.smi_tools[0] if p.smi_tools else "the vendor's device tool"
    return Fire(
        {"evidence": ", ".join(hw), "reason": reason, "vars": ", ".join(p.visible_devices) or "no variable", "smi": smi}
    )


@check("allocator-var-no-effect")
def _allocator(ctx: Ctx) -> Fire | None:
    p = ctx.p
    if not _is_accelerator(p):
        return None
    every = sorted({v for q in kb.platforms().values() for v in q.allocator_env})
    stray = [v for v in every if v in ctx.env and v not in p.allocator_env]
    if not stray:
        return None
    own = " or ".join(p.allocator_env) or "nothing (this platform has no such variable)"
    return Fire({"var": stray[0], "own": own}, ("allocator_env",))


@check("no-compiler-for-triton")
def _compiler(ctx: Ctx) -> Fire | None:
    if not ctx.snap.get("triton_providers") or not _is_accelerator(ctx.p) or ctx.snap.get("compilers"):
        return None
    return Fire()


_CACHES = {"triton_cache": "Triton cache directory", "hf_cache": "Hugging Face cache directory"}


@check("cache-dir-unwritable")
def _cache_dirs(ctx: Ctx) -> Fire | None:
    writable = ctx.snap.get("writable") or {}
    for key, what in _CACHES.items():
        entry = writable.get(key)
        if entry and not entry.get("writable"):
            return Fire({"what": what, "path": entry["path"], "var": entry.get("var") or "the cache variable"})
    return None


@check("output-dir-unwritable")
def _output_dir(ctx: Ctx) -> Fire | None:
    entry = (ctx.snap.get("writable") or {}).get("output")
    return Fire({"path": entry["path"]}) if entry and not entry.get("writable") else None


@check("unknown-cuda-compatible")
def _unknown(ctx: Ctx) -> Fire | None:
    if ctx.res.platform != "cuda-compatible":
        return None
    names = sorted({str(d.get("name")) for d in ctx.runtime.get("devices") or []})
    return Fire({"name": ", ".join(names) or "unnamed"})


@check("collective-backend-missing")
def _collectives(ctx: Ctx) -> Fire | Skip | None:
    skip = _no_runtime(ctx)
    if skip:
        return skip
    have = ctx.runtime.get("collectives")
    if have is None or ctx.p.collective_backend in have:
        return None
    if _is_accelerator(ctx.p) and not ctx.runtime.get("count"):
        return None  # no device is visible: accelerator-invisible or a build rule says why
    return Fire(
        {"backend": ctx.p.collective_backend, "library": ctx.p.collective_library},
        ("collective_backend", "collective_library"),
    )


@check("device-smoke-failed")
def _smoke(ctx: Ctx) -> Fire | Skip | None:
    if not ctx.snap.get("deep"):
        return Skip("run `polyrl check --deep` to run a tensor op on the device")
    skip = _no_runtime(ctx)
    if skip:
        return skip
    smoke = ctx.runtime.get("smoke") or {}
    if smoke.get("ok", True):
        return None
    return Fire({"error": smoke.get("error") or f"wrong result {smoke.get('value')}", "device_type": ctx.p.device_type})


# --- evaluation -------------------------------------------------------------------------------------------------------


def _fill(template: str, params: dict[str, Any]) -> str:
    return template.format_map(params)


def evaluate(snap: dict[str, Any], res: Resolution) -> list[Row]:
    """One row per rule, in pitfalls.toml order."""
    p = kb.platform(res.platform)
    ctx = Ctx(snap, res, p)
    rows = []
    for rule in kb.rules():
        fn = CHECKS.get(rule.id)
        if fn is None:
            raise RuntimeError(f"pitfall rule {rule.id!r} has no check in {__name__}")
        out = fn(ctx)
        if out is None:
            rows.append(Row(rule.id, "OK", rule.title))
        elif isinstance(out, Skip):
            rows.append(Row(rule.id, "SKIP", rule.title, out.reason))
        else:
            a_noun = ("an " if p.noun[0].lower() in "aeiou" else "a ") + p.noun
            params = {
                "platform": p.name,
                "noun": p.noun,
                "a_noun": a_noun,
                "hedge": p.hedge(*out.hedge_facts),
                "hedge_cap": "",
            }
            params.update({k: str(v) for k, v in out.params.items()})
            status = "FAIL" if rule.severity == "fail" else "WARN"
            rows.append(Row(rule.id, status, rule.title, _fill(rule.message, params), _fill(rule.next_step, params)))
    return rows


def ready(rows: list[Row]) -> bool:
    """Ready when no rule fails."""
    return not any(r.status == "FAIL" for r in rows)
