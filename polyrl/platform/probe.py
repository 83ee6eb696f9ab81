"""Facts about this machine, gathered without side effects, as one plain JSON-able dict (the *snapshot*).

Tiers, cheapest first: environment variables, device nodes, smi tools on PATH (their header output only when
``deep``), SDK paths, installed distributions with their local version label, which distributions provide the
``triton`` package, vendor extension module specs (found, never imported), ``torch/version.py`` read as text, and
finally a subprocess with a timeout that imports torch and reports device facts, or the error text when the
import fails or hangs. This process never imports torch here, so ``polyrl check`` still answers when
``import torch`` crashes.

Everything is injectable (environment mapping, ``sys.path``, filesystem root, loaded-module table, python
executable) so tests drive the real mechanisms with fake dist-info directories, fake smi scripts and fake
modules. This module does not decide which platform this is (``resolve``) or what is wrong (``pitfalls``).
"""

from __future__ import annotations

import ast
import glob
import importlib.machinery
import importlib.metadata
import json
import os
import platform as _platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from polyrl.platform import envvars, kb

SCHEMA = 1
TORCH_TIMEOUT_S = 30.0
DEEP_TORCH_TIMEOUT_S = 120.0
SMI_TIMEOUT_S = 10.0

# Variables recorded besides the knowledge base's (visible devices, SDK, allocator) and polyrl's own.
EXTRA_ENV = (
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
    "TRITON_CACHE_DIR",
    "TRITON_INTERPRET",
    "TRITON_HOME",
    "CC",
    "HF_HOME",
    "XDG_CACHE_HOME",
    "LD_LIBRARY_PATH",
)
# Distributions worth reporting (normalised names): the torch family, Triton builds, engines that pin torch.
_RELEVANT_DIST = re.compile(
    r"^(torch|triton|pytorch-triton|intel-extension-for-pytorch|vllm|sglang|flash-attn|tilelang|transformers|numpy|"
    r"polyrl|deepspeed|mate|torchada)"
)
_COMPILERS = ("cc", "gcc", "clang")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def local_label(version: str) -> str | None:
    """The local version label: "2.6.0+metax" -> "metax"; None when there is none."""
    return version.split("+", 1)[1] if "+" in version else None


# --- tier 1: environment, device nodes, smi tools, SDK paths -------------------------------------------------


def _env_names() -> tuple[str, ...]:
    return tuple(sorted(set(kb.all_env_names()) | {v.name for v in envvars.ALL} | set(EXTRA_ENV)))


def probe_env(env: Mapping[str, str]) -> dict[str, str]:
    """The relevant variables that are set (never the whole environment)."""
    return {name: env[name] for name in _env_names() if name in env}


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def probe_device_nodes(root: str = "/") -> list[str]:
    """Device nodes matching any platform's patterns, as absolute paths relative to ``root``."""
    found: set[str] = set()
    for p in kb.platforms().values():
        for pattern in p.device_nodes:
            for hit in glob.glob(_under(root, pattern)):
                found.add("/" + os.path.relpath(hit, root).replace(os.sep, "/"))
    return sorted(found)[:128]


def probe_sdk_paths(root: str = "/") -> list[str]:
    """SDK install paths from the knowledge base that exist."""
    paths = {s for p in kb.platforms().values() for s in p.sdk_paths}
    return sorted(s for s in paths if os.path.isdir(_under(root, s)))


def _smi_header(path: str, args: tuple[str, ...], env: Mapping[str, str]) -> dict[str, Any]:
    try:
        proc = subprocess.run(
            [path, *args], capture_output=True, text=True, timeout=SMI_TIMEOUT_S, env=dict(env), check=False
        )
    except subprocess.TimeoutExpired:
        return {"header": None, "error": f"no answer within {SMI_TIMEOUT_S:.0f} s"}
    except OSError as exc:
        return {"header": None, "error": str(exc)}
    lines = [ln.rstrip() for ln in (proc.stdout or proc.stderr).splitlines() if ln.strip()]
    return {"header": "\n".join(lines[:12]), "returncode": proc.returncode}


def probe_smi(env: Mapping[str, str], deep: bool = False) -> dict[str, dict[str, Any]]:
    """smi tools found on ``env['PATH']``; with ``deep``, the first lines each prints (with a timeout)."""
    search = env.get("PATH", "")
    args = kb.smi_args()
    found: dict[str, dict[str, Any]] = {}
    for tool in sorted({t for p in kb.platforms().values() for t in p.smi_tools}):
        path = shutil.which(tool, path=search)
        if path is None:
            continue
        entry: dict[str, Any] = {"path": path, "header": None}
        if deep:
            entry.update(_smi_header(path, args.get(tool, ()), env))
        found[tool] = entry
    return found


def probe_compilers(env: Mapping[str, str]) -> dict[str, str]:
    """C compilers Triton's JIT could use: $CC and cc/gcc/clang on PATH."""
    out = {}
    if env.get("CC"):
        hit = shutil.which(env["CC"].split()[0], path=env.get("PATH", ""))
        if hit:
            out["CC"] = hit
    for name in _COMPILERS:
        hit = shutil.which(name, path=env.get("PATH", ""))
        if hit:
            out[name] = hit
    return out


# --- tier 2: installed distributions, Triton providers, module specs, torch/version.py -----------------------


def _dist_files(dist: importlib.metadata.Distribution) -> list[str]:
    text = dist.read_text("RECORD") or ""
    return [line.split(",", 1)[0] for line in text.splitlines() if line]


def probe_distributions(sys_path: list[str]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """(relevant distributions by normalised name, distributions providing the top-level ``triton`` package).

    The first distribution of a name on ``sys_path`` wins, as for imports; a later one is listed under
    ``shadowed``. Triton providers are found from ``top_level.txt`` or ``RECORD`` (no import).
    """
    dists: dict[str, dict[str, Any]] = {}
    providers: list[dict[str, Any]] = []
    seen_providers: set[tuple[str, str]] = set()
    for dist in importlib.metadata.distributions(path=list(sys_path)):
        raw_name = dist.metadata["Name"] if dist.metadata else None
        if not raw_name:
            continue
        name, version = _norm(raw_name), dist.version
        location = str(getattr(dist, "_path", "")) or None
        if _RELEVANT_DIST.match(name):
            if name in dists:
                dists[name].setdefault("shadowed", []).append(version)
            else:
                dists[name] = {"version": version, "local": local_label(version), "location": location}
        top_level = (dist.read_text("top_level.txt") or "").split()
        files = _dist_files(dist) if "triton" not in top_level else []
        if "triton" in top_level or any(f.startswith("triton/") for f in files):
            files = files or _dist_files(dist)
            backends = sorted(
                {
                    f.split("/")[2]
                    for f in files
                    if f.startswith("triton/backends/") and f.count("/") >= 3 and "__" not in f.split("/")[2]
                }
            )
            key = (name, version)
            if key not in seen_providers:
                seen_providers.add(key)
                providers.append(
                    {"dist": name, "version": version, "local": local_label(version), "backends": backends}
                )
    return dists, providers


def probe_module_specs(sys_path: list[str]) -> dict[str, dict[str, Any]]:
    """For torch, triton and every vendor extension or shim's top-level module: found on ``sys_path``? (no import)"""
    names = {"torch", "triton"}
    for p in kb.platforms().values():
        if p.vendor_extension:
            names.add(p.vendor_extension)
        names.update(m.split(".")[0] for m in p.shim_modules)
    out = {}
    for name in sorted(names):
        spec = importlib.machinery.PathFinder.find_spec(name, list(sys_path))
        out[name] = {"found": spec is not None, "origin": (spec.origin if spec else None)}
    return out


def probe_loaded_shims(modules: Mapping[str, Any]) -> list[str]:
    """CUDA-alias shim modules already imported in this process (``modules`` is usually ``sys.modules``)."""
    shims = {m for p in kb.platforms().values() for m in p.shim_modules}
    return sorted(m for m in shims if m in modules)


def probe_torch_version_file(sys_path: list[str]) -> dict[str, Any] | None:
    """``torch/version.py`` parsed as text (no import): version, cuda, hip, rocm, xpu, git_version."""
    spec = importlib.machinery.PathFinder.find_spec("torch", list(sys_path))
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError) as exc:
        return {"path": str(path), "error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {"path": str(path)}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            key = "version" if target.id == "__version__" else target.id
            if key in ("version", "cuda", "hip", "rocm", "xpu", "git_version", "debug"):
                out[key] = value.value
    return out


# --- tier 3: torch in a subprocess ---------------------------------------------------------------------------

_TORCH_CODE = r"""
import json, sys, time, traceback, warnings
t0 = time.time()
shims, deep = json.loads(sys.argv[1]), sys.argv[2] == "1"
out = {"ok": False}
err = lambda exc: "".join(traceback.format_exception_only(type(exc), exc)).strip()
try:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch
        out["version"] = torch.__version__
        mod, dtype = None, "cpu"
        for name in ("npu", "musa", "mlu", "xpu"):
            m = getattr(torch, name, None)
            try:
                if m is not None and m.is_available():
                    mod, dtype = m, name
                    break
            except Exception:
                pass
        cuda_available = bool(torch.cuda.is_available())
        out["cuda_available"] = cuda_available
        out["cuda_alias"] = not str(getattr(torch.cuda.is_available, "__module__", "")).startswith("torch.cuda")
        if mod is None and cuda_available:
            mod, dtype = torch.cuda, "cuda"
        mps = getattr(torch.backends, "mps", None)
        if mod is None and mps is not None and mps.is_available():
            dtype = "mps"
        out["device_type"] = dtype
        devices = []
        if mod is not None:
            for i in range(int(mod.device_count())):
                d = {"name": str(mod.get_device_name(i))}
                try:
                    d["capability"] = list(mod.get_device_capability(i))
                except Exception:
                    d["capability"] = None
                try:
                    d["total_memory"] = int(mod.get_device_properties(i).total_memory)
                except Exception:
                    d["total_memory"] = None
                try:
                    d["arch"] = getattr(mod.get_device_properties(i), "gcnArchName", None)
                except Exception:
                    d["arch"] = None
                devices.append(d)
            try:
                out["bf16"] = bool(mod.is_bf16_supported())
            except Exception:
                out["bf16"] = None
        elif dtype == "mps":
            devices.append({"name": "mps", "capability": None, "total_memory": None})
            out["bf16"] = True
        else:
            out["bf16"] = True
        out["count"] = len(devices)
        out["devices"] = devices
        try:
            import torch.distributed as dist
            names = dist.Backend.backend_list if dist.is_available() else []
            avail = []
            for b in names:
                check = getattr(dist, "is_%s_available" % b, None)
                if b not in ("undefined", "fake") and (check is None or check()):
                    avail.append(b)
            out["collectives"] = sorted(avail)
        except Exception:
            out["collectives"] = []
        if deep:
            try:
                x = torch.ones(64, 64, device=dtype)
                y = (x @ x).sum().item()
                out["smoke"] = {"ok": y == 64.0 * 64 * 64, "value": y}
            except Exception as exc:
                out["smoke"] = {"ok": False, "error": err(exc)[-600:]}
        out["ok"] = True
    out["warnings"] = sorted({str(w.message)[:300] for w in caught})[:10]
except BaseException as exc:
    out["error"] = err(exc)[-1200:]
    out["traceback"] = traceback.format_exc()[-4000:]
out["shims_loaded"] = sorted(m for m in shims if m in sys.modules)
out["seconds"] = round(time.time() - t0, 2)
print("POLYRL_PROBE=" + json.dumps(out))
"""


def probe_torch_runtime(
    env: Mapping[str, str], python: str = sys.executable, deep: bool = False, timeout: float | None = None
) -> dict[str, Any]:
    """Import torch in a fresh interpreter (with ``env``) and report device facts, or why it failed."""
    shims = sorted({m for p in kb.platforms().values() for m in p.shim_modules})
    limit = timeout if timeout is not None else (DEEP_TORCH_TIMEOUT_S if deep else TORCH_TIMEOUT_S)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [python, "-c", _TORCH_CODE, json.dumps(shims), "1" if deep else "0"],
            capture_output=True,
            text=True,
            timeout=limit,
            env=dict(env),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "timed_out": True, "error": f"import torch did not finish within {limit:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("POLYRL_PROBE="):
            return json.loads(line[len("POLYRL_PROBE=") :])
    tail = (proc.stderr or proc.stdout).strip()[-1200:]
    return {
        "ok": False,
        "error": f"the torch probe exited with code {proc.returncode} without a report: {tail}",
        "seconds": round(time.monotonic() - t0, 2),
    }


# --- the writable directories ---------------------------------------------------------------------------------


def _writable(path: str) -> bool:
    """Whether ``path`` (or, when it does not exist yet, its nearest existing parent) is writable."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return os.access(p, os.W_OK | os.X_OK)


def probe_writable(env: Mapping[str, str], cwd: str, home: str) -> dict[str, dict[str, Any]]:
    """Cache and output directories polyrl and its dependencies write to."""
    cache = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    dirs = {
        "triton_cache": (
            env.get("TRITON_CACHE_DIR") or os.path.join(env.get("TRITON_HOME") or home, ".triton", "cache"),
            "TRITON_CACHE_DIR",
        ),
        "hf_cache": (env.get("HF_HOME") or os.path.join(cache, "huggingface"), "HF_HOME"),
        "output": (cwd, ""),
    }
    return {k: {"path": p, "var": var, "writable": _writable(p)} for k, (p, var) in dirs.items()}


# --- the snapshot ----------------------------------------------------------------------------------------------


def collect(
    env: Mapping[str, str] | None = None,
    sys_path: list[str] | None = None,
    *,
    deep: bool = False,
    root: str = "/",
    modules: Mapping[str, Any] | None = None,
    python: str = sys.executable,
    cwd: str | None = None,
    home: str | None = None,
    torch_timeout: float | None = None,
) -> dict[str, Any]:
    """The snapshot of this machine (or of the injected environment, path, root and module table)."""
    env = dict(os.environ if env is None else env)
    sys_path = list(sys.path if sys_path is None else sys_path)
    dists, providers = probe_distributions(sys_path)
    return {
        "schema": SCHEMA,
        "deep": deep,
        "python": {"version": _platform.python_version(), "implementation": _platform.python_implementation()},
        "os": {"system": _platform.system(), "release": _platform.release(), "machine": _platform.machine()},
        "env": probe_env(env),
        "device_nodes": probe_device_nodes(root),
        "sdk_paths": probe_sdk_paths(root),
        "smi": probe_smi(env, deep=deep),
        "compilers": probe_compilers(env),
        "distributions": dists,
        "triton_providers": providers,
        "modules": probe_module_specs(sys_path),
        "loaded_shims": probe_loaded_shims(sys.modules if modules is None else modules),
        "torch_version_file": probe_torch_version_file(sys_path),
        "torch_runtime": probe_torch_runtime(env, python=python, deep=deep, timeout=torch_timeout),
        "writable": probe_writable(env, cwd or os.getcwd(), home or os.path.expanduser("~")),
    }
