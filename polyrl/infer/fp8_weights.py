"""FP8 weights for the rollout engine (``RolloutConfig.weight_precision = "fp8"``): the engine's own float8_e4m3fn
copies of the decoder's projection weights, scaled per output channel, and the op that multiplies by them.

Numerics (``fp8_weight_linear``; ``reference_linear`` is the spec)::

    w_fp8 [N, K] = round_e4m3(W / s_w),  s_w [N] fp32 = max(|W[n, :]|, 1e-12) / 448       (per output channel)
    x_fp8 [M, K] = round_e4m3(x / s_x),  s_x [M] fp32 = max(|x[m, :]|, 1e-12) / 448       (per token, at run time)
    y [M, N]     = (x_fp8 @ w_fp8^T accumulated in fp32) * s_x[:, None] * s_w[None, :]   (then x's dtype)

Both scalings are "current" (computed from the tensor being quantised, never from history): the weights are
quantised once per weight version and each activation row on the fly, so no amax history to keep in sync across
RL steps. The fast path (``scaled_mm_linear``, CUDA) quantises the activation rows with one Triton kernel
(``fp8_quant_triton.py``; the reference's arithmetic, division included) and multiplies with ``torch._scaled_mm``:
row-wise scales (``scale_a [M, 1]``, ``scale_b [1, N]``, bf16 out) where the device has them (compute capability
>= 9.0), otherwise unit tensor-wise scales with the outer product of the two scales applied afterwards. Nothing in
either path syncs the host, so decode steps still capture in CUDA graphs. Several projections of one input (q/k/v,
gate/up) share one activation quantisation and run one GEMM each (outputs stay contiguous), or, with
``RolloutConfig.fuse_projections``, one GEMM over the group's concatenated copy whose outputs are its column slices
(``fused_projections.py`` lists the consumers that take them as they are). The members' copies are then row slices of
the group's buffer, so fusing costs no memory; the qwen3-8b B256 profile (2026-12-03) ran a layer's seven FP8 GEMMs at
~19 us each, the k and v ones on 16 of 132 multiprocessors (N = 1024, 128 x 128 tiles).

``Fp8Weights`` holds the copies of the projections ``project`` / ``project_group`` reach (attention q/k/v/o and
the dense MLPs' gate/up/down, a shared expert's included) and is the decoder's projection override
(``polyrl.models.decoder.projection_override``), which the ``ModelRunner`` enters around its own forwards only: the
training forward and the trainer's log-prob recompute of the same (shared) module still run the bf16 weights, so
the RL run's mismatch / TIS metrics measure exactly what FP8 sampling changes. ``requantize`` writes into the same
tensors (captured graphs stay valid); the engine marks the copies stale whenever its weights change
(``LLM.reset_prefix_cache``, which every weight update of the RL runs calls) and requantises before its next
forward. Memory: one byte per projection weight (plus 4 bytes per output channel), about half the bf16 weights,
on top of them (colocated RL shares the trainer's bf16 weights and adds this copy); ``LLM.release()`` (the KV cache
freed for training) frees the copies too (``free``), and the next rollout quantises them anew.

Deliberately not here: the LM head and embeddings (kept in the model's dtype, as vLLM's FP8 checkpoints do), MoE
routed experts (their grouped kernels take the model's dtype), LoRA layers (refused), an FP8 KV cache, FP8 training
(``polyrl.kernels.fp8``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from polyrl import kernels
from polyrl.errors import UserError
from polyrl.kernels import dtype_name, registry
from polyrl.models.decoder import MLP, Attention, DecoderLayer, ProjectionOverride, RMSNorm
from polyrl.platform import device, envvars

OP = "fp8_weight_linear"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
AMAX_FLOOR = 1e-12  # an all-zero row gets this amax: its scale stays finite and its values 0
ALIGN = 16  # torch._scaled_mm wants K and N multiples of 16; a projection that is not stays in the model's dtype
ROWWISE_CAPABILITY = (9, 0)  # _scaled_mm's row-wise scales (CUTLASS) run on compute capability >= 9.0
# _scaled_mm's fast accumulation (Hopper: the tensor cores' own accumulator, no periodic promotion to fp32 registers):
# forward-only inference is where torchao (float8 inference, the forward GEMM of training) and vLLM take it; the
# GPU test holds it to the fp32-accumulated reference within 2% (scale-relative)
USE_FAST_ACCUM = True
QUANT_CHUNK_ROWS = 4096  # weight rows quantised at once: bounds the fp32 temporary (4096 x K x 4 bytes)

registry.register(OP, "reference", "polyrl.infer.fp8_weights:reference_linear", priority=0)
registry.register(
    OP, "scaled_mm", "polyrl.infer.fp8_weights:scaled_mm_linear", devices=("cuda",),
    dtypes=("bfloat16", "float16"), priority=10,
)  # fmt: skip


def quantize_rows(t: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [R, C]`` -> (e4m3 ``[R, C]``, fp32 scales ``[R]``) with ``t[r] ~ q[r] * s[r]`` (the module docstring).
    ``out``: an e4m3 ``[R, C]`` tensor to write into (rows quantised ``QUANT_CHUNK_ROWS`` at a time)."""
    q = torch.empty(t.shape, dtype=FP8_DTYPE, device=t.device) if out is None else out
    scales = torch.empty(t.shape[0], dtype=torch.float32, device=t.device)
    for r in range(0, t.shape[0], QUANT_CHUNK_ROWS):
        part = t[r : r + QUANT_CHUNK_ROWS].float()
        amax = part.abs().amax(dim=1).clamp_min(AMAX_FLOOR)
        # a tensor divisor: CUDA turns ``tensor / python_float`` into a multiply by the rounded reciprocal (two
        # roundings), the CPU divides; this is the correctly rounded quotient on every device (and the Triton kernel's)
        s = amax.div(torch.full_like(amax, FP8_MAX))
        q[r : r + QUANT_CHUNK_ROWS] = (part / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scales[r : r + QUANT_CHUNK_ROWS] = s
    return q, scales


def reference_linear(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    scales: tuple[torch.Tensor, ...],
    pre: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The spec: ``x [M, K]``, e4m3 ``weights[i] [N_i, K]``, fp32 ``scales[i] [N_i]`` -> ``y_i [M, N_i]`` in
    ``x``'s dtype (no bias). Plain PyTorch on any device: the e4m3 values are exact in fp32, the product is
    accumulated in fp32 and scaled afterwards, as the FP8 GEMM does (only the summation order differs). ``pre``:
    ``quantize_rows(x)`` already made (by the kernel that produced x), used instead of quantising again."""
    xq, xs = quantize_rows(x) if pre is None else pre
    xf = xq.float()
    return tuple(((xf @ w.float().t()) * xs[:, None] * s[None, :]).to(x.dtype) for w, s in zip(weights, scales))


_ONES: dict[torch.device, torch.Tensor] = {}


def _one(dev: torch.device) -> torch.Tensor:
    """A cached fp32 scalar 1 on ``dev`` (made outside any graph capture: ``Fp8Weights`` warms it up)."""
    one = _ONES.get(dev)
    if one is None:
        one = _ONES[dev] = torch.ones((), dtype=torch.float32, device=dev)
    return one


@functools.cache
def rowwise_supported(dev: torch.device) -> bool:
    """Whether ``_scaled_mm`` takes row-wise scales on ``dev`` (asked once per device)."""
    cap = device.capability(dev.index or 0)
    return cap is not None and tuple(cap) >= ROWWISE_CAPABILITY


def scaled_mm_linear(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    scales: tuple[torch.Tensor, ...],
    pre: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """``reference_linear`` on the GPU: the Triton row quantiser, then one ``torch._scaled_mm`` per weight. The second
    operand is ``w.t()`` of the row-major ``[N, K]`` copy: column-major ``[K, N]``, as cuBLASLt wants it. Signature
    as in torch 2.6 - 2.13: ``_scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)``."""
    # lazy: triton loads only where this implementation is selected (CUDA)
    from polyrl.infer.fp8_quant_triton import quantize_rows_triton

    xq, xs = quantize_rows_triton(x, FP8_MAX, AMAX_FLOOR) if pre is None else pre
    outs = []
    if rowwise_supported(x.device):
        sa = xs[:, None]  # [M, 1]
        for w, s in zip(weights, scales):
            y = torch._scaled_mm(
                xq,
                w.t(),
                scale_a=sa,
                scale_b=s[None, :],
                out_dtype=torch.bfloat16,
                use_fast_accum=USE_FAST_ACCUM,
            )
            outs.append(y if x.dtype == torch.bfloat16 else y.to(x.dtype))
    else:  # Ada (8.9), ROCm: tensor-wise scales only; apply the row and column scales to the fp32 product
        one = _one(x.device)
        for w, s in zip(weights, scales):
            y = torch._scaled_mm(
                xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=USE_FAST_ACCUM
            )
            outs.append((y * xs[:, None] * s[None, :]).to(x.dtype))
    return tuple(outs)


def fp8_weight_linear(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],
    scales: tuple[torch.Tensor, ...],
    pre: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The op, dispatched by the kernel registry on ``x``'s device and dtype (``POLYRL_KERNELS`` forces one);
    ``pre``: x's ``quantize_rows`` already made."""
    return registry.select(OP, x.device.type, dtype_name(x.dtype))[1](x, weights, scales, pre)


def quantize_weight(
    w: torch.Tensor, out: torch.Tensor | None = None, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection weight's per-output-channel copy (``quantize_rows``), into ``out`` / ``scales`` when given. On
    CUDA the Triton row quantiser does it (bit-equal to ``quantize_rows`` on the device,
    tests/kernels/test_fp8_act_quant.py): one launch per weight, one read of it. The reference's chunked fp32
    temporaries are, by their counts, the ~110 ms of copy and elementwise kernels in the qwen3-8b FP8 rollout profile
    (2026-12-03, absent from the bf16 one); a requantisation runs after every RL weight sync."""
    if w.is_cuda and not reference_forced():
        # lazy: triton loads only on CUDA
        from polyrl.infer.fp8_quant_triton import quantize_rows_triton

        return quantize_rows_triton(w, FP8_MAX, AMAX_FLOOR, out=out, scales=scales)
    q, s = quantize_rows(w, out=out)
    if scales is not None:
        scales.copy_(s)
        s = scales
    return q, s


def reference_forced() -> bool:
    """Whether ``POLYRL_KERNELS`` forces this op's plain-PyTorch reference (``fp8_weight_linear:reference`` or
    ``reference``): FP8 rollout then runs (slowly) on any device, the CPU included - tests and debugging."""
    forced = registry.parse_forced(envvars.get(envvars.POLYRL_KERNELS))
    return forced.get(OP, forced.get(registry.ANY)) == "reference"


def check_supported(model: nn.Module) -> None:
    """UserError unless FP8 rollout can run for ``model`` here."""
    dev = next(model.parameters()).device
    if getattr(model, "lora_config", None) is not None or getattr(model, "lora_bank", None) is not None:
        raise UserError(
            "FP8 rollout weights (weight_precision='fp8', --rollout-precision fp8, --quantize fp8) do not combine "
            "with LoRA adapters yet; drop the FP8 setting or merge the adapter into the model first"
        )
    if reference_forced():
        return
    if dev.type == "cpu" or not device.supports_fp8_gemm():
        where = "the CPU" if dev.type == "cpu" else f"this device ({device.name()}, capability {device.capability()})"
        raise UserError(_unsupported(where))


def check_machine() -> None:
    """UserError when no device of this machine can run FP8 rollout weights (a CPU-only machine, a vendor stack
    without FP8 GEMMs, CUDA devices all below capability 8.9): ``polyrl train --rollout-precision fp8`` asks this
    before any model loads; ``check_supported`` still checks the device the rollout model is on."""
    if reference_forced():
        return
    kind = device.device_type()
    if kind == "cuda" and any(device.supports_fp8_gemm(i) for i in range(max(device.count(), 1))):
        return
    raise UserError(_unsupported("the CPU" if kind == "cpu" else f"this machine's {kind} device"))


def _unsupported(where: str) -> str:
    return (
        f"FP8 rollout weights need a device with FP8 matrix multiply (NVIDIA compute capability >= 8.9: Ada, "
        f"Hopper, Blackwell; AMD MI300 / MI350), and {where} has none (`polyrl env` lists it); run the rollout "
        f"in the model's precision (drop --rollout-precision fp8 / --quantize fp8), or set "
        f"POLYRL_KERNELS={OP}:reference to run the slow plain-PyTorch reference (tests, debugging)"
    )


def eligible(linear: nn.Module) -> bool:
    """A plain ``nn.Linear`` with a plain weight whose dims are multiples of ``ALIGN``."""
    return (
        type(linear) is nn.Linear
        and type(linear.weight) is nn.Parameter
        and linear.in_features % ALIGN == 0
        and linear.out_features % ALIGN == 0
    )


def _projections(model: nn.Module) -> list[nn.Linear]:
    """The linears the decoder runs through ``project`` / ``project_group``, in module order."""
    out: list[nn.Linear] = []
    for m in model.modules():
        if isinstance(m, Attention):
            out += [m.q_proj, m.k_proj, m.v_proj, m.o_proj]
        elif isinstance(m, MLP):
            out += [m.gate_proj, m.up_proj, m.down_proj]
    return [lin for lin in out if eligible(lin)]


def _fusable_groups(model: nn.Module) -> list[tuple[nn.Linear, ...]]:
    """The q/k/v and gate/up tuples (as the decoder passes them to ``project_group``) whose members all take FP8
    copies and share one input width: one GEMM each under ``fuse`` (what ``fused_projections`` does for the model's
    dtype, here with no extra memory: the members' copies are row slices of the group's buffer)."""
    out = []
    for m in model.modules():
        group = (m.q_proj, m.k_proj, m.v_proj) if isinstance(m, Attention) else None
        group = (m.gate_proj, m.up_proj) if isinstance(m, MLP) else group
        if group and all(eligible(lin) for lin in group) and len({lin.in_features for lin in group}) == 1:
            out.append(group)
    return out


def fused_quant_enabled() -> bool:
    """``POLYRL_FP8_FUSED_QUANT`` (default 1): the activation quantiser fused into the RMSNorm and SwiGLU kernels that
    feed FP8 projections; 0 quantises every projection input in its own launch (the earlier path, for A/B runs)."""
    return envvars.get(envvars.POLYRL_FP8_FUSED_QUANT) != "0"


def _quantising_consumers(model: nn.Module, has_copy) -> tuple[set[RMSNorm], set[MLP]]:
    """The norms whose output only feeds projections with FP8 copies (a layer's input norm before q/k/v; its
    post-attention norm before a dense MLP's gate/up), and the MLPs whose down projection has one."""
    norms: set[RMSNorm] = set()
    mlps: set[MLP] = set()
    for layer in model.modules():
        if not isinstance(layer, DecoderLayer):
            continue
        attn = layer.self_attn
        if all(has_copy(lin) for lin in (attn.q_proj, attn.k_proj, attn.v_proj)):
            norms.add(layer.input_layernorm)
        if isinstance(layer.mlp, MLP) and has_copy(layer.mlp.gate_proj) and has_copy(layer.mlp.up_proj):
            norms.add(layer.post_attention_layernorm)
    for mlp in model.modules():
        if isinstance(mlp, MLP) and has_copy(mlp.down_proj):
            mlps.add(mlp)
    return norms, mlps


FUSED_MAX_COLS = 16384  # the fused kernels hold a row in registers (fp8_quant_triton's one-pass width)


def _reference_composition(x: torch.Tensor) -> bool:
    """Whether the fused norm / activation runs as the reference composition (the op, then ``quantize_rows``): where
    ``fp8_weight_linear`` runs its reference (the CPU, or ``POLYRL_KERNELS`` forcing it)."""
    return not x.is_cuda or reference_forced()


def _fused_kernel_fits(x: torch.Tensor, op: str) -> bool:
    """Whether the Triton kernel fusing ``op`` (``rmsnorm`` / ``swiglu``) with the quantiser computes what the
    unfused path would: rows of at most ``FUSED_MAX_COLS`` (wider ones keep the separate quantiser, two passes) and
    ``op`` served by its Triton implementation here (a ``POLYRL_KERNELS`` choice of another one is honoured)."""
    return x.shape[1] <= FUSED_MAX_COLS and registry.select(op, x.device.type, dtype_name(x.dtype))[0] == "triton"


class Fp8Weights(ProjectionOverride):
    """FP8 copies of a model's projection weights and the projection override that uses them (module docstring).

    ``entries``: module -> (e4m3 ``[N, K]``, fp32 ``[N]``). ``project(linears, x)`` is the override the decoder
    calls: the outputs when every module of ``linears`` has a copy, else None (the decoder's own path).

    Fused activation quantisation (``fused_quant``, ``POLYRL_FP8_FUSED_QUANT``): ``norm`` (the RMSNorm before q/k/v
    and before gate/up) and ``activation`` (the SwiGLU before down) compute their output and its per-row e4m3 copy in
    one kernel (``fp8_quant_triton``; the reference composition where the reference runs) and keep the copy for the
    next ``project`` of that same tensor (matched by identity, used once), so only the o projection's input is
    quantised on its own. The outputs are bit-equal to the unfused path's: the same values, quantised the same way."""

    def __init__(self, model: nn.Module, fuse: bool = False, fused_quant: bool | None = None) -> None:
        check_supported(model)
        self.model = model
        self.fuse = fuse
        self.fused_quant = fused_quant_enabled() if fused_quant is None else fused_quant
        self._kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (x, x_e4m3, scales)
        self.prequantized_uses = 0  # projections that took a kept copy (tests; counts capture-time calls too)
        self.entries: dict[nn.Module, tuple[torch.Tensor, torch.Tensor] | None] = {}
        # fused groups (``fuse``): the module tuple the decoder passes -> (e4m3 [sum N, K], fp32 [sum N], row
        # bounds); each member's entry is a row slice of these buffers (views: no memory beyond the per-module copies)
        self.groups: dict[tuple[nn.Module, ...], tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = {}
        self._build()
        if not self.entries:
            raise UserError(
                f"FP8 rollout weights found no projection to quantise in this model (plain nn.Linear q/k/v/o and "
                f"gate/up/down with dims that are multiples of {ALIGN}); run it in the model's precision"
            )
        _one(next(model.parameters()).device)  # before any capture
        self.quant_norms, self.quant_mlps = _quantising_consumers(model, lambda lin: lin in self.entries)
        self.stale = False
        self.requantizations = 0  # how many times the copies were refreshed after a weight change

    def _build(self) -> None:
        """Allocate and fill every copy (``__init__``, and ``refresh`` after ``free``)."""
        self.entries, self.groups = {}, {}
        with torch.no_grad():
            if self.fuse:
                for group in _fusable_groups(self.model):
                    rows = [lin.out_features for lin in group]
                    w0 = group[0].weight
                    buf = torch.empty((sum(rows), w0.shape[1]), dtype=FP8_DTYPE, device=w0.device)
                    scales = torch.empty(sum(rows), dtype=torch.float32, device=w0.device)
                    bounds = [0]
                    for lin, n in zip(group, rows):
                        a = bounds[-1]
                        bounds.append(a + n)
                        self.entries[lin] = quantize_weight(lin.weight, buf[a : a + n], scales[a : a + n])
                    self.groups[group] = (buf, scales, tuple(bounds))
            for lin in _projections(self.model):
                if lin not in self.entries:
                    self.entries[lin] = quantize_weight(lin.weight)

    @classmethod
    def for_engine(cls, model: nn.Module, weight_precision: str | None, fuse: bool = False) -> Fp8Weights | None:
        """The engine's copies for ``RolloutConfig.weight_precision`` (None: the model's own weights), q/k/v and
        gate/up as one GEMM each with ``fuse`` (``RolloutConfig.fuse_projections``)."""
        return cls(model, fuse) if weight_precision == "fp8" else None

    @property
    def nbytes(self) -> int:
        """Bytes the copies hold now (0 after ``free``; a fused group's members are views of one buffer)."""
        return sum(e[0].numel() + e[1].numel() * 4 for e in self.entries.values() if e is not None)

    def mark_stale(self) -> None:
        """The source weights changed: requantise before the next forward (``refresh``)."""
        self.stale = True

    def free(self) -> None:
        """Drop the copies' memory (the engine released its KV cache and graphs, e.g. while colocated training runs);
        the next ``refresh`` quantises into new tensors."""
        self.entries = dict.fromkeys(self.entries)  # type: ignore[arg-type]
        self.groups = {}
        self.stale = True

    def refresh(self) -> bool:
        """Requantise if stale; returns whether it did. In place (captured graphs keep reading the same tensors),
        except after ``free``, which left no tensors to write into. Always outside inference mode, so the copies
        are plain tensors that a later refresh may update from anywhere (the engine's forwards run in inference mode,
        ``capture_graphs`` does not)."""
        if not self.stale:
            return False
        with torch.inference_mode(False), torch.no_grad():
            self._requantize()
        self.stale = False
        self.requantizations += 1
        return True

    def _requantize(self) -> None:
        if any(e is None for e in self.entries.values()):  # after free: new tensors (and groups)
            self._build()
            return
        for lin, entry in self.entries.items():
            quantize_weight(lin.weight, *entry)

    def _keep(self, x: torch.Tensor) -> None:
        """Quantise ``x`` for the next ``project`` of it (the reference path: the same composition, unfused)."""
        self._kept = (x, *quantize_rows(x))

    def norm(self, module: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> Any:
        """``module(x, residual)`` with its output's e4m3 copy kept, for the norms that feed FP8 projections."""
        if not self.fused_quant or module not in self.quant_norms or x.dim() != 2 or torch.is_grad_enabled():
            return None
        w = module.weight
        if not _reference_composition(x):
            if w.dtype != x.dtype or not _fused_kernel_fits(x, "rmsnorm"):
                return None  # the separate quantiser (and the model's own norm kernel) as before
            # lazy: triton loads only on CUDA
            from polyrl.infer.fp8_quant_triton import rmsnorm_quant_triton

            y, total, q, s = rmsnorm_quant_triton(x, w, module.eps, residual, FP8_MAX, AMAX_FLOOR)
            self._kept = (y, q, s)
            return y if total is None else (y, total)
        out = kernels.rmsnorm(x, w, module.eps, residual)
        self._keep(out if residual is None else out[0])
        return out

    def activation(self, mlp: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        """``swiglu(gate, up)`` with its e4m3 copy kept, for the MLPs whose down projection has an FP8 copy."""
        if not self.fused_quant or mlp not in self.quant_mlps or gate.dim() != 2 or torch.is_grad_enabled():
            return None
        if not _reference_composition(gate):
            if not _fused_kernel_fits(gate, "swiglu"):
                return None
            # lazy: triton loads only on CUDA
            from polyrl.infer.fp8_quant_triton import swiglu_quant_triton

            y, q, s = swiglu_quant_triton(gate, up, FP8_MAX, AMAX_FLOOR)
            self._kept = (y, q, s)
            return y
        y = kernels.swiglu(gate, up)
        self._keep(y)
        return y

    def _take_kept(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        kept, self._kept = self._kept, None
        if kept is None or kept[0] is not x:
            return None
        self.prequantized_uses += 1
        return kept[1], kept[2]

    def project(self, linears: tuple[nn.Module, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """``tuple(l(x) for l in linears)`` through the FP8 copies (one activation quantisation for all, or the copy
        ``norm`` / ``activation`` kept of this ``x``), or None when one of ``linears`` has none."""
        group = self.groups.get(linears) if len(linears) > 1 else None
        if group is not None:  # one GEMM over the concatenated copy; the outputs are its column slices (views)
            buf, scales, bounds = group
            (y,) = fp8_weight_linear(x, (buf,), (scales,), self._take_kept(x))
            ys = tuple(y[:, a:b] for a, b in zip(bounds, bounds[1:]))
        else:
            got = [self.entries.get(lin) for lin in linears]
            if any(e is None for e in got):
                return None
            ys = fp8_weight_linear(x, tuple(e[0] for e in got), tuple(e[1] for e in got), self._take_kept(x))
        return tuple(y if lin.bias is None else y + lin.bias for y, lin in zip(ys, linears))


__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "OP",
    "Fp8Weights",
    "check_supported",
    "fp8_weight_linear",
    "fused_quant_enabled",
    "quantize_rows",
    "quantize_weight",
    "reference_forced",
    "reference_linear",
    "scaled_mm_linear",
]
