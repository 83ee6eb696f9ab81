"""fp8: current-scaling quantisation to float8 (``fp8_quantize``) and the scaled FP8 GEMM (``fp8_scaled_mm``).

Format (the contract every implementation keeps; ``reference.py`` is the spec):

- ``fp8_quantize(x [M, K], fp8_dtype, rowwise) -> (q [M, K] fp8_dtype, scale fp32)``: ``amax = max|x|`` over the
  whole tensor (tensor-wise, ``scale`` shape ``[]``) or over each row (row-wise, ``scale`` ``[M, 1]``),
  ``inv = FP8_MAX / max(amax, 1e-12)`` in fp32, ``q = clamp(x_fp32 * inv, -FP8_MAX, FP8_MAX)`` rounded to nearest
  even, ``scale = 1 / inv``: the *dequantisation* scale, so ``x ~= q.float() * scale`` (what ``torch._scaled_mm``
  takes). FP8_MAX is 448 for ``float8_e4m3fn`` and 57344 for ``float8_e5m2``.
- ``fp8_quantize_t(x [M, K], fp8_dtype, rowwise, pad_t=1) -> (q, scale, q_t [K, M_pad], scale_t [])``:
  ``fp8_quantize`` plus the *tensor-wise* quantisation of ``x`` transposed and contiguous, its rows padded with
  zeros to ``M_pad`` = M rounded up to a multiple of ``pad_t`` (row-wise ``q`` has its own tensor-wise
  ``scale_t``; tensor-wise ``scale_t`` is ``scale``). The FP8 linear's backward takes ``q_t`` as the column-major
  operand of its GEMMs; the Triton implementation writes both copies from one read of each tile.
- ``fp8_scaled_mm(a [M, K] fp8, b [K, N] fp8, scale_a, scale_b, out_dtype, use_fast_accum) -> [M, N]``:
  ``(a.float() * scale_a) @ (b.float() * scale_b)`` accumulated in fp32, rounded once to ``out_dtype``. Scales are
  tensor-wise (``[]``) or row-wise (``scale_a [M, 1]`` with ``scale_b [1, N]``). ``b`` may be any layout (the fast
  path wants it column-major, i.e. ``w.t()`` of a row-major ``w [N, K]``, and makes it so).

Implementations: quantisation in Triton (CUDA) and plain PyTorch (everywhere); the GEMM through
``torch._scaled_mm`` (CUDA capability >= 8.9 / ROCm gfx94x+, ``platform.device.supports_fp8_gemm``) and the
reference, which dequantises and multiplies in fp32 and runs on the CPU: forcing it (``POLYRL_KERNELS=reference``
or ``fp8_scaled_mm:reference``) emulates FP8 training anywhere, which is how the CPU tests run it.

Not here: which GEMMs of a layer run in FP8 and with which scaling (``polyrl/models/fp8_linear.py``).
"""

from __future__ import annotations

import torch

from polyrl.kernels import registry
from polyrl.kernels.registry import ANY, parse_forced, register
from polyrl.platform import envvars

register("fp8_quantize", "reference", "polyrl.kernels.fp8.reference:quantize", priority=0)
register(
    "fp8_quantize",
    "triton",
    "polyrl.kernels.fp8.triton:quantize",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=10,
)
register("fp8_quantize_t", "reference", "polyrl.kernels.fp8.reference:quantize_t", priority=0)
register(
    "fp8_quantize_t",
    "triton",
    "polyrl.kernels.fp8.triton:quantize_t",
    devices=("cuda",),
    dtypes=("float32", "bfloat16", "float16"),
    priority=10,
)
register("fp8_scaled_mm", "reference", "polyrl.kernels.fp8.reference:scaled_mm", priority=0)
register("fp8_scaled_mm", "torch", "polyrl.kernels.fp8.scaled_mm:scaled_mm", devices=("cuda",), priority=10)


def fp8_quantize_t(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool = False, pad_t: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fp8_quantize`` with the tensor-wise transposed copy (contract above), through the registry (op
    ``fp8_quantize_t``; ``POLYRL_KERNELS=fp8_quantize_t:reference`` forces the reference). Dispatched here, beside
    its contract, rather than in ``kernels.ops``: only the FP8 linear and its bench call it."""
    impl = registry.select("fp8_quantize_t", x.device.type, str(x.dtype).removeprefix("torch."))[1]
    return impl(x, fp8_dtype, rowwise, pad_t)


def emulation_forced() -> bool:
    """Whether ``POLYRL_KERNELS`` forces the reference FP8 GEMM (``reference`` or ``fp8_scaled_mm:reference``): FP8
    training then runs emulated (dequantise + fp32 matmul) on any device, the CPU included."""
    forced = parse_forced(envvars.get(envvars.POLYRL_KERNELS))
    return forced.get("fp8_scaled_mm", forced.get(ANY)) == "reference"
