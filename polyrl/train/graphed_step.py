"""One micro-batch's forward + backward as a replayed CUDA graph (``StepConfig.cuda_graphs``).

A training step launches thousands of kernels (a LoRA step at the Qwen3-1.7B shape: ~2,700 GEMMs and Triton
kernels plus the checkpoint hooks); where each is short the host that launches them is the bound and the device
waits. When micro-batches keep the same shapes, ``GraphedMicroStep`` captures ``loss_fn`` + ``backward`` once and
replays it: the host then issues one launch per micro-batch.

Contract (what makes a capture valid for later batches):

- the *signature* (``batch_signature``: every tensor field's shape and dtype, a dict of tensors' entries too, e.g.
  ``RLBatch.fields``, and ``max_seqlen``) is equal; the
  loss function reads nothing else of the batch on the host (``graph_safe`` loss functions promise that, e.g.
  ``causal_lm_loss``) and never synchronises with the host;
- the loss scale (``scaler.scale / normaliser``) is a device scalar refilled before each replay;
- the capture starts with every master's ``.grad`` unset, so the backward *writes* this micro-batch's gradient into
  buffers of the graph's pool (``GraphedMicroStep.grads``), allocated where the eager backward would allocate
  them: the fp32 gradients reuse activation memory freed earlier in the backward, and peak memory stays the eager
  one. After a replay each master's ``.grad`` is that buffer, or, when the step already holds a gradient (an
  eager micro-batch, or an earlier replay, copied out first since the replay overwrites it), that gradient plus
  the buffer. The optimizer keeps setting ``grad = None`` between steps;
- parameters are updated in place only (``MasterAdamW`` copies into them; the rollout engine's weight sync too).

Capture follows torch's whole-network recipe: the first micro-batch of a signature runs eagerly on fresh static
input buffers (``prepare``: its real contribution, and the warm-up that settles autotuning, cuDNN plans and
per-tensor host checks on exactly those buffers); the next one of the signature is captured first (``capture``,
torch's own side stream, nothing executes) and then replayed, as are all later ones. Capturing at the start of a
step, when no gradient is held yet, keeps the capture's peak memory at the eager one. The graph's private memory
pool holds the step's activations for as long as the graph lives; ``release()`` frees it.

Not here: choosing when to capture (``TrainEngine``), anything distributed (FSDP's collectives run eagerly).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from polyrl import kernels
from polyrl.platform import device

Signature = tuple[Any, ...]


def _tensor_fields(batch: Any) -> dict[str, Any]:
    """The batch's tensor fields: name -> tensor, or name -> {key: tensor} for a dict of tensors
    (``RLBatch.fields``)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if torch.is_tensor(value):
            out[f.name] = value
        elif isinstance(value, dict) and value and all(torch.is_tensor(v) for v in value.values()):
            out[f.name] = dict(value)
    return out


def batch_signature(batch: Any) -> Signature | None:
    """What a captured step depends on: the batch type, each tensor field's (name, shape, dtype, device) (a dict of
    tensors: each entry's, by key) and ``max_seqlen``; None for a batch that is not a dataclass (nothing to rebuild
    static buffers from)."""
    if not dataclasses.is_dataclass(batch):
        return None
    parts: list[Any] = [type(batch)]
    for name, value in _tensor_fields(batch).items():
        if torch.is_tensor(value):
            parts.append((name, tuple(value.shape), value.dtype, value.device))
        else:
            parts += [(name, k, tuple(v.shape), v.dtype, v.device) for k, v in sorted(value.items())]
    parts.append(("max_seqlen", getattr(batch, "max_seqlen", None)))
    return tuple(parts)


def shape_key(signature: Signature | None) -> Signature | None:
    """``signature`` without the devices: equal for a host batch and the same batch moved to the device."""
    if signature is None:
        return None
    return tuple(p[:-1] if isinstance(p, tuple) and p and isinstance(p[-1], torch.device) else p for p in signature)


def is_graph_safe(loss_fn: Callable[..., Any]) -> bool:
    """Loss functions opt in with ``loss_fn.graph_safe = True`` (no host sync, reads only tensors + max_seqlen)."""
    return bool(getattr(loss_fn, "graph_safe", False))


def model_is_deterministic(model: nn.Module) -> bool:
    """No active dropout anywhere (a captured step would replay a fixed RNG offset under checkpointing)."""
    for m in model.modules():
        p = getattr(m, "p", None) if isinstance(m, nn.Dropout) else getattr(m, "dropout", None)
        if isinstance(p, (int, float)) and p > 0:
            return False
    return True


class GraphedMicroStep:
    """The captured forward + backward of one micro-batch signature. ``prepare`` makes the static buffers and warms
    up on them (computing the given micro-batch for real), ``capture`` records, ``replay`` runs a micro-batch of the
    same signature; ``graph`` is None until captured."""

    def __init__(self, signature: Signature, loss_fn: Callable[..., Any], masters: Sequence[torch.Tensor]) -> None:
        self.signature = signature
        self.loss_fn = loss_fn
        self.masters = list(masters)
        self.grads: list[torch.Tensor] = []
        self.static_batch: Any = None
        self.scale = None  # 0-dim fp32 device tensor
        self.loss: torch.Tensor | None = None
        self.metrics: dict[str, torch.Tensor] = {}
        self.graph: Any = None  # the device's CUDAGraph once captured
        self.replays = 0

    # ---- gradients ------------------------------------------------------------------------------
    def _held_grads(self) -> list[tuple[int, torch.Tensor]]:
        """Before a replay: (index, tensor) of every gradient the step already holds, as tensors the replay will not
        overwrite (an earlier replay's output is copied out)."""
        held, copy_idx, copy_src = [], [], []
        for i, (m, g) in enumerate(zip(self.masters, self.grads)):
            if g is None or m.grad is None:
                continue
            if m.grad is g:
                copy_idx.append(i)
                copy_src.append(g)
            else:
                held.append((i, m.grad))
        if copy_src:
            held += list(zip(copy_idx, torch._foreach_mul(copy_src, 1.0)))
        return held

    def _bind_grads(self, held: list[tuple[int, torch.Tensor]]) -> None:
        """After a replay: held gradients += the replay's, the rest point at the replay's buffers."""
        for m, g in zip(self.masters, self.grads):
            if g is not None:
                m.grad = g
        if held:
            accs = [t for _, t in held]
            torch._foreach_add_(accs, [self.grads[i] for i, _ in held])
            for i, t in held:
                self.masters[i].grad = t

    # ---- capture --------------------------------------------------------------------------------
    @classmethod
    def prepare(
        cls, model: nn.Module, batch: Any, loss_fn: Callable[..., Any], masters: Sequence[torch.Tensor], scale: float
    ) -> tuple[GraphedMicroStep, torch.Tensor, dict[str, torch.Tensor]]:
        """Static buffers for ``batch``'s signature and the eager warm-up on them; returns the (not yet captured)
        step and this micro-batch's real (loss, metrics). ``capture`` follows."""
        sig = batch_signature(batch)
        if sig is None:
            raise TypeError(f"cannot capture a step over a {type(batch).__name__}: batches must be dataclasses")
        self = cls(sig, loss_fn, masters)
        # Static inputs: fresh buffers the graph reads; the warm-up runs on them too, so per-tensor host checks
        # (e.g. the cuDNN attention contract on cu_seqlens) are cached for exactly these tensors.
        fields = {
            name: value.clone() if torch.is_tensor(value) else {k: v.clone() for k, v in value.items()}
            for name, value in _tensor_fields(batch).items()
        }
        self.static_batch = dataclasses.replace(batch, **fields)
        dev = next(v for v in fields.values() if torch.is_tensor(v)).device
        self.scale = torch.full((), float(scale), dtype=torch.float32, device=dev)
        loss, metrics = self._run(model)  # warm-up: this micro-batch's real contribution (eager accumulation)
        return self, loss.detach().float().clone(), {k: v.detach().clone() for k, v in metrics.items()}

    def capture(self, model: nn.Module) -> None:
        """Record the forward + backward (nothing executes). Raises what the capture raises."""
        held = [m.grad for m in self.masters]  # the step's gradients so far (the warm-up's included)
        for m in self.masters:
            m.grad = None  # the captured backward allocates and writes fresh gradient buffers
        api = device.graph_api()
        if api is None:
            raise RuntimeError("this device has no CUDA graphs")
        graph_cls, graph_capture = api
        graph = graph_cls()
        # graph_capture: a failed capture leaves the stream and the CUDA RNG usable. The fast attention path stays
        # on: every replay has this signature, whose uniform-length verdict the warm-up cached for these buffers.
        try:
            with kernels.capture_keeps_fast_paths(), graph_capture(graph):
                static_loss, static_metrics = self._run(model)
            self.grads = [m.grad for m in self.masters]  # pool buffers; written by each replay
        finally:
            for m, h in zip(self.masters, held):
                m.grad = h
        self.graph = graph
        self.loss = static_loss.detach()
        self.metrics = {k: v.detach() for k, v in static_metrics.items()}

    def _run(self, model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss_sum, metrics = self.loss_fn(model, self.static_batch)
        for key, value in metrics.items():
            if not torch.is_tensor(value):
                raise TypeError(f"a graph-safe loss returns tensor metrics; {key!r} is {type(value).__name__}")
        (loss_sum * self.scale).backward()
        return loss_sum, {k: v.float() for k, v in metrics.items()}

    # ---- replay ---------------------------------------------------------------------------------
    def replay(self, batch: Any, scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the captured step on ``batch`` (same signature); the returned tensors are overwritten by the next
        replay, so read or copy them before that."""
        for name, src in _tensor_fields(batch).items():
            dst = getattr(self.static_batch, name)
            if torch.is_tensor(src):
                dst.copy_(src, non_blocking=True)
            else:
                for k, v in src.items():
                    dst[k].copy_(v, non_blocking=True)
        self.scale.fill_(float(scale))
        held = self._held_grads()
        self.graph.replay()
        self._bind_grads(held)
        self.replays += 1
        return self.loss, self.metrics

    def release(self) -> None:
        """Drop the graph and its buffers (the private pool goes back to the allocator's cache)."""
        self.graph = None
        self.static_batch = None
        self.loss, self.metrics, self.grads = None, {}, []
