"""Whether a device runs FP8 GEMMs, decided on recorded facts (no torch import): ``device.supports_fp8_gemm`` asks
it about the live device, ``polyrl env`` about the devices its probe subprocess saw.

Not here: running anything in FP8 (``polyrl.kernels.fp8``).
"""

from __future__ import annotations

from typing import Any


def fp8_gemm_from_facts(device_type: str | None, capability: Any, hip: bool = False, arch: str | None = None) -> bool:
    """A torch.cuda device of CUDA capability >= 8.9 (Ada, Hopper, Blackwell: ``torch._scaled_mm``), or on ROCm a
    gfx94x / gfx95x (MI300, MI350). Anything else (the CPU, older GPUs, other device types) has none."""
    if device_type != "cuda":
        return False
    if hip:
        return bool(arch) and str(arch).startswith(("gfx94", "gfx95"))
    return capability is not None and tuple(capability)[:2] >= (8, 9)
