"""polyrl.algorithms: the algorithm registry. Each algorithm is an ``AlgorithmSpec`` (name, config dataclass,
loss, how batches are built, how a run goes) that lives in its own module.

Registering a builtin algorithm is one row in ``ALGORITHMS`` (name -> module); the module defines
``SPEC = AlgorithmSpec(...)``. Code outside the package (a plugin, a test) calls ``register(spec)`` instead.
Modules are imported only when their algorithm is looked up, so ``import polyrl.algorithms`` is cheap and a
broken module never breaks the others. The CLI does ``get(args.algo)`` and nothing else: it never branches
on algorithm names.

Offline algorithms (SFT, DPO) give ``build_data`` and ``make_loss`` and leave ``run`` unset: the shared loop
in ``polyrl.algorithms.runner`` trains them. Online ones (GRPO, PPO) give their own ``run``.
This module holds no training code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from polyrl.errors import ConfigError

# name -> module that defines ``SPEC``. Add an algorithm by adding a row and a module.
ALGORITHMS: dict[str, str] = {
    "sft": "polyrl.algorithms.sft",
    "grpo": "polyrl.algorithms.grpo",
    "gspo": "polyrl.algorithms.gspo",
    "dpo": "polyrl.algorithms.dpo",
    "ppo": "polyrl.algorithms.ppo",
}

_REGISTERED: dict[str, AlgorithmSpec] = {}


@dataclass
class NoConfig:
    """Config of an algorithm without settings of its own (an empty ``[<algo>]`` table)."""


@dataclass(frozen=True)
class AlgorithmSpec:
    """How to train with one algorithm.

    - ``config_cls``: dataclass of the ``[<name>]`` TOML table, validated in ``__post_init__`` (ConfigError).
    - ``build_data(data_cfg, tokenizer, part) -> TokenizedData``: the packed-batch source ("train" / "test").
    - ``make_loss(algo_cfg) -> loss_fn(model, batch) -> (loss_sum, metric_sums)``: the engine's loss form.
    - ``normalizer(algo_cfg, micro_batches) -> float | None``: the step's loss divisor (None: target tokens).
    - ``run(run_cfg) -> summary dict``: a whole run; None means the shared offline loop
      (``polyrl.algorithms.runner.run_offline``), which uses the three hooks above.
    - ``plot_series``: metric names drawn in the run's ``metrics.png`` besides loss / lr / grad norm.
    - ``fixed_shapes``: whether its batches may be padded to one shape (``data.fixed_shapes``): the loss and
      normaliser must ignore padding-only and empty sequences (SFT's do; DPO counts sequences as pairs).
    """

    name: str
    description: str
    config_cls: type = NoConfig
    build_data: Callable[..., Any] | None = None
    make_loss: Callable[[Any], Callable[..., Any]] | None = None
    normalizer: Callable[[Any, Any], float | None] | None = None
    run: Callable[[Any], dict[str, Any]] | None = None
    plot_series: tuple[str, ...] = ()
    fixed_shapes: bool = False

    def __post_init__(self) -> None:
        if self.run is None and (self.build_data is None or self.make_loss is None):
            raise ValueError(f"algorithm {self.name!r}: give run, or build_data and make_loss for the offline loop")

    def make_config(self, table: dict[str, Any] | None) -> Any:
        """The algorithm's config from its TOML table; unknown keys are a ConfigError naming the known ones."""
        import dataclasses

        table = dict(table or {})
        known = {f.name for f in dataclasses.fields(self.config_cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            hint = f"known: {', '.join(sorted(known))}" if known else f"{self.name} has no settings"
            raise ConfigError(f"unknown {self.name} setting(s) {unknown}; {hint}")
        return self.config_cls(**table)


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


__all__ = ["ALGORITHMS", "AlgorithmSpec", "NoConfig", "get", "names", "register"]
