"""``AlgorithmSpec``: what an algorithm gives the run (its config table, data and loss hooks, or online hooks, and
the loop that trains it by name), and ``PrepareContext``, what the run gives an offline algorithm's ``prepare`` hook.
Registration and lookup are ``polyrl.algorithms`` (the package); the loops are ``polyrl.run``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from polyrl.errors import ConfigError, did_you_mean

if TYPE_CHECKING:  # annotations only: ``import polyrl.algorithms`` stays free of torch (the CLI lists names with it)
    from polyrl.algorithms.online_config import OnlineHooks
    from polyrl.train.config import PrecisionConfig
    from polyrl.train.parallel.world import World


@dataclass
class NoConfig:
    """Config of an algorithm without settings of its own (an empty ``[<algo>]`` table)."""


@dataclass(frozen=True)
class PrepareContext:
    """What an offline algorithm's ``prepare`` hook gets from the run, before the model is loaded."""

    algo_config: Any  # the algorithm's table (its ``config_cls``)
    model: str  # the run's model folder (HF or PEFT adapter)
    out: Path  # the run directory (for caches)
    precision: PrecisionConfig
    micro_batch_tokens: int  # the run's packing budget (``engine.micro_batch_tokens``)
    datasets: list[Any]  # the ``TokenizedData`` the run will train and evaluate on
    world: World
    stream: TextIO  # where to report (rank 0's stdout; devnull on other ranks)
    base: str | None = None  # ``lora.base``: the base of an adapter folder given as ``model``, repointed by the user


@dataclass(frozen=True)
class AlgorithmSpec:
    """How to train with one algorithm.

    - ``config_cls``: dataclass of the ``[<name>]`` TOML table, validated in ``__post_init__`` (ConfigError).
    - ``loop``: the run loop that trains it, by name (``polyrl.run.LOOPS``): ``"offline"`` (packed data, one loss),
      ``"online"`` (rollout, rewards, advantages; ``hooks``) or ``"actor_critic"`` (online with a critic: PPO).
    - Offline: ``build_data(data_cfg, tokenizer, part, micro_batch_tokens) -> TokenizedData`` ("train" / "test");
      ``make_loss(algo_cfg) -> loss_fn(model, batch) -> (loss_sum, metric_sums)``; ``normalizer(algo_cfg,
      micro_batches) -> float | None`` (the step's loss divisor; None: target tokens); optional ``prepare(ctx) ->
      make_loss``: work before the model loads that the loss needs (DPO: the reference log-probs), returning the
      loss factory to use instead of ``make_loss``.
    - Online: ``hooks(algo_cfg) -> OnlineHooks`` (``polyrl.algorithms.online_config``).
    - ``plot_series``: metric names drawn in the run's ``metrics.png`` besides loss / lr / grad norm (a name with ``*``
      is one panel of every metric it matches: ``eval_pass@*``).
    - Offline, optional: ``model_loader(path, dtype, device, seed) -> model`` loads the model the run trains instead
      of the causal LM (``rm``: a reward model); ``finalize(folder, tokenizer) -> folder`` rewrites the saved final
      folder (``rm``: marks it as a sequence classifier). Neither supports LoRA.
    - ``fixed_shapes``: whether its batches may be padded to one shape (``data.fixed_shapes``): the loss and
      normaliser must ignore padding-only and empty sequences (SFT's do; DPO counts sequences as pairs).
    """

    name: str
    description: str
    config_cls: type = NoConfig
    loop: str = "offline"
    build_data: Callable[..., Any] | None = None
    make_loss: Callable[[Any], Callable[..., Any]] | None = None
    normalizer: Callable[[Any, Any], float | None] | None = None
    prepare: Callable[[PrepareContext], Callable[[Any], Callable[..., Any]]] | None = None
    hooks: Callable[[Any], OnlineHooks] | None = None
    plot_series: tuple[str, ...] = ()
    fixed_shapes: bool = False
    model_loader: Callable[..., Any] | None = None
    finalize: Callable[[Path, Any], Path] | None = None

    def __post_init__(self) -> None:
        if self.loop == "offline" and (self.build_data is None or self.make_loss is None):
            raise ValueError(f"algorithm {self.name!r}: the offline loop needs build_data and make_loss")
        if self.loop != "offline" and self.hooks is None:
            raise ValueError(f"algorithm {self.name!r}: the {self.loop} loop needs hooks")

    def make_config(self, table: dict[str, Any] | None, explain: Callable[[list[str]], str] | None = None) -> Any:
        """The algorithm's config from its TOML table; unknown keys are a ConfigError naming the known ones.
        ``explain(unknown)``: a caller's hint for keys it recognises (" (...)", or "" to fall back to did-you-mean)."""
        table = dict(table or {})
        known = {f.name for f in dataclasses.fields(self.config_cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            hint = f"known: {', '.join(sorted(known))}" if known else f"{self.name} has no settings"
            where = (explain(unknown) if explain is not None else "") or did_you_mean(unknown, known)
            raise ConfigError(f"unknown {self.name} setting(s) {unknown}{where}; {hint}")
        return self.config_cls(**table)


__all__ = ["AlgorithmSpec", "NoConfig", "PrepareContext"]
