"""Direct Preference Optimization as a registered offline algorithm: the ``[dpo]`` config, the loss, the
reference log-probs and the run.

Data: ``polyrl.data.build_preference`` turns (prompt, chosen, rejected) rows (strings or chat messages) into
units of two sequences that are packed into the same micro-batch, chosen first, so a packed batch holds
sequences ``[c0, r0, c1, r1, ...]``; labels already mask the prompt. A sequence's log-prob is the sum of
``kernels.token_logprobs`` over its target tokens (fused head + log-softmax, no ``[T, V]`` logits kept).

Reference: computed ONCE, before training, by a forward pass over the train (and eval) data with the
initial weights (or the frozen ``reference_model``) in the run's compute dtype, then freed. The per-sequence
sums are keyed by the sequence's content (token ids + labels: a sequence's log-prob depends on nothing else,
since packed attention never crosses sequences), so packing order, shuffling and resume never matter. The
table is cached in ``<out>/reference_logps.json``; a resumed run reads it instead of recomputing. Under torchrun
each rank computes every N-th missing sequence on its own device, the parts are gathered, and rank 0 writes the
cache.

Loss per pair, with ``h = (pi_c - ref_c) - (pi_r - ref_r)`` (sequence log-probs):
``sigmoid``: ``-(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h)`` (eps = ``label_smoothing``,
conservative DPO; eps = 0 is the original DPO); ``ipo``: ``(h - 1 / (2 * beta))^2`` on length-averaged
log-probs (as TRL). Metrics (TRL's names, means over pairs): ``rewards/chosen`` = beta * (pi_c - ref_c),
``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies`` (chosen reward > rejected reward),
``logps/chosen``, ``logps/rejected``; the held-out evaluation (``train.eval_every``) logs each as ``eval_<name>``
(``eval_rewards/margins``, ``eval_rewards/accuracies``: means over every held-out pair).
Not here: the step (``polyrl.train``), the loop (``runner.run_offline``), data parsing (``polyrl.data``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from polyrl import kernels
from polyrl.algorithms.spec import AlgorithmSpec, PrepareContext
from polyrl.data.batch import PackedBatch, pack_sequences, shifted_labels
from polyrl.data.config import DataConfig
from polyrl.data.dataset import TokenizedData, build_preference
from polyrl.data.examples import TokenizedSeq
from polyrl.data.packing import pack_greedy
from polyrl.errors import CheckpointError, ConfigError
from polyrl.models.checkpoint import load_model
from polyrl.models.lora import base_model_path
from polyrl.platform import device
from polyrl.train.losses import attention_metadata
from polyrl.train.precision import resolve_compute_dtype

LOSS_TYPES = ("sigmoid", "ipo")
CACHE_NAME = "reference_logps.json"
CACHE_VERSION = 1


@dataclass
class DPOConfig:
    """The ``[dpo]`` table. ``reference_model``: an HF folder for a separate frozen reference (None: the
    policy's initial weights). ``reference_batch_tokens``: packing budget of the reference pass (None: the
    training micro-batch budget)."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"
    reference_model: str | None = None
    reference_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.beta, (int, float)) or not self.beta > 0:
            raise ConfigError(f"dpo.beta must be a positive number, got {self.beta!r}; e.g. beta = 0.1")
        if not isinstance(self.label_smoothing, (int, float)) or not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(
                f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing!r} (0 = plain DPO; "
                "e.g. 0.1 assumes 10% of the labels are flipped)"
            )
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"dpo.loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        if self.loss_type == "ipo" and self.label_smoothing:
            raise ConfigError("dpo.label_smoothing applies to loss_type = 'sigmoid' only; set it to 0 for ipo")
        if self.reference_model is not None and (not isinstance(self.reference_model, str) or not self.reference_model):
            raise ConfigError(f"dpo.reference_model must be a model folder path, got {self.reference_model!r}")
        rbt = self.reference_batch_tokens
        if rbt is not None and (not isinstance(rbt, int) or isinstance(rbt, bool) or rbt < 1):
            raise ConfigError(f"dpo.reference_batch_tokens must be a positive integer, got {rbt!r}")


# ---- the loss -----------------------------------------------------------------------------------
def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> torch.Tensor:
    """Per-pair DPO loss ``[P]`` (fp32) from sequence log-probs ``[P]`` (see the module docstring; for
    ``ipo`` pass length-averaged log-probs)."""
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "sigmoid":
        return -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    if loss_type == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    raise ValueError(f"unknown DPO loss type {loss_type!r}; use one of {LOSS_TYPES}")


def sequence_index(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[T]`` int64: which packed sequence each token belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=total)


def sequence_logps(model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence ``(sum of target-token log-probs [B] fp32, target-token count [B] fp32)`` of a packed
    batch, differentiable in the model's weights."""

    hidden = model(batch.input_ids, batch.position_ids, attention_metadata(batch))  # [T, H]
    mask = batch.labels != -100
    token_lp = kernels.token_logprobs(hidden, model.lm_head_weight, batch.labels.clamp(min=0))  # [T] fp32
    token_lp = torch.where(mask, token_lp, torch.zeros_like(token_lp))
    seq = sequence_index(batch.cu_seqlens, token_lp.shape[0])
    nseq = batch.cu_seqlens.numel() - 1
    sums = torch.zeros(nseq, dtype=torch.float32, device=token_lp.device).index_add_(0, seq, token_lp.float())
    counts = torch.zeros(nseq, dtype=torch.float32, device=token_lp.device).index_add_(0, seq, mask.float())
    return sums, counts


# ---- reference log-probs ------------------------------------------------------------------------
def sequence_key(input_ids: Sequence[int], labels: Sequence[int]) -> str:
    """Content key of one sequence: a hash of its token ids and (shifted) labels."""
    h = hashlib.blake2b(digest_size=16)
    h.update(torch.as_tensor(list(input_ids), dtype=torch.int64).numpy().tobytes())
    h.update(b"|")
    h.update(torch.as_tensor(list(labels), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def batch_keys(batch: PackedBatch) -> list[str]:
    """Content keys of every sequence of a packed batch, in order."""
    ids, labels = batch.input_ids.cpu(), batch.labels.cpu()
    cu = batch.cu_seqlens.tolist()
    return [sequence_key(ids[s:e].tolist(), labels[s:e].tolist()) for s, e in zip(cu[:-1], cu[1:])]


class ReferenceLogps:
    """Reference ``(log-prob sum, target-token count)`` per sequence, keyed by ``sequence_key``."""

    def __init__(self, entries: dict[str, tuple[float, float]] | None = None, meta: dict[str, Any] | None = None):
        self.entries = dict(entries or {})
        self.meta = dict(meta or {})

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, batch: PackedBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sums [B], counts [B])`` fp32 on ``device`` for the sequences of ``batch``."""
        try:
            rows = [self.entries[k] for k in batch_keys(batch)]
        except KeyError:
            raise RuntimeError(
                "a DPO batch holds a sequence without a reference log-prob; the reference pass must cover "
                "every dataset the loss sees (train and eval)"
            ) from None
        t = torch.tensor(rows, dtype=torch.float32, device=device)  # [B, 2]
        return t[:, 0], t[:, 1]

    @torch.no_grad()
    def compute(self, model: nn.Module, seqs: Iterable[Any], tokens_per_batch: int, device: torch.device) -> int:
        """Add every sequence of ``seqs`` (``TokenizedSeq``) not yet in the table; returns how many were added."""

        todo: dict[str, Any] = {}
        for s in seqs:
            key = sequence_key(s.input_ids, shifted_labels(s.input_ids, s.loss_mask))
            if key not in self.entries:
                todo.setdefault(key, s)
        if not todo:
            return 0
        items = list(todo.items())
        lengths = [len(s) for _, s in items]
        budget = max(tokens_per_batch, max(lengths))
        was_training = model.training
        model.eval()
        try:
            for group in pack_greedy(lengths, range(len(items)), budget):
                batch = pack_sequences([items[i][1] for i in group]).to(device)
                sums, counts = sequence_logps(model, batch)
                for i, s, c in zip(group, sums.tolist(), counts.tolist()):
                    self.entries[items[i][0]] = (s, c)
        finally:
            model.train(was_training)
        return len(items)

    def save(self, path: str | Path) -> Path:
        """Write the table as JSON, atomically (temp file + rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        body = {"version": CACHE_VERSION, "meta": self.meta, "entries": self.entries}
        tmp.write_text(json.dumps(body))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> ReferenceLogps:
        try:
            body = json.loads(Path(path).read_text())
            entries = {k: (float(v[0]), float(v[1])) for k, v in body["entries"].items()}
            if body.get("version") != CACHE_VERSION:
                raise ValueError(f"version {body.get('version')} (expected {CACHE_VERSION})")
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise CheckpointError(
                f"cannot read the DPO reference cache {path}: {exc}; delete it to recompute"
            ) from None
        return cls(entries, body.get("meta"))


def _all_seqs(datasets: Iterable[Any]) -> list[Any]:
    return [s for data in datasets for unit in data.units for s in unit]


def prepare_reference(ctx: PrepareContext, datasets: Sequence[TokenizedData]) -> ReferenceLogps:
    """The reference table for ``datasets`` of the run ``ctx``: read from the run's cache when it covers them, else
    computed with the reference model (loaded here, freed on return) and cached. With a data-parallel ``ctx.world``
    every rank calls it and gets the whole table (each computes its share)."""
    world, stream, algo = ctx.world, ctx.stream, ctx.algo_config
    dev = world.device if world.distributed else device.torch_device()
    dtype = resolve_compute_dtype(ctx.precision, dev.type)
    # LoRA from an adapter folder: the reference is its base with the adapter off (as TRL), not a second copy
    reference = algo.reference_model or base_model_path(ctx.model, ctx.base)
    meta = {"reference_model": str(reference), "dtype": str(dtype).removeprefix("torch.")}
    path = Path(ctx.out) / CACHE_NAME
    table = ReferenceLogps(meta=meta)
    if path.is_file():
        cached = ReferenceLogps.load(path)
        if cached.meta == meta:
            table = cached
        else:
            print(f"dpo: {path} was computed with {cached.meta}, now {meta}; recomputing", file=stream)
    seqs = _all_seqs(datasets)
    t0 = time.perf_counter()
    model = None
    try:
        missing = [s for s in seqs if _key_of(s) not in table.entries]
        if missing:
            model = load_model(meta["reference_model"], dtype=dtype, device=dev)
            model.requires_grad_(False)
            budget = algo.reference_batch_tokens or ctx.micro_batch_tokens
            before = len(table)
            part = ReferenceLogps()
            part.compute(model, missing[world.rank :: world.world_size], budget, dev)  # this rank's share
            for entries in world.all_gather_object(part.entries):
                table.entries.update(entries)
            added = len(table) - before
            if world.is_main:
                table.save(path)
            print(
                f"dpo: reference log-probs of {added} sequences in {time.perf_counter() - t0:.1f}s -> {path}",
                file=stream,
            )
        else:
            print(f"dpo: reference log-probs of {len(seqs)} sequences read from {path}", file=stream)
    finally:
        del model
    return table


def _key_of(seq: TokenizedSeq) -> str:
    return sequence_key(seq.input_ids, shifted_labels(seq.input_ids, seq.loss_mask))


def make_loss(cfg: DPOConfig, reference: ReferenceLogps | None = None):
    """The engine loss function: sum over the batch's pairs of the DPO loss, plus metric sums over pairs.
    ``reference`` is the table from ``prepare_reference`` (the run builds it; required)."""
    if reference is None:
        raise ConfigError("the DPO loss needs reference log-probs; run DPO through `polyrl train --algo dpo`")

    def loss_fn(model: nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if (batch.cu_seqlens.numel() - 1) % 2:
            raise RuntimeError("a DPO batch must hold (chosen, rejected) pairs: an even number of sequences")
        sums, counts = sequence_logps(model, batch)
        ref_sums, ref_counts = reference.lookup(batch, sums.device)
        if cfg.loss_type == "ipo":  # length-averaged log-probs
            pol, ref = sums / counts.clamp(min=1.0), ref_sums / ref_counts.clamp(min=1.0)
        else:
            pol, ref = sums, ref_sums
        losses = dpo_loss(pol[0::2], pol[1::2], ref[0::2], ref[1::2], cfg.beta, cfg.label_smoothing, cfg.loss_type)
        with torch.no_grad():
            r_chosen = cfg.beta * (pol[0::2] - ref[0::2])
            r_rejected = cfg.beta * (pol[1::2] - ref[1::2])
            metrics = {
                "rewards/chosen": r_chosen.sum(),
                "rewards/rejected": r_rejected.sum(),
                "rewards/margins": (r_chosen - r_rejected).sum(),
                "rewards/accuracies": (r_chosen > r_rejected).float().sum(),
                "logps/chosen": sums[0::2].sum(),
                "logps/rejected": sums[1::2].sum(),
            }
        return losses.sum(), metrics

    return loss_fn


def normalizer(cfg: DPOConfig, micro_batches: Sequence[Any]) -> float:
    """The step's pair count: the loss and every metric are means over preference pairs."""
    return float(sum((b.cu_seqlens.numel() - 1) // 2 for b in micro_batches))


def build_data(data_cfg: DataConfig, tokenizer: Any, part: str, micro_batch_tokens: int) -> TokenizedData:
    """Tokenised preference pairs (``polyrl.data.build_preference``)."""
    return build_preference(data_cfg, tokenizer, part, micro_batch_tokens)


def prepare(ctx: PrepareContext) -> Callable[[DPOConfig], Any]:
    """Before the model loads: the reference log-probs of every sequence the run will see (computed, or read from
    the run's cache), bound into the loss factory."""
    reference = prepare_reference(ctx, ctx.datasets)
    return lambda algo_cfg: make_loss(algo_cfg, reference)


SPEC = AlgorithmSpec(
    name="dpo",
    description="direct preference optimization on (prompt, chosen, rejected) pairs against a frozen reference",
    config_cls=DPOConfig,
    build_data=build_data,
    make_loss=make_loss,
    normalizer=normalizer,
    prepare=prepare,
    plot_series=("rewards/margins", "rewards/accuracies", "eval_rewards/margins", "eval_rewards/accuracies"),
)
