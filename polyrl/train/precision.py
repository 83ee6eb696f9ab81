"""Precision decisions of the training engine: the compute dtype for this device and fp16 loss scaling.

``resolve_compute_dtype`` turns "auto" into bf16 on accelerators that support it and fp32 on the CPU.
``LossScaler`` is the dynamic loss scale fp16 needs (bf16 and fp32 use a fixed scale of 1).
``apply_linear_precision`` switches the decoder's projections to FP8 training GEMMs (``precision.linear = "fp8"``)
after checking that the device can run them. This module does not cast models or own weights; the engine and
``MasterAdamW`` do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from polyrl.errors import ConfigError
from polyrl.kernels.fp8 import emulation_forced
from polyrl.models.fp8_linear import convert_to_fp8, fp8_candidates, is_fp8_lora
from polyrl.platform import device
from polyrl.train.config import PrecisionConfig

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def resolve_compute_dtype(cfg: PrecisionConfig, device_type: str | None = None) -> torch.dtype:
    """The torch dtype of compute weights and activations for ``cfg`` on ``device_type`` (default: this
    machine's accelerator, or the CPU)."""
    dev = device_type or device.device_type()
    if cfg.compute_dtype == "auto":
        if dev == "cpu":
            return torch.float32
        return torch.bfloat16 if device.supports_bf16() else torch.float16
    if cfg.compute_dtype == "bf16" and dev != "cpu" and not device.supports_bf16():
        raise ConfigError(
            "precision.compute_dtype = 'bf16' but this accelerator does not support bf16; use 'fp16' or 'auto'"
        )
    return _DTYPES[cfg.compute_dtype]


def check_fp8_supported(device_type: str) -> None:
    """Raise ``ConfigError`` unless FP8 GEMMs can run on ``device_type``: a device with them
    (``device.supports_fp8_gemm``), or anywhere when ``POLYRL_KERNELS`` forces the reference GEMM (emulated FP8:
    dequantise + fp32 matmul, slow, for tests and numerics studies)."""
    if emulation_forced():
        return
    if device_type == "cuda" and device.supports_fp8_gemm():
        return
    cap = device.capability() if device_type != "cpu" else None
    where = f"{device.name()} (capability {cap[0]}.{cap[1]})" if cap else f"this {device_type} device"
    raise ConfigError(
        f"precision.linear = 'fp8' (--precision fp8) needs FP8 GEMMs, which {where} does not have (CUDA capability "
        ">= 8.9 such as H100/H200/L40/RTX 4090, or ROCm MI300+; `polyrl env` says 'fp8 gemm'); train in bf16 "
        "instead, or set POLYRL_KERNELS=fp8_scaled_mm:reference to emulate FP8 (slow, for numerics only)"
    )


def apply_linear_precision(model: nn.Module, cfg: PrecisionConfig, device_type: str) -> int:
    """Switch the decoder projections of ``model`` to FP8 training GEMMs when ``cfg.linear == "fp8"`` (refused with
    ``ConfigError`` where the device cannot run them); returns how many projections were switched (0 otherwise).
    Parameters are kept: the checkpoint format and the optimizer do not change."""
    if cfg.linear != "fp8":
        return 0
    check_fp8_supported(device_type)
    others = sorted(
        {type(m).__name__ for _, m in fp8_candidates(model) if not isinstance(m, nn.Linear) and not is_fp8_lora(m)}
    )
    if others:
        raise ConfigError(
            f"--precision fp8 runs linear projections and LoRA layers on a dense base in FP8, but this model has "
            f"{', '.join(others)} (a QLoRA / NF4 base has no FP8 path); drop --precision fp8 or --qlora"
        )
    n = convert_to_fp8(model, cfg.fp8_scaling)
    if n == 0:
        raise ConfigError(
            f"--precision fp8 found no decoder projections ({', '.join(('q_proj', 'down_proj'))}, ...) in "
            f"{type(model).__name__}; it applies to polyrl's decoder models"
        )
    return n


class LossScaler:
    """Dynamic loss scale for fp16: multiply the loss by ``scale``; on a non-finite gradient halve it and
    skip the step; after ``growth_interval`` good steps in a row double it. Disabled (scale 1, never
    changes) for bf16/fp32, where overflow means a real divergence."""

    def __init__(
        self, enabled: bool, initial_scale: float = 2.0**16, growth_interval: int = 1000, min_scale: float = 1.0
    ) -> None:
        self.enabled = enabled
        self.scale = float(initial_scale) if enabled else 1.0
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self._good_steps = 0

    def update(self, finite: bool) -> bool:
        """Record a step's outcome. Returns True when a non-finite step was an overflow the scaler
        absorbed (the scale went down), False when it is a real non-finite step (or the step was fine)."""
        if not self.enabled:
            return False
        if finite:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self.scale *= 2.0
                self._good_steps = 0
            return False
        self._good_steps = 0
        if self.scale / 2.0 < self.min_scale:
            return False
        self.scale /= 2.0
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
