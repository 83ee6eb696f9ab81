"""adamw8bit_step: one AdamW update with blockwise 8-bit moments (``reference.py`` has the format and the spec).

``adamw8bit_step(param, grad, state, scalars, param_out=None)`` dispatches through the kernel registry on the
parameter's device type and dtype: Triton on CUDA, the reference elsewhere (the CPU: the offloaded optimizer).
"""

from __future__ import annotations

import torch

from polyrl.kernels.adamw8bit.reference import BLOCK, StepScalars, init_state  # noqa: F401 - re-exported
from polyrl.kernels.registry import register, select

register("adamw8bit", "reference", "polyrl.kernels.adamw8bit.reference:adamw8bit_step", priority=0)
register(
    "adamw8bit",
    "triton",
    "polyrl.kernels.adamw8bit.triton:adamw8bit_step",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=10,
)


def adamw8bit_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    scalars: StepScalars,
    param_out: torch.Tensor | None = None,
) -> None:
    """In-place 8-bit AdamW update of ``param`` and ``state`` (see ``reference.adamw8bit_step``)."""
    _, fn = select("adamw8bit", param.device.type, str(param.dtype).removeprefix("torch."))
    fn(param, grad, state, scalars, param_out)
