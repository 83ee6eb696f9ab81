"""Every environment variable polyrl reads, declared in one place (listed by `polyrl env`).

Environment variables are for debugging and forcing only; configuration goes through config files
and command-line flags. This module only declares and reads; it never sets anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    help: str


POLYRL_KERNELS = EnvVar(
    "POLYRL_KERNELS",
    "Force kernel implementations: 'reference' (all ops) or 'op:impl,op:impl' "
    "(e.g. 'rmsnorm:triton,attention:reference'). A forced choice that fails raises.",
)
POLYRL_PLATFORM = EnvVar(
    "POLYRL_PLATFORM",
    "Force the resolved platform id (see `polyrl env`); an unknown id is an error.",
)
POLYRL_DEBUG = EnvVar("POLYRL_DEBUG", "Set to 1 to show tracebacks for CLI errors (same as --debug).")

POLYRL_API_KEY = EnvVar(
    "POLYRL_API_KEY", "API key `polyrl serve` requires (as `Authorization: Bearer KEY`); --api-key wins."
)

POLYRL_DEVICE_MEMORY_SHARE = EnvVar(
    "POLYRL_DEVICE_MEMORY_SHARE",
    "A fraction in (0, 1]: each process sizes its memory (the KV cache, colocated budgets) as if the device had only "
    "that share of its memory, for several processes sharing one device (e.g. test workers).",
)

POLYRL_PAGED_DECODE = EnvVar(
    "POLYRL_PAGED_DECODE",
    "Which Triton paged-attention kernel serves decode rows (one new token): 'heads' (the default, KV heads packed per "
    "program) or 'rows' (the general kernel, as before; for A/B runs). Read once, at import.",
)

POLYRL_FP8_FUSED_QUANT = EnvVar(
    "POLYRL_FP8_FUSED_QUANT",
    "FP8 rollout weights: 1 (the default) quantises the activations of q/k/v, gate/up and down inside the RMSNorm and "
    "SwiGLU kernels that make them; 0 runs a separate quantiser before each projection (as before; for A/B runs).",
)

POLYRL_PDL = EnvVar(
    "POLYRL_PDL",
    "Experimental, off by default, not yet measured: 1 launches the decode step's Triton kernels (RMSNorm, "
    "qk_norm_rope_cache, paged attention, SwiGLU) with Programmatic Dependent Launch on Hopper or newer NVIDIA GPUs "
    "(polyrl/kernels/pdl.py); ignored elsewhere. Read at each launch (a captured CUDA graph keeps its choice).",
)

ALL: tuple[EnvVar, ...] = (
    POLYRL_KERNELS,
    POLYRL_PLATFORM,
    POLYRL_DEBUG,
    POLYRL_API_KEY,
    POLYRL_DEVICE_MEMORY_SHARE,
    POLYRL_PAGED_DECODE,
    POLYRL_FP8_FUSED_QUANT,
    POLYRL_PDL,
)


def get(var: EnvVar, default: str | None = None) -> str | None:
    value = os.environ.get(var.name)
    if value is None or value.strip() == "":
        return default
    return value.strip()


def snapshot() -> dict[str, str | None]:
    """The current value of every declared variable (None when unset)."""
    return {v.name: os.environ.get(v.name) for v in ALL}
