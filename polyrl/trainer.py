"""``polyrl.trainer.Trainer``: the Python API for writing your own post-training loop (in the spirit of Tinker).

A GRPO step by hand::
    tr = Trainer(model="runs/sft/final", optim=OptimConfig(lr=1e-6))   # HF folder (or a DecoderLM + tokenizer=)
    samples = tr.rollout_batch(prompts, n=8, sampling=SamplingParams(temperature=1.0, max_tokens=256))
    rewards = [my_reward(s.text) for s in samples]                      # Sample: prompt_ids, completion_ids,
    adv = group_advantages(rewards, [s.group for s in samples])         #   logprobs (rollout), finish_reason, text
    batch = tr.make_batch(samples, {"adv": adv, "old_logp": [s.logprobs for s in samples]})
    cfg = GRPOConfig(max_new_tokens=256)
    tokens = sum(b.num_target_tokens for b in batch)
    stats = tr.train(batch, make_policy_loss(cfg, tokens, tokens), normalizer=tokens)   # StepStats
    tr.save("runs/mine/checkpoints")                                    # exact resume with tr.load(...)

- ``rollout_batch(prompts, n, sampling, seeds=None)``: prompts are token ids, text, message lists or
  ``PromptExample`` s; returns ``n`` ``Sample`` s per prompt (``group`` = prompt index).
- ``forward_logprobs(samples | batch, temperature=1.0, entropy=False, model=None)``: the trainer's log-probs of
  each sample's completion tokens (no grad), e.g. to recompute old log-probs or to measure the mismatch with
  ``Sample.logprobs``.
- ``make_batch(samples, fields)``: packed ``RLBatch`` micro-batches with per-token ``fields``.
- ``train(batch, loss_fn, normalizer=None)``: one optimizer step; ``loss_fn(model, RLBatch) -> (loss_sum,
  metric_sums)`` in the engine's form (``polyrl.train``); ``completion_logprobs(model, batch, T)`` gives the
  differentiable log-probs inside it.
- ``save(dir)`` / ``load(dir)``: atomic checkpoints (weights, fp32 masters, AdamW moments, RNG, counters).
- ``tokenizer``, ``model``, ``engine`` (``TrainEngine``), ``llm`` (the rollout engine).
- MoE rollout-routing replay: ``Trainer(..., rollout=RolloutConfig(record_routing=True))`` gives each ``Sample`` the
  experts the rollout chose (``routed_experts``); batches made of them replay those experts in ``forward_logprobs``
  and ``train`` (docs/models.md).

A whole recipe run (any registered algorithm, the same loop, checkpoints and outputs as ``polyrl train``)::
    summary = fit("dpo", model="runs/sft/final", data="prefs.jsonl", out="runs/dpo",
                  optim={"lr": 5e-7}, train={"max_steps": 200}, dpo={"beta": 0.1})
    summary = fit("sft", model="runs/tiny", data="builtin:arithmetic", out="runs/sft",    # eval during training:
                  train={"max_steps": 100, "eval_every": 20, "eval_before_train": True, "keep_best": "eval_loss"})
    summary = fit("ppo", model="runs/sft/final", data="builtin:arithmetic", out="runs/ppo",
                  ppo={"reward": "exact_match", "samples_per_prompt": 4, "critic_warmup_steps": 2})

Colocated: the rollout engine holds the SAME module the optimizer updates (no copy, no sync step); its KV cache is
freed while training and taken back for each rollout; its prefix cache is reset after every optimizer step. The
implementation is ``polyrl.run.colocated.ColocatedPolicy`` (shared with ``polyrl train --algo grpo``); this
module adds loading by path and the public names. Not here: the run loops (``polyrl.run``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import polyrl.agents  # noqa: F401 - registers the [agent] table, so fit(..., agent={"env": ...}) runs episodes
from polyrl import algorithms
from polyrl.algorithms.rl_batch import RLBatch, Sample, completion_logprobs, pack_samples
from polyrl.algorithms.workers import exit_if_bootstrapping
from polyrl.data.config import DataConfig
from polyrl.errors import FOREIGN_NAMES, CheckpointError, ConfigError, did_you_mean
from polyrl.infer.config import RolloutConfig
from polyrl.infer.sampling_params import SamplingParams
from polyrl.models.checkpoint import load_model, load_tokenizer
from polyrl.models.moe import Routing, routing_scope
from polyrl.platform import device as dev
from polyrl.run import run
from polyrl.run.colocated import ColocatedPolicy
from polyrl.run.config import SECTIONS, build, check_writable_dir, load_file
from polyrl.train.checkpoint import list_checkpoints
from polyrl.train.config import OptimConfig, PrecisionConfig, ScheduleConfig, StepConfig


class Trainer(ColocatedPolicy):
    """``Trainer(model=path_or_DecoderLM, tokenizer=None, optim=OptimConfig, schedule=ScheduleConfig,
    precision=PrecisionConfig, engine=polyrl.train.StepConfig, rollout=polyrl.infer.RolloutConfig, ...)``.

    A path is loaded in fp32 on the default device (the engine keeps fp32 masters and casts the compute weights
    in place); a module must already be on its device. ``reference=True`` keeps a frozen copy of the initial
    weights as ``ref_model`` (for a KL penalty); ``release_kv=False`` keeps the KV cache between rollouts
    ("auto": where it takes at most a quarter of the device memory)."""

    def __init__(
        self,
        model: str | Path | nn.Module,
        tokenizer: Any = None,
        optim: OptimConfig | None = None,
        schedule: ScheduleConfig | None = None,
        precision: PrecisionConfig | None = None,
        engine: StepConfig | None = None,
        rollout: RolloutConfig | None = None,
        total_steps: int | None = None,
        release_kv: bool | str = "auto",
        reference: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        if isinstance(model, (str, Path)):
            path = str(model)
            model = load_model(path, dtype=torch.float32, device=torch.device(device) if device else dev.torch_device())
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
        super().__init__(
            model, tokenizer, optim, schedule, precision, engine, rollout, total_steps, release_kv, reference
        )

    def rollout_batch(
        self,
        prompts: Sequence[Any],
        n: int = 1,
        sampling: SamplingParams | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[Sample]:
        """``n`` completions per prompt from the rollout engine (see the module docstring)."""
        return self.rollout(prompts, n, sampling, seeds)

    def make_batch(
        self, samples: Sequence[Sample], fields: dict[str, Sequence[Any]] | None = None, max_tokens: int | None = None
    ) -> list[RLBatch]:
        """Packed micro-batches of ``samples`` (``engine.micro_batch_tokens`` each by default)."""
        return pack_samples(samples, fields, max_tokens or self.micro_batch_tokens)

    def forward_logprobs(
        self,
        batch: Sequence[Sample] | Sequence[RLBatch],
        temperature: float = 1.0,
        entropy: bool = False,
        model: nn.Module | None = None,
    ) -> Any:
        """Log-probs of every sample's completion tokens under the current weights (list of fp32 ``[c]``); with
        ``entropy`` a pair (log-probs, entropies). Given ``RLBatch`` es, returns one ``[T]`` tensor per batch."""
        if batch and isinstance(batch[0], RLBatch):
            out = []
            with torch.no_grad():
                for b in batch:
                    b = b.to(self.device)
                    replay = b.routing_replay if model is None else None  # the policy replays the rollout's experts
                    scope = contextlib.nullcontext()
                    if replay is not None:
                        scope = routing_scope(self.model, Routing(record=False, keep_logits=False, replay=replay))
                    with scope:
                        lp, ent = completion_logprobs(model or self.model, b, temperature, entropy)
                    out.append((lp, ent) if entropy else lp)
            return out
        lps, ents = self.logprobs(batch, temperature, model, entropy)  # type: ignore[arg-type]
        return (lps, ents) if entropy else lps

    def train(self, batch: RLBatch | Sequence[RLBatch], loss_fn: Any, normalizer: float | None = None) -> Any:
        """One optimizer step over ``batch`` (micro-batches) with ``loss_fn``; returns ``StepStats``."""
        batches = [batch] if isinstance(batch, RLBatch) else list(batch)
        return self.step(batches, loss_fn, normalizer)

    def save(
        self, root: str | Path, step: int | None = None, data_state: dict | None = None, config: Any = None
    ) -> Path:  # type: ignore[override]
        """Checkpoint ``<root>/step-%08d`` (default step: optimizer steps so far); returns its path."""
        return super().save(root, self.engine.global_step if step is None else step, data_state, config)

    def load(self, path: str | Path) -> Any:
        """Restore a checkpoint folder, or the latest checkpoint under ``path``; returns ``LoadedCheckpoint``."""

        p = Path(path)
        if not (p / "manifest.json").is_file():
            found = list_checkpoints(p)
            if not found:
                raise CheckpointError(f"{p} is not a checkpoint and holds none; give a step-* folder")
            p = found[-1]
        return super().load(p)


def fit(
    algo: str,
    model: str | Path,
    data: str | Path | dict[str, Any] | Sequence[dict[str, Any]] | Any,
    out: str | Path,
    *,
    config: str | Path | None = None,
    resume: str | None = None,
    seed: int | None = None,
    **tables: Any,
) -> dict[str, Any]:
    """Run a registered algorithm (``sft``, ``dpo``, ``grpo``, ``gspo``, ``ppo``, ...) end to end and return its
    summary: the Python form of ``polyrl train``.

    ``data``: a data spec (path, glob, ``builtin:NAME``, datasets name or folder), the ``[data]`` table (a dict or
    ``DataConfig``), or the rows themselves (a list of dicts, or a ``datasets.Dataset``), which are written to
    ``<out>/data-<hash>.jsonl`` and read from there (so a resumed run reads the same rows). ``tables``: other
    tables of the run config by name (``optim``, ``schedule``, ``precision``, ``engine``, ``train``,
    ``checkpoint``, ``data``, ``lora``, ``agent``, and the algorithm's own, e.g. ``grpo``), each a dict or the
    dataclass itself (which gives every key of its table). ``config``: a TOML file (``polyrl train --config``)
    whose settings the arguments override, table by table and key by key (``algo``, ``model`` and ``out`` always
    come from the arguments). ``resume``: ``"latest"`` or a checkpoint.

    Returns the summary dict the run prints and writes to ``<out>/summary.json`` (``status``, ``steps``,
    ``final_loss``, the ``data_*`` counts, ``final_model``, ...). Validation errors are
    ``polyrl.errors.ConfigError`` s that name the setting to fix; bad data rows are ``DataError`` s naming the file
    and row.

    Call it under ``if __name__ == "__main__":`` in a script: reward and environment workers re-import the main
    script, and a worker that reaches this call stops at once (the run fails with a ``UserError`` saying so)."""
    exit_if_bootstrapping("fit(...) was called")
    _check_algo(algo)
    for name, value in (("model", model), ("out", out)):
        if not isinstance(value, (str, Path)) or not str(value).strip():
            raise ConfigError(f"fit({name}=...) must be a folder path (str or Path), got {value!r}")
    raw: dict[str, Any] = load_file(config) if config else {}
    raw.update(algo=algo, model=str(model), out=str(out))
    if seed is not None:
        raw["seed"] = seed
    if resume is not None:
        raw["resume"] = resume
    tables = dict(tables)
    if _is_rows(data):
        data = str(_write_rows(data, Path(out)))
    if isinstance(data, (str, Path)):
        tables["data"] = {**_table(tables.get("data"), "data"), "path": str(data)}
    elif isinstance(data, dict) or isinstance(data, DataConfig):
        tables["data"] = {**_table(data, "data"), **_table(tables.get("data"), "data")}
    else:
        raise ConfigError(
            f"fit(data=...) cannot be of type {type(data).__name__}; give a data spec (a path, glob, builtin:NAME, "
            "datasets name), the [data] table as a dict or DataConfig, or rows (a list of dicts, a datasets.Dataset)"
        )
    for name, value in tables.items():
        if not isinstance(value, dict) and not dataclasses.is_dataclass(value):
            raise ConfigError(f"fit({name}=...) must be a dict or a config dataclass, got {type(value).__name__}"
                              + _setting_hint(name, value, algo))  # fmt: skip
        raw[name] = {**raw.get(name, {}), **_table(value, name, algo)}
    return run(build(raw))


def _check_algo(algo: Any) -> None:
    names = algorithms.names()
    if isinstance(algo, str) and algo not in names:
        raise ConfigError(f"unknown algorithm {algo!r}{did_you_mean(algo, names)}; choose one of: {', '.join(names)}")


def _setting_hint(name: str, value: Any, algo: str) -> str:
    """``; max_steps is a setting of the train table: pass train={'max_steps': 3}`` for a keyword that is a setting
    (or another trainer's name for one, ``learning_rate``) rather than a table; '' otherwise."""
    owners: dict[str, list[str]] = {}
    tables = {**SECTIONS, **({algo: algorithms.get(algo).config_cls} if algo in algorithms.names() else {})}
    for table, cls in tables.items():
        for f in dataclasses.fields(cls):
            owners.setdefault(f.name, []).append(table)
    foreign = FOREIGN_NAMES.get(name, ())
    candidates = [name, *((foreign,) if isinstance(foreign, str) else foreign)]
    key = next((c for c in candidates if c in owners), None)
    if key is None:
        close = difflib.get_close_matches(name, list(owners), n=1, cutoff=0.8)
        key = close[0] if close else None
    if key is None:
        return ""
    forms = " or ".join(f"{t}={{{key!r}: {value!r}}}" for t in owners[key])
    return f"; {key} is a setting of the {' / '.join(owners[key])} table: pass {forms}"


def _is_rows(data: Any) -> bool:
    """In-memory rows: a list / tuple of dicts, or a ``datasets.Dataset`` (anything with ``to_list`` and
    ``column_names``)."""
    if isinstance(data, (list, tuple)):
        return True
    if isinstance(data, dict):  # a DatasetDict is a dict of splits: rows, refused with a hint by _write_rows
        return bool(data) and all(_is_dataset(v) for v in data.values())
    return _is_dataset(data)


def _is_dataset(data: Any) -> bool:
    return callable(getattr(data, "to_list", None)) and hasattr(data, "column_names")


def _write_rows(data: Any, out: Path) -> Path:
    """The rows as JSONL under ``out``, named by their content (an identical call reuses the file; other rows
    never overwrite it)."""
    if isinstance(data, dict):  # DatasetDict
        raise ConfigError(f"fit(data=...) got a {type(data).__name__} of splits; pick one, e.g. data=ds['train']")
    rows = data.to_list() if not isinstance(data, (list, tuple)) else list(data)
    if not rows:
        raise ConfigError("fit(data=...) got no rows; give at least one row")
    lines = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise ConfigError(f"fit(data=...): row {i} is a {type(row).__name__}; each row must be a dict")
        try:
            lines.append(json.dumps(row, ensure_ascii=False, sort_keys=True))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"fit(data=...): row {i} cannot be written as JSON ({exc})") from None
    text = "\n".join(lines) + "\n"
    check_writable_dir(out, "--out")  # a file, or a folder that cannot be entered, named (never a probe's traceback)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"data-{hashlib.sha256(text.encode()).hexdigest()[:12]}.jsonl"
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return path


def _table(value: Any, name: str, algo: str | None = None) -> dict[str, Any]:
    if value is None:
        return {}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        owner = {**SECTIONS, **({algo: algorithms.get(algo).config_cls} if algo in algorithms.names() else {})}
        want = owner.get(name)
        if want is not None and not isinstance(value, want):
            mine = [t for t, cls in owner.items() if isinstance(value, cls)]
            hint = f"; pass the {type(value).__name__} as {mine[0]}=..." if mine else ""
            raise ConfigError(f"fit({name}={type(value).__name__}(...)): the {name} table is a {want.__name__}{hint}")
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return dict(value)


__all__ = [
    "RLBatch",
    "RolloutConfig",
    "Sample",
    "SamplingParams",
    "Trainer",
    "completion_logprobs",
    "fit",
    "pack_samples",
]
