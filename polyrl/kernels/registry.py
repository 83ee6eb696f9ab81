"""Kernel registry: which implementation of each op runs on which device and dtype.

Each op package (``polyrl/kernels/<op>/__init__.py``) registers its implementations with a lazy
loader, so importing the registry never imports triton. Selection, per (op, device type, dtype):

1. ``POLYRL_KERNELS`` forces a choice (``reference`` for all ops, or ``op:impl,op:impl``); a forced
   choice that cannot load or does not support the device/dtype raises ``KernelUnavailable``.
2. Otherwise the highest-priority implementation that declares the device type and dtype and loads
   wins; one that fails to load is skipped with a single warning and the next one is tried. The
   reference supports everything and always loads.

This module does not decide what a platform is (that is ``polyrl.platform``); it only matches the
device type string of the tensors it is handed.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from polyrl.platform import envvars

ANY = "*"


class KernelUnavailable(RuntimeError):
    """A forced kernel implementation cannot be used here."""


@dataclass(frozen=True)
class Implementation:
    op: str
    name: str
    loader: str  # "module:attribute", imported on first use
    devices: frozenset[str] = frozenset({ANY})
    dtypes: frozenset[str] = frozenset({ANY})  # "float32", "bfloat16", "float16"
    priority: int = 0
    description: str = ""

    def supports(self, device_type: str, dtype: str) -> bool:
        dev_ok = ANY in self.devices or device_type in self.devices
        dt_ok = ANY in self.dtypes or dtype in self.dtypes
        return dev_ok and dt_ok

    def load(self) -> Callable[..., Any]:
        module_name, _, attr = self.loader.partition(":")
        module = importlib.import_module(module_name)
        return getattr(module, attr)


@dataclass
class _Registry:
    impls: dict[str, dict[str, Implementation]] = field(default_factory=dict)
    loaded: dict[tuple[str, str], Callable[..., Any]] = field(default_factory=dict)
    failed: dict[tuple[str, str], str] = field(default_factory=dict)
    selected: dict[tuple[str, str, str, str | None], tuple[str, Callable[..., Any]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_REG = _Registry()


def register(
    op: str,
    name: str,
    loader: str,
    *,
    devices: tuple[str, ...] | frozenset[str] = (ANY,),
    dtypes: tuple[str, ...] | frozenset[str] = (ANY,),
    priority: int = 0,
    description: str = "",
) -> None:
    impl = Implementation(op, name, loader, frozenset(devices), frozenset(dtypes), priority, description)
    with _REG.lock:
        _REG.impls.setdefault(op, {})[name] = impl
        _REG.selected.clear()


def ops() -> list[str]:
    return sorted(_REG.impls)


def implementations(op: str) -> list[Implementation]:
    if op not in _REG.impls:
        raise KeyError(f"unknown kernel op {op!r}; known ops: {', '.join(ops())}")
    return sorted(_REG.impls[op].values(), key=lambda i: -i.priority)


def parse_forced(spec: str | None) -> dict[str, str]:
    """Parse POLYRL_KERNELS. ``reference`` -> {"*": "reference"}; ``a:x,b:y`` -> {"a": "x", "b": "y"}."""
    if not spec:
        return {}
    forced: dict[str, str] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            op, _, impl = part.partition(":")
            forced[op.strip()] = impl.strip()
        else:
            forced[ANY] = part
    return forced


def load(op: str, name: str) -> Callable[..., Any]:
    """Load one named implementation (raises KernelUnavailable when it cannot load)."""
    impls = _REG.impls.get(op, {})
    if name not in impls:
        known = ", ".join(sorted(impls)) or "none"
        raise KernelUnavailable(f"kernel {op!r} has no implementation {name!r} (available: {known})")
    key = (op, name)
    if key in _REG.loaded:
        return _REG.loaded[key]
    try:
        fn = impls[name].load()
    except Exception as exc:  # noqa: BLE001 - any import failure means "unavailable here"
        _REG.failed[key] = f"{type(exc).__name__}: {exc}"
        raise KernelUnavailable(f"kernel {op}:{name} failed to load: {type(exc).__name__}: {exc}") from exc
    _REG.loaded[key] = fn
    return fn


def select(op: str, device_type: str, dtype: str) -> tuple[str, Callable[..., Any]]:
    """The (implementation name, function) to run ``op`` for tensors on ``device_type`` of ``dtype``."""
    forced_spec = envvars.get(envvars.POLYRL_KERNELS)
    cache_key = (op, device_type, dtype, forced_spec)
    hit = _REG.selected.get(cache_key)
    if hit is not None:
        return hit
    forced = parse_forced(forced_spec)
    name = forced.get(op, forced.get(ANY))
    if name is not None:
        impls = _REG.impls.get(op, {})
        if name in impls and not impls[name].supports(device_type, dtype):
            raise KernelUnavailable(
                f"POLYRL_KERNELS forces {op}:{name}, which does not support {device_type}/{dtype}; "
                f"unset POLYRL_KERNELS or force another implementation"
            )
        result = (name, load(op, name))
    else:
        result = _auto_select(op, device_type, dtype)
    _REG.selected[cache_key] = result
    return result


def _auto_select(op: str, device_type: str, dtype: str) -> tuple[str, Callable[..., Any]]:
    for impl in implementations(op):
        if not impl.supports(device_type, dtype):
            continue
        try:
            return impl.name, load(op, impl.name)
        except KernelUnavailable as exc:
            warnings.warn(f"{exc}; falling back to the next implementation", RuntimeWarning, stacklevel=3)
    raise KernelUnavailable(f"no implementation of {op!r} supports {device_type}/{dtype}")


def failures() -> dict[tuple[str, str], str]:
    """Implementations that failed to load in this process, with the reason."""
    return dict(_REG.failed)


def reset_cache() -> None:
    """Forget selections (tests change POLYRL_KERNELS between calls)."""
    with _REG.lock:
        _REG.selected.clear()
        _REG.loaded.clear()
        _REG.failed.clear()
