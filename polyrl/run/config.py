"""``RunConfig``: one training run (algorithm, model, data, optimizer, engine, checkpoints, loop), resolved
from a TOML/JSON file plus command-line overrides and validated before any model is loaded.

File layout (every table optional; see ``examples/sft_arithmetic.toml``)::

    algo = "sft"            # a name in polyrl.algorithms
    model = "path/to/hf"    # HF folder
    out = "runs/name"       # run directory
    seed = 0                # default for data.seed and engine.seed
    [train]      max_steps / epochs, eval_every, eval_data, eval_before_train, keep_best, log_every,
                 report_to                                                            (LoopConfig)
    [data]       polyrl.data.DataConfig            [optim]      polyrl.train.OptimConfig
    [schedule]   polyrl.train.ScheduleConfig       [precision]  polyrl.train.PrecisionConfig
    [engine]     polyrl.train.StepConfig         [checkpoint] polyrl.train.CheckpointConfig
    [sft]        the algorithm's own table (its spec's config_cls)
    [decoder]    polyrl.models.DecoderOptions (implementation switches; defaults are the measured fastest)
    [reward]     polyrl.algorithms.reward_sources.RewardConfig (reward model, [reward.judge], [reward.code_exec])
    [lora]       polyrl.models.lora.LoraConfig (present = a LoRA run; ``--lora r=16,...`` / ``--qlora`` set it)
    [agent]      a registered episode table (``polyrl.run.episodes``; ``polyrl.agents`` registers ``AgentConfig``)

Overrides are dotted keys (``optim.lr``, ``train.max_steps``, ``model``) applied over the file in order.
Each setting has one name and one owner: the micro-batch budget is ``engine.micro_batch_tokens`` (``StepConfig``),
which the run hands to the data packer and to ``pack_samples``.
Not here: reading data, loading models, or running anything (``polyrl.run.offline`` / ``online``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from polyrl import algorithms
from polyrl.algorithms.online_config import OnlineConfig
from polyrl.algorithms.reward_sources import RewardConfig, check_spec
from polyrl.algorithms.spec import AlgorithmSpec
from polyrl.data.config import DataConfig
from polyrl.errors import ConfigError, did_you_mean
from polyrl.models.config import run_dir_hint
from polyrl.models.decoder import DecoderOptions
from polyrl.models.lora import LoraConfig, base_model_path, is_adapter_dir, make_lora_config, read_adapter_config
from polyrl.run.best import BestMetric
from polyrl.run.episodes import EpisodeConfig, episode_tables
from polyrl.train.config import CheckpointConfig, OptimConfig, PrecisionConfig, ScheduleConfig, StepConfig
from polyrl.train.tracking import parse_report_to

RESOLVED_NAME = "run_config.json"
TOP_LEVEL = ("algo", "model", "out", "seed", "resume")


@dataclass
class LoopConfig:
    """The ``[train]`` table. ``max_steps`` (optimizer steps) wins over ``epochs`` when both are set (as in
    TRL); neither means one epoch. ``eval_every`` > 0 computes the loss on ``eval_data`` (a data spec, read whole:
    ``data.holdout``, ``limit`` and ``split`` pick rows of the training data only; None: the held-out part,
    ``data.holdout`` or a builtin's ``@test``) every that many steps and at the last step;
    ``eval_before_train`` adds one evaluation of the initial model, logged as step 0 (not repeated on resume).
    ``keep_best``: an eval metric as logged (``eval_loss``, ``eval_reward``, ``eval_pass@1``, ...; optional ``min:`` /
    ``max:`` prefix, default min for names containing ``loss``, else max) whose best step's model is kept as
    ``<out>/best`` (``polyrl.run.best``). Both need ``eval_every`` > 0. ``report_to``: the
    experiment trackers (``polyrl.train.tracking``): a comma list of tensorboard, wandb, mlflow (a TOML list works
    too), ``none``, or ``auto`` (TensorBoard when installed); each named library is checked here, before any model
    loads."""

    max_steps: int | None = None
    epochs: float | None = None
    eval_every: int = 0
    eval_data: str | None = None
    eval_before_train: bool = False
    keep_best: str | None = None
    log_every: int = 10
    save_final_model: bool = True
    report_to: str = "auto"

    def __post_init__(self) -> None:
        if self.max_steps is not None and (not _is_int(self.max_steps) or self.max_steps < 1):
            raise ConfigError(
                f"train.max_steps must be a positive integer, got {self.max_steps!r}; e.g. --max-steps 100"
            )
        if self.epochs is not None and (
            not isinstance(self.epochs, (int, float)) or not math.isfinite(self.epochs) or self.epochs <= 0
        ):
            raise ConfigError(f"train.epochs must be a positive number, got {self.epochs!r}; e.g. --epochs 1")
        if not _is_int(self.eval_every) or self.eval_every < 0:
            raise ConfigError(f"train.eval_every must be a non-negative integer, got {self.eval_every!r}")
        if not isinstance(self.eval_before_train, bool):
            raise ConfigError(f"train.eval_before_train must be true or false, got {self.eval_before_train!r}")
        if self.keep_best is not None:
            self.keep_best = str(BestMetric.parse(self.keep_best))  # checked; the direction made explicit
        for key, flag in (("eval_before_train", "--eval-before-train"), ("keep_best", "--keep-best")):
            if getattr(self, key) not in (None, False) and self.eval_every == 0:
                raise ConfigError(
                    f"train.{key} ({flag}) needs evaluation during training: set --eval-every N (train.eval_every) "
                    "and the eval data, --eval-data SPEC (or data.holdout)"
                )
        if not _is_int(self.log_every) or self.log_every < 1:
            raise ConfigError(f"train.log_every must be a positive integer, got {self.log_every!r}")
        if not isinstance(self.report_to, str) or self.report_to.strip() != "auto":
            names = parse_report_to(self.report_to)
            self.report_to = ",".join(names) or "none"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# table -> its config class. Construction order = validation order: optimizer/engine values before paths on disk.
SECTIONS: dict[str, type] = {
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
    "precision": PrecisionConfig,
    "engine": StepConfig,
    "checkpoint": CheckpointConfig,
    "train": LoopConfig,
    "data": DataConfig,
    "decoder": DecoderOptions,
    "reward": RewardConfig,
}


@dataclass
class RunConfig:
    """A resolved, validated run. ``spec`` is the algorithm's ``AlgorithmSpec``; ``algo_config`` its table."""

    algo: str
    model: str
    out: str
    seed: int
    resume: str | None
    data: DataConfig
    optim: OptimConfig
    schedule: ScheduleConfig
    precision: PrecisionConfig
    engine: StepConfig
    checkpoint: CheckpointConfig
    train: LoopConfig
    decoder: DecoderOptions  # the decoder's implementation choices (same numbers, different speed)
    algo_config: Any  # the algorithm's own table: an instance of ``spec.config_cls`` (any dataclass)
    spec: AlgorithmSpec
    lora: LoraConfig | None = None  # a LoRA / QLoRA run
    episodes: EpisodeConfig | None = None  # a registered episode table (``[agent]``): multi-turn rollouts
    episodes_table: str | None = None  # its table name
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)  # reward sources (judge, model, sandbox)

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready form; ``build(to_dict())`` gives the same run. ``resume`` is an action, not a
        setting, so it is left out (re-running a saved config never resumes by surprise)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in TOP_LEVEL if k != "resume"}
        for name in SECTIONS:
            out[name] = dataclasses.asdict(getattr(self, name))
        out[self.algo] = dataclasses.asdict(self.algo_config)
        if self.lora is not None:
            out["lora"] = dataclasses.asdict(self.lora)
        if self.episodes is not None and self.episodes_table is not None:
            out[self.episodes_table] = dataclasses.asdict(self.episodes)
        return out


# ---- reading and overriding ---------------------------------------------------------------------
def load_file(path: str | Path) -> dict[str, Any]:
    """A run config file (``.toml`` or ``.json``) as a dict; a ConfigError says what is wrong with it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; check --config")
    text = p.read_text()
    try:
        if p.suffix == ".json":
            data = json.loads(text)
        else:
            data = tomllib.loads(text)
    except (ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot parse {p}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a table of settings at the top level")
    return data


def parse_value(text: str) -> Any:
    """A command-line value as TOML (``1e-4``, ``true``, ``[0.9, 0.95]``, ``"x"``), else the plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except Exception:  # noqa: BLE001 - anything that is not a TOML literal is a string
        return text


def parse_set(items: list[str]) -> list[tuple[str, Any]]:
    """``["optim.lr=1e-4", ...]`` -> ``[("optim.lr", 0.0001), ...]``."""
    out = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set {item!r} must look like section.key=value, e.g. --set optim.lr=1e-4")
        out.append((key.strip(), parse_value(value.strip())))
    return out


def apply_overrides(raw: dict[str, Any], overrides: list[tuple[str, Any]]) -> dict[str, Any]:
    """A copy of ``raw`` with each dotted ``key`` set to its value (later ones win)."""
    raw = copy.deepcopy(raw)
    for key, value in overrides:
        parts = key.split(".")
        if len(parts) == 1:
            raw[key] = value
        elif len(parts) == 2:
            table = raw.setdefault(parts[0], {})
            if not isinstance(table, dict):
                raise ConfigError(f"cannot set {key}: {parts[0]} is a value, not a table")
            table[parts[1]] = value
        else:
            raise ConfigError(f"override key {key!r} has too many parts; use section.key (e.g. optim.lr)")
    return raw


# ---- building -----------------------------------------------------------------------------------
def _make(cls: type, table: Any, section: str) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"[{section}] must be a table of settings, got {table!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        hint = did_you_mean(unknown, known) or _other_table(unknown, section)
        raise ConfigError(f"unknown {section} setting(s) {unknown}{hint}; known: {', '.join(sorted(known))}")
    try:
        return cls(**table)
    except TypeError as exc:
        raise ConfigError(f"[{section}]: {exc}") from None


def _other_table(names: list[str], section: str) -> str:
    """`` (did you mean train.max_steps?)`` for names that are settings of another table (``optim.max_steps``)."""
    tables = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in SECTIONS.items() if name != section}
    found = [f"{t}.{n}" for n in names for t, keys in tables.items() if n in keys]
    return f" (did you mean {' or '.join(found)}?)" if found else ""


# settings that moved, with where they live now: named in the error instead of a bare "unknown setting"
MOVED: dict[str, str] = {
    "data.tokens_per_batch": "engine.micro_batch_tokens",
    **{f"<algo>.{k}": f"agent.{k}" for k in ("env", "agent", "max_turns", "max_episode_tokens", "env_workers")},
    "<algo>.env_timeout": "agent.env_timeout",
}


def build(raw: dict[str, Any]) -> RunConfig:
    """Validate ``raw`` (file + overrides) into a RunConfig. Raises ConfigError with what to change; touches
    no model (only checks that the model folder has a config.json, after every value check)."""
    raw = copy.deepcopy(raw)
    algo = raw.pop("algo", "sft")
    if not isinstance(algo, str):
        raise ConfigError(f"algo must be a name, got {algo!r}; choose one of: {', '.join(algorithms.names())}")
    spec = algorithms.get(algo)
    lora_raw = raw.pop("lora", None)
    episode_raw = {name: raw.pop(name) for name in episode_tables() if name in raw}
    if isinstance(raw.get("rl"), dict) and "rl" != algo:  # a common spelling (rl.routing_replay): say ours
        keys = ", ".join(f"{algo}.{k}" for k in raw["rl"])
        raise ConfigError(f"there is no [rl] table: RL settings live in the algorithm's table; set {keys} instead")
    _check_tables(raw, algo)
    _check_moved(raw, algo)
    seed = raw.get("seed", 0)
    if not _is_int(seed) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    for name in ("data", "engine"):
        if isinstance(raw.setdefault(name, {}), dict):
            raw[name].setdefault("seed", seed)
    built = {name: _make(cls, raw.get(name, {}), name) for name, cls in SECTIONS.items()}
    algo_cfg = spec.make_config(raw.get(algo), explain=_online_hint)
    if isinstance(getattr(algo_cfg, "reward", None), str):  # an online algorithm: its spec fits the [reward] table
        check_spec(algo_cfg.reward, built["reward"], getattr(algo_cfg, "reward_timeout", None))
    episodes_table, episodes = _episodes(episode_raw, algo_cfg, algo)
    resume = raw.get("resume")
    if resume is not None and (not isinstance(resume, str) or not resume):
        raise ConfigError(f"resume must be 'latest' or a checkpoint path, got {resume!r}")
    for key in ("model", "out"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            raise ConfigError(f'no {key} given; pass --{key} DIR (or set {key} = "..." in the config file)')
    check_writable_dir(raw["out"], "--out")
    _check_data(built["data"], spec)
    model = raw["model"]
    lora = _lora(lora_raw, model)
    if not (Path(model) / "config.json").is_file() and not (Path(model) / "adapter_config.json").is_file():
        hint = run_dir_hint(model)
        if hint:
            raise ConfigError(f"--model {model!r} is not a model folder (no config.json): {hint}")
        if Path(model).exists():  # a folder of something else: never suggest init-model, which would replace it
            raise ConfigError(f"model folder {model!r} has no config.json; give a Hugging Face model folder")
        raise ConfigError(
            f"model folder {model!r} does not exist; give a Hugging Face model folder, or create one with "
            f"`polyrl init-model --preset tiny --out {model}`"
        )
    return RunConfig(
        algo=algo,
        model=model,
        out=raw["out"],
        seed=seed,
        resume=resume,
        algo_config=algo_cfg,
        spec=spec,
        lora=lora,
        episodes=episodes,
        episodes_table=episodes_table,
        **built,
    )


def _check_tables(raw: dict[str, Any], algo: str) -> None:
    """Every key of ``raw`` is a top-level setting, a known table or the algorithm's own table."""
    unknown = sorted(set(raw) - set(TOP_LEVEL) - set(SECTIONS) - {algo})
    if unknown:
        others = [k for k in unknown if k in algorithms.names()]
        hint = f" ({', '.join(others)} tables belong to other algorithms)" if others else ""
        tables = ", ".join([*SECTIONS, algo, "lora", *episode_tables()])
        hint = hint or _algo_keys_hint(raw, unknown, algo)
        hint = hint or did_you_mean(unknown, [*TOP_LEVEL, *SECTIONS, algo, "lora", *episode_tables()])
        raise ConfigError(
            f"unknown setting(s) {unknown}{hint}; top-level keys are {', '.join(TOP_LEVEL)} and tables {tables}"
        )


def _algo_keys_hint(raw: dict[str, Any], unknown: list[str], algo: str) -> str:
    """An unknown table holding settings of the algorithm's own table (``[placement] rollout_devices``, ``[async]
    max_staleness``): the hint names where each belongs (``grpo.rollout_devices``); "" when none is one."""
    known = {f.name for f in dataclasses.fields(algorithms.get(algo).config_cls)}
    keys = [f"{algo}.{k}" for t in unknown if isinstance(raw[t], dict) for k in raw[t] if k in known]
    return f" (did you mean {', '.join(keys)}?)" if keys else ""


def _check_moved(raw: dict[str, Any], algo: str) -> None:
    """A setting under its old name is an error that gives the new one."""
    for old, new in MOVED.items():
        table, key = old.replace("<algo>", algo).split(".")
        if isinstance(raw.get(table), dict) and key in raw[table]:
            flag = "--" + new.split(".")[1].replace("_", "-")
            raise ConfigError(f"{table}.{key} is now {new} (one name per setting); set {new} or pass {flag}")


def _check_data(data: DataConfig, spec: AlgorithmSpec) -> None:
    if not data.path:
        raise ConfigError("no dataset given; pass --data SPEC (a file, a datasets name or folder, or builtin:NAME)")
    if data.fixed_shapes and not spec.fixed_shapes:
        able = [n for n in algorithms.names() if algorithms.get(n).fixed_shapes]
        raise ConfigError(
            f"data.fixed_shapes pads training batches to one shape, which {spec.name} does not support (its loss "
            f"counts sequences); remove it, or use it with {', '.join(able)}"
        )


def _episodes(tables: dict[str, Any], algo_cfg: Any, algo: str) -> tuple[str | None, EpisodeConfig | None]:
    """The run's episode producer config (at most one registered table given), checked against the algorithm's."""
    if len(tables) > 1:
        raise ConfigError(f"tables {sorted(tables)} each choose an episode producer; keep one")
    for name, table in tables.items():
        cfg = _make(episode_tables()[name], table, name)
        cfg.check(algo_cfg, algo)
        return name, cfg
    return None, None


def _lora(table: Any, model: str) -> LoraConfig | None:
    """The run's ``LoraConfig``: the ``[lora]`` table (or ``--lora`` string); a PEFT adapter folder as ``model``
    makes it a LoRA run even without one (r, alpha and targets then come from the adapter)."""
    adapter = is_adapter_dir(model)
    if table is None and not adapter:
        return None
    cfg = make_lora_config(table if table is not None else {})
    if adapter:
        saved, _ = read_adapter_config(model)
        cfg = dataclasses.replace(
            saved,
            dropout=cfg.dropout,
            quantize_base=cfg.quantize_base,
            merge_for_rollout=cfg.merge_for_rollout,
            base=cfg.base,
        )
    base_model_path(model, cfg.base)  # the base must be reachable (and lora.base only given for an adapter) first
    return cfg


def _online_hint(unknown: list[str]) -> str:
    """Keys of an algorithm without online RL settings that are online RL settings (``--max-staleness`` given to
    ``--algo sft``): the hint names the algorithms that take them; "" otherwise."""
    if not set(unknown) <= {f.name for f in dataclasses.fields(OnlineConfig)}:
        return ""
    names = sorted(n for n in algorithms.names() if issubclass(algorithms.get(n).config_cls, OnlineConfig))
    return f" (online RL settings: --algo {', '.join(names[:-1])} or {names[-1]})"


def resolve(config_file: str | None, overrides: list[tuple[str, Any]]) -> RunConfig:
    """The run of ``config_file`` (optional) with ``overrides`` applied in order."""
    raw = load_file(config_file) if config_file else {}
    return build(apply_overrides(raw, overrides))


def nearest_existing(path: Path) -> tuple[Path, OSError | None]:
    """(the nearest of ``path`` (absolute) and its parents that exists, the error of a probe below it). A probe fails
    rather than saying "missing" when the path lies under a folder this user may not enter: ``Path.exists`` raises
    PermissionError there. The walk goes on upwards, so the folder returned is then the one that cannot be entered."""
    blocked = None
    for p in (path, *path.parents):
        try:
            if p.exists():
                return p, blocked
        except OSError as exc:
            blocked = blocked or exc
    return Path(path.anchor), blocked


def check_writable_dir(folder: str | Path, what: str) -> None:
    """ConfigError when ``folder`` (a run directory, made if missing) cannot be made or written: a file on its path,
    a folder that cannot be entered (no permission to look inside), a folder without write permission or on a
    read-only file system. Checked before any model loads."""
    path = Path(folder).absolute()
    existing, blocked = nearest_existing(path)
    if blocked is not None:
        raise ConfigError(
            f"{what} {str(folder)!r} cannot be reached: {existing} may not be entered ({blocked.strerror or blocked}); "
            "choose a folder you can write"
        )
    if existing == path and not existing.is_dir():
        raise ConfigError(f"{what} {str(folder)!r} is a file; the run directory must be a folder (new, or a run's)")
    if not existing.is_dir():
        raise ConfigError(
            f"{what} {str(folder)!r} cannot be made: {existing} is a file, not a folder; choose another path"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{what} {str(folder)!r}: cannot write in {existing} (no write permission, or a read-only file system); "
            "choose a folder you can write"
        )


def save_resolved(cfg: RunConfig, out_dir: str | Path) -> Path:
    """Write the resolved config as ``<out>/run_config.json`` (``--config`` accepts it back)."""
    path = Path(out_dir) / RESOLVED_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg.to_dict(), indent=2, default=str) + "\n")
    return path


def differences(old: dict[str, Any], new: dict[str, Any], ignore: tuple[str, ...] = ("resume",)) -> list[str]:
    """Dotted keys whose values differ between two ``to_dict`` forms (for a resume notice)."""
    out = []
    for key in sorted(set(old) | set(new)):
        if key in ignore:
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{k}" for k in sorted(set(a) | set(b)) if _norm(a.get(k)) != _norm(b.get(k))]
        elif _norm(a) != _norm(b):
            out.append(key)
    return out


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v
