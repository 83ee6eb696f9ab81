"""polyrl.algorithms: the algorithm registry. Each algorithm is an ``AlgorithmSpec`` (name, config dataclass,
loss, how batches are built, how a run goes) that lives in its own module.

Registering a builtin algorithm is one row in ``ALGORITHMS`` (name -> module); the module defines
``SPEC = AlgorithmSpec(...)``. Code outside the package (a plugin, a test) calls ``register(spec)`` instead.
Modules are imported only when their algorithm is looked up, so ``import polyrl.algorithms`` is cheap and a
broken module never breaks the others. The CLI does ``get(args.algo)`` and nothing else: it never branches
on algorithm names.

Offline algorithms (SFT, DPO) give ``build_data`` and ``make_loss``; online ones (GRPO, GSPO, PPO) give ``hooks``.
Each names the loop that trains it (``loop``); the loops are the run machinery of ``polyrl.run``, which this package
never imports. This module holds no training code.
"""

from __future__ import annotations

import importlib

from polyrl.algorithms.spec import AlgorithmSpec, NoConfig, PrepareContext
from polyrl.errors import ConfigError

# name -> module that defines ``SPEC``. Add an algorithm by adding a row and a module.
ALGORITHMS: dict[str, str] = {
    "sft": "polyrl.algorithms.sft",
    "grpo": "polyrl.algorithms.grpo",
    "gspo": "polyrl.algorithms.gspo",
    "dpo": "polyrl.algorithms.dpo",
    "ppo": "polyrl.algorithms.ppo",
    "rm": "polyrl.algorithms.rm",
    "distill": "polyrl.algorithms.distill",
}

_REGISTERED: dict[str, AlgorithmSpec] = {}


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Make ``spec`` available under ``spec.name`` (replacing an earlier registration of that name)."""
    _REGISTERED[spec.name] = spec
    return spec


def names() -> list[str]:
    """Every algorithm name: the builtin table and runtime registrations."""
    return sorted(set(ALGORITHMS) | set(_REGISTERED))


def get(name: str) -> AlgorithmSpec:
    """The spec of ``name``; an unknown name is a ConfigError that lists the registered ones."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of: {', '.join(names())}")
    module = importlib.import_module(ALGORITHMS[name])
    spec = getattr(module, "SPEC", None)
    if not isinstance(spec, AlgorithmSpec) or spec.name != name:
        raise RuntimeError(f"{ALGORITHMS[name]} must define SPEC = AlgorithmSpec(name={name!r}, ...)")
    return register(spec)


__all__ = ["ALGORITHMS", "AlgorithmSpec", "NoConfig", "PrepareContext", "get", "names", "register"]
