"""The training step: forward/backward over micro-batches, normalisation, clipping, NaN guard, AdamW.

``TrainEngine.step(micro_batches, loss_fn)`` runs one optimizer step over a list of packed
micro-batches. Each ``loss_fn(model, batch)`` returns a summed loss; the engine divides by ONE
normaliser for the whole step (default: the total target tokens of all micro-batches), so 1 x 4k and
4 x 1k tokens give the same update. Then: global gradient norm (fp32, reported), clipping, a
non-finite guard (skip + count; ``NonFiniteLossError`` after N in a row), the scheduled lr, and the
AdamW update of ``MasterAdamW``.

This module does not build batches, save checkpoints or write metrics: the caller (SFT recipe, RL
trainer) owns the loop and hands ``StepStats`` to ``polyrl.train.metrics`` and the engine to
``polyrl.train.checkpoint``.
"""

from __future__ import annotations

import math
import os
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from polyrl.errors import DataError, UserError
from polyrl.platform import device
from polyrl.platform.host import gc_paused
from polyrl.train.config import OptimConfig, PrecisionConfig, ScheduleConfig, StepConfig
from polyrl.train.graphed_step import (
    GraphedMicroStep,
    batch_signature,
    is_graph_safe,
    model_is_deterministic,
    shape_key,
)
from polyrl.train.losses import causal_lm_loss
from polyrl.train.moe_loss import MoELoss, real_tokens
from polyrl.train.optim import MasterAdamW
from polyrl.train.parallel.fsdp import grad_sum_factor, is_sharded
from polyrl.train.parallel.replicate import all_reduce_grads_, is_replicated
from polyrl.train.precision import DTYPE_NAMES, LossScaler, apply_linear_precision, resolve_compute_dtype
from polyrl.train.schedule import lr_at

# captured training-step graphs dropped after at most one replay before auto mode stops capturing (``_graphed``)
MAX_WASTED_CAPTURES = 2

LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, dict[str, Any]]]


class NonFiniteLossError(UserError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


@dataclass
class StepStats:
    """What one ``TrainEngine.step`` did. ``step`` is the 1-based count of steps run so far (skipped ones
    included); ``loss`` = sum of loss_fn sums / normaliser; ``grad_norm`` is before clipping; ``mfu``
    is None where the device's peak FLOP/s is unknown (the CPU) or the model has no ``flops_per_token``."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    normalizer: float
    time_s: float
    tokens_per_s: float
    mfu: float | None
    peak_memory_bytes: int
    skipped: bool
    skipped_total: int
    loss_scale: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-ready dict (metrics merged in at the top level)."""
        out = asdict(self)
        out.update(out.pop("metrics"))
        return out


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed python/numpy/torch/device RNGs; with ``deterministic`` also ask torch for deterministic kernels."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # required by cuBLAS determinism
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    device.manual_seed_all(seed)


class TrainEngine:
    """Owns the optimizer and the step logic for ``model`` (on its device already).

    Construction casts trainable parameters to the compute dtype in place (fp32 masters are taken
    first), sets ``model.gradient_checkpointing`` and compiles the decoder layers when asked, and
    seeds the RNGs from ``engine.seed``. ``total_steps`` is needed by decaying schedules."""

    def __init__(
        self,
        model: nn.Module,
        optim: OptimConfig | None = None,
        schedule: ScheduleConfig | None = None,
        precision: PrecisionConfig | None = None,
        engine: StepConfig | None = None,
        total_steps: int | None = None,
        world: Any = None,
    ) -> None:
        self.model = model
        # Data-parallel hook: a polyrl.train.parallel.World whose ranks each hold an FSDP2-sharded model, or the
        # whole model as a replica (LoRA: parallel.replicate_model), whose gradients step() all-reduces.
        self.world = world if world is not None and world.distributed else None
        self.replicated = False
        self.optim_cfg = optim or OptimConfig()
        self.schedule_cfg = schedule or ScheduleConfig()
        self.precision_cfg = precision or PrecisionConfig()
        self.cfg = engine or StepConfig()
        self.total_steps = total_steps
        if self.schedule_cfg.decay != "constant" or self.schedule_cfg.warmup_ratio is not None:
            if total_steps is None:
                raise UserError("TrainEngine needs total_steps for a decaying or warmup_ratio schedule")
        seed_everything(self.cfg.seed, self.cfg.deterministic)
        first = next(model.parameters())
        self.device = first.device
        self.compute_dtype = resolve_compute_dtype(self.precision_cfg, self.device.type)
        self.fp8_linears = apply_linear_precision(model, self.precision_cfg, self.device.type)  # 0 unless fp8
        # Sharded (FSDP2) params stay fp32 and are their own masters; FSDP's policy casts for compute.
        cast_to = self.compute_dtype
        if self.world is not None:
            self.replicated = self._check_distributed(model)
            cast_to = self.compute_dtype if self.replicated else None
        self.optimizer = MasterAdamW(model.named_parameters(), self.optim_cfg, cast_to)
        self.scaler = LossScaler(self.compute_dtype == torch.float16, self.precision_cfg.initial_loss_scale)
        self._set_checkpointing(self.cfg.activation_checkpointing)
        self._compiled: list[nn.Module] = self._compile_layers() if self.cfg.compile else []
        self.global_step = 0
        self.skipped_total = 0
        self.consecutive_skips = 0
        self._graph: GraphedMicroStep | None = None
        self._graphs_failed = False
        self._graphs_churn = False  # shapes change every step: captures stopped (``_count_wasted_capture``)
        self.graph_captures = 0
        self.wasted_captures = 0
        # MoE models: router aux / z losses added per micro-batch and reported (None for a dense model)
        self.moe_loss = MoELoss.for_model(model, self.cfg)
        self._flops_ab = self._flops_coefficients(model)  # MFU accounting: taken once (see the method)

    def _check_distributed(self, model: nn.Module) -> bool:
        """True for a replicated model, False for a sharded one; raises for a plain model."""
        if is_replicated(model):
            return True
        if not is_sharded(model):
            raise UserError(
                "TrainEngine got a distributed world but a plain model; before building the engine call "
                "polyrl.train.parallel.shard_model(model, world, compute_dtype) (full training) or "
                "replicate_model(model, world) (LoRA)"
            )
        return False

    # ---- switches -----------------------------------------------------------------------------
    def _set_checkpointing(self, on: bool) -> None:
        if hasattr(self.model, "gradient_checkpointing"):
            self.model.gradient_checkpointing = on
            if hasattr(self.model, "checkpoint_layers"):
                self.model.checkpoint_layers = self.cfg.checkpoint_layers
            elif self.cfg.checkpoint_layers is not None:
                warnings.warn(
                    f"{type(self.model).__name__} has no checkpoint_layers switch; checkpointing every layer",
                    RuntimeWarning,
                    stacklevel=3,
                )
        elif on:
            warnings.warn(
                f"{type(self.model).__name__} has no gradient_checkpointing switch; running without it",
                RuntimeWarning,
                stacklevel=3,
            )

    def _compile_layers(self) -> list[nn.Module]:
        """torch.compile each decoder layer in place (``nn.Module.compile`` keeps parameters)."""
        inner = getattr(self.model, "model", self.model)
        layers = getattr(inner, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            warnings.warn("engine.compile: model has no .layers ModuleList; running eagerly", RuntimeWarning, 3)
            return []
        try:
            for layer in layers:
                layer.compile(dynamic=True)
        except Exception as exc:  # noqa: BLE001 - any compile failure means "eager here"
            warnings.warn(f"engine.compile failed ({exc}); running eagerly", RuntimeWarning, stacklevel=3)
            self._uncompile(list(layers))
            return []
        return list(layers)

    @staticmethod
    def _uncompile(layers: list[nn.Module]) -> None:
        for layer in layers:
            layer._compiled_call_impl = None  # undoes nn.Module.compile
        # Frames dynamo compiled inside the layers (resume functions after a graph break) stay cached and would
        # keep running compiled in the eager retry, while activation checkpointing recomputes with dynamo off: a
        # different set of saved tensors (CheckpointError, seen on the H200 with --lora --compile). Drop them all.
        dynamo = getattr(torch, "_dynamo", None)
        if dynamo is not None and hasattr(dynamo, "reset"):
            dynamo.reset()

    # ---- the step -----------------------------------------------------------------------------
    def _forward_backward_or_eager(self, micro_batches, loss_fn, norm):
        try:
            return self._forward_backward(micro_batches, loss_fn, norm)
        except Exception as exc:
            if not self._compiled or not _is_compile_error(exc):
                raise
            warnings.warn(f"torch.compile failed at run time ({exc}); falling back to eager", RuntimeWarning, 3)
            self._uncompile(self._compiled)
            self._compiled = []
            self.optimizer.zero_grad()
            return self._forward_backward(micro_batches, loss_fn, norm)

    def lr(self, step: int | None = None) -> float:
        """Scheduled lr of 0-based step ``step`` (default: the next step)."""
        s = self.global_step if step is None else step
        return lr_at(s, self.optim_cfg.lr, self.schedule_cfg, self.total_steps)

    def step(
        self, micro_batches: Sequence[Any], loss_fn: LossFn | None = None, normalizer: float | None = None
    ) -> StepStats:
        """One optimizer step over ``micro_batches`` (PackedBatch-like: ``input_ids``, ``labels``,
        ``position_ids``, ``cu_seqlens``, ``max_seqlen``, ``num_target_tokens``, ``.to(device)``).

        ``loss_fn(model, batch) -> (loss_sum, metrics)`` (default ``causal_lm_loss``); metrics values
        are sums too and are reported divided by the same ``normalizer`` (default: the step's total
        ``num_target_tokens``; pass the global count when data-parallel)."""
        if not micro_batches:
            raise ValueError("TrainEngine.step needs at least one micro-batch")
        loss_fn = loss_fn or causal_lm_loss
        norm = float(sum(int(b.num_target_tokens) for b in micro_batches) if normalizer is None else normalizer)
        if self.world is not None and normalizer is None:
            norm = self.world.sum_float(norm)  # the global batch's target tokens
        if norm <= 0:
            raise DataError(
                "a training step has no target tokens (every label is -100); check the loss mask and truncation"
            )
        flops = self._model_flops(micro_batches)
        t0 = time.perf_counter()
        self.model.train()
        with gc_paused(self.cfg.pause_gc):
            loss_total, metric_sums = self._forward_backward_or_eager(micro_batches, loss_fn, norm)
        # real tokens: a fixed-shape batch's padding (``PackedBatch.padding_tokens``) is not throughput
        tokens = sum(int(b.input_ids.numel()) - getattr(b, "padding_tokens", 0) for b in micro_batches)
        if self.replicated:
            all_reduce_grads_(self.optimizer.masters, self.world)  # every rank's share: the global batch's gradient
        if self.world is not None:
            loss_total, metric_sums, tokens = self._reduce_over_ranks(loss_total, metric_sums, tokens)
        grad_norm, loss, finite = self._finish(loss_total, norm)
        lr = self.lr()
        skipped = not finite
        if finite:
            clip = self.optim_cfg.grad_clip
            if clip is not None and grad_norm > clip:
                self.optimizer.scale_grads_(clip / (grad_norm + 1e-6))
            self.optimizer.step(lr)
            self.scaler.update(True)
            self.consecutive_skips = 0
        else:
            self._skip(loss, grad_norm)
        self.optimizer.zero_grad()
        self.global_step += 1
        device.synchronize()
        dt = time.perf_counter() - t0
        peak = device.peak_bf16_flops()
        metrics = {k: float(v) / norm for k, v in metric_sums.items()}
        return StepStats(
            step=self.global_step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            tokens=tokens,
            normalizer=norm,
            time_s=dt,
            tokens_per_s=tokens / dt if dt > 0 else 0.0,
            mfu=(flops / dt / peak) if (flops is not None and peak and dt > 0) else None,
            peak_memory_bytes=device.max_memory_allocated(),
            skipped=skipped,
            skipped_total=self.skipped_total,
            loss_scale=self.scaler.scale if self.scaler.enabled else None,
            metrics=metrics,
        )

    def _forward_backward(
        self, micro_batches: Sequence[Any], loss_fn: LossFn, norm: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss_total = torch.zeros((), dtype=torch.float32, device=self.device)
        metric_sums: dict[str, torch.Tensor] = {}
        scale = self.scaler.scale / norm
        if self.world is not None and not self.replicated:
            scale *= grad_sum_factor(self.world)  # FSDP averages over ranks; we want the global sum / norm
        graphs = self._graphs_allowed(loss_fn)
        plan = self._graph_plan(micro_batches) if graphs else None
        moe_weights = self._moe_weights(micro_batches, norm) if self.moe_loss is not None else None
        for i, mb in enumerate(micro_batches):
            replay = getattr(mb, "routing_replay", None)  # MoE rollout-routing replay (train/moe_loss.py)
            mb = mb.to(self.device) if hasattr(mb, "to") else mb
            replay = getattr(mb, "routing_replay", replay)  # an RLBatch's, moved with it
            graphed = self._graphed(mb, loss_fn, scale, plan) if graphs else None
            if graphed is not None:
                loss_sum, metrics = graphed
            else:
                fn = loss_fn if moe_weights is None else self.moe_loss.wrap(loss_fn, moe_weights[i], replay)
                loss_sum, metrics = fn(self.model, mb)
                (loss_sum * scale).backward()
            loss_total += loss_sum.detach().float()
            for key, value in metrics.items():
                v = value.detach().float() if torch.is_tensor(value) else torch.tensor(float(value))
                metric_sums[key] = metric_sums.get(key, 0.0) + v.to(self.device)
            # The loss must not keep this micro-batch's autograd graph (and its AccumulateGrad nodes, bound to this
            # stream) alive into the next one: a CUDA-graph capture there would sync with it and fail.
            del loss_sum, metrics
        return loss_total, metric_sums

    def _moe_weights(self, micro_batches: Sequence[Any], norm: float) -> list[float]:
        """Per micro-batch: ``norm * its tokens / the step's tokens`` (global when data-parallel), so the MoE
        aux losses enter the step's loss as their token-weighted mean (``train/moe_loss.py``)."""
        counts = [float(real_tokens(b)) for b in micro_batches]
        total = sum(counts)
        if self.world is not None:
            total = self.world.sum_float(total)
        return [norm * c / max(total, 1.0) for c in counts]

    # ---- CUDA graphs ----------------------------------------------------------------------------
    def _graphs_allowed(self, loss_fn: LossFn) -> bool:
        if self.cfg.cuda_graphs is False or self._graphs_failed or self._graphs_churn:
            return False
        why = self._why_not_graphed(loss_fn)
        if why is not None and self.cfg.cuda_graphs:
            raise UserError(f"engine.cuda_graphs = true, but this step cannot be captured: {why}; unset it")
        return why is None

    def _why_not_graphed(self, loss_fn: LossFn) -> str | None:
        if self.device.type != "cuda":
            return f"CUDA graphs need a CUDA device, the model is on {self.device.type}"
        if self.world is not None:
            return "data-parallel steps run their collectives eagerly"
        if self._compiled:
            return "engine.compile is on"
        if not is_graph_safe(loss_fn):
            return f"the loss {getattr(loss_fn, '__name__', loss_fn)!r} is not marked graph_safe"
        if not model_is_deterministic(self.model):
            return "the model has active dropout"
        if self.moe_loss is not None:
            return "MoE models route tokens per step (expert counts vary; the router losses are added eagerly)"
        return None

    def _graph_plan(self, micro_batches: Sequence[Any]) -> Any:
        """The one shape (``graphed_step.shape_key``) this step runs through the graph; its other micro-batches run
        eagerly and leave the graph alone. The held graph's shape when the step has micro-batches of it, else the
        step's most frequent shape (the first on a tie). So a step of many equal micro-batches and a shorter tail
        (RL: 512 samples in 32k-token packs) replays one graph every step instead of re-capturing it each step."""
        keys = [shape_key(batch_signature(b)) for b in micro_batches]
        if self._graph is not None and shape_key(self._graph.signature) in keys:
            return shape_key(self._graph.signature)
        counts: dict[Any, int] = {}
        for k in keys:
            if k is not None:
                counts[k] = counts.get(k, 0) + 1
        return max(counts, key=counts.__getitem__) if counts else None

    def _graphed(self, mb: Any, loss_fn: LossFn, scale: float, plan: Any = None):
        """Run ``mb`` through the graphed path: a new signature is prepared (static buffers) and run eagerly on them
        (the warm-up); its next micro-batch captures the graph first (while the step holds no gradient yet, when it
        is the step's first) and replays it, as do all later ones. None: run ``mb`` eagerly instead (also when its
        shape is not the step's ``plan``, ``_graph_plan``)."""
        sig = batch_signature(mb)
        if sig is None or (plan is not None and shape_key(sig) != plan):
            return None
        g = self._graph
        if g is not None and g.signature == sig and g.loss_fn is loss_fn:
            if g.graph is None:
                try:
                    g.capture(self.model)
                except Exception as exc:  # noqa: BLE001 - any capture failure means "eager from now on"
                    self._capture_failed(exc)
                    return None
                self.graph_captures += 1
            return g.replay(mb, scale)
        if g is not None and g.graph is not None and g.replays <= 1:
            self._count_wasted_capture()
            if self._graphs_churn:
                self.release_graphs()
                return None
        self.release_graphs()
        self._graph, loss, metrics = GraphedMicroStep.prepare(self.model, mb, loss_fn, self.optimizer.masters, scale)
        return loss, metrics

    def _count_wasted_capture(self) -> None:
        """A captured graph is being replaced after at most one replay: its capture (a second forward + backward's
        worth of host work, and the allocator's cache emptied) bought nothing. Packed batches of variable data
        (``data.fixed_shapes`` off) repeat a shape now and then, so each repeat captured a graph that the next step
        threw away (an SFT run at the 0.6b shape: 67 captures in 300 steps). After ``MAX_WASTED_CAPTURES`` of them
        the engine stops capturing for the run (auto mode; ``engine.cuda_graphs = true`` keeps capturing) and says
        how to get a replayed graph instead."""
        self.wasted_captures += 1
        if self.wasted_captures < MAX_WASTED_CAPTURES or self._graphs_churn:
            return
        if self.cfg.cuda_graphs:  # required by the user: keep capturing as asked
            return
        self._graphs_churn = True
        warnings.warn(
            f"the training step's micro-batch shapes change between steps ({self.wasted_captures} CUDA graphs were "
            "captured and dropped after one replay), so the engine stops capturing and runs eagerly; set "
            "data.fixed_shapes = true to pad batches to one shape and replay a single graph",
            RuntimeWarning,
            stacklevel=5,
        )

    def _capture_failed(self, exc: BaseException) -> None:
        self._graphs_failed = True
        self.release_graphs()
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        where = f" at {frame.filename}:{frame.lineno}" if frame else ""
        first = (str(exc).splitlines() or [""])[0]
        if self.cfg.cuda_graphs:  # required: no silent eager fallback
            raise UserError(
                f"engine.cuda_graphs = true, but the capture failed ({type(exc).__name__}: {first}{where}); unset it "
                "to run such steps eagerly"
            ) from exc
        warnings.warn(
            f"CUDA graph capture of the training step failed ({type(exc).__name__}: {first}{where}); running "
            "eagerly (set engine.cuda_graphs = false to skip the attempt)",
            RuntimeWarning,
            stacklevel=5,
        )

    @property
    def graph_replays(self) -> int:
        return self._graph.replays if self._graph is not None else 0

    def release_graphs(self) -> None:
        """Drop the captured step (its private memory pool returns to the allocator); the next repeat recaptures."""
        if self._graph is not None:
            self._graph.release()
            self._graph = None

    def _reduce_over_ranks(
        self, loss_total: torch.Tensor, metric_sums: dict[str, torch.Tensor], tokens: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """One all-reduce: global loss sum, metric sums (same keys on every rank) and token count."""
        keys = sorted(metric_sums)
        parts = [loss_total.reshape(1), torch.tensor([float(tokens)], device=self.device)]
        parts += [metric_sums[k].reshape(1).float() for k in keys]
        vec = self.world.all_reduce_sum(torch.cat(parts).to(torch.float64))
        metrics = {k: vec[2 + i].float() for i, k in enumerate(keys)}
        return vec[0].float(), metrics, int(round(vec[1].item()))

    def _finish(self, loss_total: torch.Tensor, norm: float) -> tuple[float, float, bool]:
        """Remove the loss scale, measure the global grad norm; one host sync for loss and norm."""
        if self.scaler.enabled:
            self.optimizer.scale_grads_(1.0 / self.scaler.scale)
        grad_norm_t = self.optimizer.grad_norm()
        loss, grad_norm = torch.stack([loss_total / norm, grad_norm_t.to(loss_total.device)]).tolist()
        return grad_norm, loss, math.isfinite(loss) and math.isfinite(grad_norm)

    def _skip(self, loss: float, grad_norm: float) -> None:
        self.skipped_total += 1
        if self.scaler.update(False):
            return  # an fp16 overflow the loss scale absorbed, not a divergence
        self.consecutive_skips += 1
        limit = self.cfg.nan_guard_max_consecutive
        warnings.warn(
            f"step {self.global_step + 1}: non-finite loss ({loss}) or grad norm ({grad_norm}); step skipped "
            f"({self.consecutive_skips} in a row, limit {limit})",
            RuntimeWarning,
            stacklevel=3,
        )
        if self.consecutive_skips >= limit:
            raise NonFiniteLossError(
                f"{self.consecutive_skips} steps in a row had a non-finite loss or gradient (last at step "
                f"{self.global_step + 1}: loss={loss}, grad_norm={grad_norm}); lower optim.lr, keep "
                f"optim.grad_clip on, check the data for empty or corrupt rows, or use bf16 instead of fp16"
            )

    def _model_flops(self, micro_batches: Sequence[Any]) -> float | None:
        """Training FLOPs of the micro-batches' real sequences: ``sum(flops_per_token(n) * n)`` over their lengths."""
        coeffs = self._flops_ab
        if coeffs is None or device.peak_bf16_flops() is None:
            return None
        per_token, per_token_and_position = coeffs
        total = 0.0
        for mb in micro_batches:
            cu = mb.cu_seqlens.tolist()
            cu = cu[: len(cu) - getattr(mb, "padding_sequences", 0)]  # a fixed-shape batch's padding does no work
            lens = [e - s for s, e in zip(cu[:-1], cu[1:]) if e > s]
            total += per_token * sum(lens) + per_token_and_position * sum(n * n for n in lens)
        return total

    @staticmethod
    def _flops_coefficients(model: nn.Module) -> tuple[float, float] | None:
        """``(a, b)`` with ``flops_per_token(n) = a + b * n`` (the model's formula is linear in the length), or None
        when the model has no formula. Taken once per engine: ``flops_per_token`` counts the model's parameters
        (~0.5 ms a call), and a micro-batch of short sequences (hundreds of them) called it once per sequence every
        step, outside the timed step: 0.4-2 s of host time per step on the H200 for 16k-token batches of the
        arithmetic task, several times the step itself."""
        fpt = getattr(model, "flops_per_token", None)
        if fpt is None:
            return None
        return fpt(0), fpt(1) - fpt(0)

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-ready engine counters (the optimizer's tensors are ``self.optimizer.state_dict()``)."""
        return {
            "global_step": self.global_step,
            "skipped_total": self.skipped_total,
            "consecutive_skips": self.consecutive_skips,
            "scaler": self.scaler.state_dict(),
            "compute_dtype": DTYPE_NAMES[self.compute_dtype],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.skipped_total = int(state["skipped_total"])
        self.consecutive_skips = int(state["consecutive_skips"])
        self.scaler.load_state_dict(state["scaler"])


def _is_compile_error(exc: BaseException) -> bool:
    mod = type(exc).__module__ or ""
    return mod.startswith(("torch._dynamo", "torch._inductor")) or "inductor" in str(exc).lower()
