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
- ``fp8_quantize_t_delayed(x [M, K], fp8_dtype, state: AmaxState, pad_t=1) -> (q, scale, q_t, scale)``: the
  tensor-wise ``fp8_quantize_t`` with a *delayed* scale: ``inv = FP8_MAX / (max(prev, EPS) * 256)``, ``prev`` the
  amax this ``state`` recorded at its previous call (the 256x headroom: a tensor whose amax grew up to that much
  since then still fits; values above saturate at ``FP8_MAX``); a state's first call uses the current scale (as
  ``fp8_quantize_t``). Every call records ``min(max|x|, 2^64)`` in ``state`` for the next. The Triton
  implementation does it in one read of ``x`` (the tiled cast, then a one-thread launch keeping the amax) instead
  of two; the FP8 linear uses it for the gradient ``dY`` (``models/fp8_linear.py`` says why only there).
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
register("fp8_quantize_t_delayed", "reference", "polyrl.kernels.fp8.reference:quantize_t_delayed", priority=0)
register(
    "fp8_quantize_t_delayed",
    "triton",
    "polyrl.kernels.fp8.triton:quantize_t_delayed",
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


class AmaxState:
    """The delayed-scaling state of one tensor site (``fp8_quantize_t_delayed``): ``buf`` int32 ``[2]`` on the
    device (``buf[0]``: the bits of the amax recorded by the previous call, fp32; ``buf[1]``: the Triton cast's
    running amax, zero between calls) and ``ready`` (host: whether ``buf[0]`` holds an amax yet;
    False until the first call). Everything a call reads or writes is on the device: no host synchronisation, so
    a CUDA graph captures and replays it (``ready`` is decided when the graph is captured: after an eager call)."""

    __slots__ = ("buf", "ready")

    def __init__(self, device: torch.device | str) -> None:
        self.buf = torch.zeros(2, dtype=torch.int32, device=device)
        self.ready = False

    def amax(self) -> torch.Tensor:
        """The recorded amax (fp32 ``[]``, a view of ``buf``; reading its value synchronises)."""
        return self.buf[:1].view(torch.float32)[0]


def fp8_quantize_t_delayed(
    x: torch.Tensor, fp8_dtype: torch.dtype, state: AmaxState, pad_t: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tensor-wise ``fp8_quantize_t`` with the delayed scale of ``state`` (contract above), through the registry
    (op ``fp8_quantize_t_delayed``); marks ``state`` ready."""
    if not isinstance(state, AmaxState):
        raise TypeError(f"fp8_quantize_t_delayed: state must be an AmaxState, got {type(state).__name__}")
    if state.buf.device != x.device:
        raise ValueError(f"fp8_quantize_t_delayed: the state is on {state.buf.device}, the tensor on {x.device}")
    impl = registry.select("fp8_quantize_t_delayed", x.device.type, str(x.dtype).removeprefix("torch."))[1]
    out = impl(x, fp8_dtype, state.buf, state.ready, pad_t)
    state.ready = True
    return out


def emulation_forced() -> bool:
    """Whether ``POLYRL_KERNELS`` forces the reference FP8 GEMM (``reference`` or ``fp8_scaled_mm:reference``): FP8
    training then runs emulated (dequantise + fp32 matmul) on any device, the CPU included."""
    forced = parse_forced(envvars.get(envvars.POLYRL_KERNELS))
    return forced.get("fp8_scaled_mm", forced.get(ANY)) == "reference"
