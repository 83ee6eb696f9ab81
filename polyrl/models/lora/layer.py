"""``LoraLinear``: a frozen linear layer plus a trainable low-rank adapter, ``y = x W^T + b + s * B(A(drop(x)))``.

The frozen base keeps the HF parameter names of the ``nn.Linear`` it replaces (``weight``, ``bias``: the very
``Parameter`` objects, so a base checkpoint still loads by name and the rollout engine's references stay valid).
The adapter is ``lora_A`` (``Linear(in, r)``, kaiming-uniform init as PEFT) and ``lora_B`` (``Linear(r, out)``,
zeros), so a fresh adapter changes nothing; their state-dict names (``...q_proj.lora_A.weight``) are PEFT's saved
names without the ``base_model.model.`` prefix. With ``quantize_nf4()`` the base becomes 4-bit NF4 buffers
(``weight_nf4`` uint8 ``[out, in/2]``, ``weight_absmax`` fp32 ``[out * in / 64]``) run by ``kernels.nf4_matmul``
(QLoRA); the bias, if any, stays.

Forward: when dropout is off and input, adapter (and dense base) share a dtype (training: the engine casts the
adapters to the compute dtype), one ``kernels.lora_linear`` node (the adapter's product added by the GEMMs; an NF4
base is dequantized transiently); with dropout, the base matmul then an in-place ``addmm_`` for the adapter; fp32
adapters on a lower-precision base (inference) compose in the adapter's dtype.

Merging adds ``s * B @ A`` into the base weight IN PLACE (fp32 arithmetic, one rounding to the weight's dtype) and
unmerging subtracts it again (within one ulp per element and cycle), or with ``merge(exact=True)`` copies back a
backup taken at merge time (bit-exact, one extra copy of the weight while merged). While merged the adapter branch
is skipped. With ``fp8_rowwise`` set (``models/fp8_linear.convert_to_fp8``, ``--precision fp8``), a dense frozen base
runs its GEMMs in FP8 while training (no weight-gradient GEMM: it is frozen) and the adapter stays in the compute
dtype. Not here: choosing which layers get adapters (``apply.py``), file formats.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from polyrl import kernels
from polyrl.errors import UserError
from polyrl.kernels.lora_linear.fused import _zero, frozen_base_onto
from polyrl.kernels.nf4.reference import dequantize_nf4, quantize_nf4
from polyrl.models.fp8_linear import fp8_linear


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int, scaling: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter: HF name and identity kept
        self.bias = base.bias
        dev = base.weight.device
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=dev, dtype=torch.float32)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=dev, dtype=torch.float32)
        self.r, self.scaling, self.dropout = r, float(scaling), float(dropout)
        self.merged = False
        self.disabled = False
        self.quant_shape: tuple[int, int] | None = None  # (out, in) when the base is NF4
        self.fp8_rowwise: bool | None = None  # FP8 base GEMMs while training (convert_to_fp8); None: off

    @torch.no_grad()
    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """PEFT's init: A ~ kaiming_uniform(a=sqrt(5)) (= U(-1/sqrt(in), 1/sqrt(in))), B = 0."""
        bound = 1.0 / math.sqrt(self.in_features)
        self.lora_A.weight.uniform_(-bound, bound, generator=generator)
        self.lora_B.weight.zero_()

    # ---- forward --------------------------------------------------------------------------------
    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_shape is None:
            return F.linear(x, self.weight, self.bias)
        y = kernels.nf4_matmul(x, self.weight_nf4, self.weight_absmax, self.quant_shape)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged or self.disabled:
            return self.base_forward(x)
        a, b = self.lora_A.weight, self.lora_B.weight
        drop = self.dropout > 0 and self.training
        dense = self.quant_shape is None
        if self._fp8_base() and not drop:
            return fp8_linear(x, self.weight, self.bias, self.fp8_rowwise) + self.adapter_product(x)
        # (no-grad NF4 steps, e.g. decoding, keep nf4_matmul: its fused kernel reads 4-bit weights for few rows)
        fused_ok = x.dtype == self.weight.dtype if dense else torch.is_grad_enabled()
        if not drop and x.dtype == a.dtype == b.dtype and fused_ok:
            base = self.weight if dense else kernels.NF4Weight(self.weight_nf4, self.weight_absmax, self.quant_shape)
            return kernels.lora_linear(x, base, self.bias, a, b, self.scaling)  # the training case
        y = self.base_forward(x)
        h = F.dropout(x, self.dropout, self.training) if drop else x
        xa = F.linear(h.to(a.dtype), a)
        if y.dtype == a.dtype == b.dtype:  # NF4 base or dropout: the adapter's add still rides on the GEMM,
            # in place (y is the base matmul's fresh output, which its backward does not need)
            y.view(-1, y.shape[-1]).addmm_(xa.reshape(-1, a.shape[0]), b.t(), alpha=self.scaling)
            return y
        return y + F.linear(xa, b).to(y.dtype) * self.scaling  # fp32 adapters on a bf16 base (inference)

    # ---- the frozen base after a layer's checkpoint (DecoderOptions.skip_frozen_down_recompute) ---------------
    def splits_at_checkpoint(self) -> bool:
        """Whether ``forward(x)`` may run as ``base_onto(adapter_product(x), x)``: the adapter's product inside a
        layer's activation checkpoint, the frozen base GEMM after it (so the recomputed forward skips that GEMM).
        An active adapter without dropout on a frozen base (dense or NF4)."""
        if self.merged or self.disabled or (self.dropout > 0 and self.training):
            return False
        return self.quant_shape is not None or not self.weight.requires_grad

    def adapter_product(self, x: torch.Tensor) -> torch.Tensor:
        """``s * (x A^T) B^T`` in ``x``'s dtype, with autograd (the scale rides on the GEMM when dtypes agree)."""
        a, b = self.lora_A.weight, self.lora_B.weight
        x2 = x.reshape(-1, x.shape[-1])
        if x.dtype == a.dtype == b.dtype:
            y = torch.addmm(_zero(x2), x2 @ a.t(), b.t(), beta=0, alpha=self.scaling)
        else:
            y = (F.linear(F.linear(x2.to(a.dtype), a), b) * self.scaling).to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _fp8_base(self) -> bool:
        """Whether the base GEMMs run in FP8 now: switched on, dense, training."""
        return self.fp8_rowwise is not None and self.quant_shape is None and self.training

    def base_onto(self, acc: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """``acc + x W^T (+ b)`` with the frozen base, saving no activation (``lora_linear.frozen_base_onto``; an FP8
        base saves its FP8 input)."""
        if self._fp8_base():
            y = fp8_linear(x, self.weight, self.bias, self.fp8_rowwise)
            return y if acc is None else acc + y
        dense = self.quant_shape is None
        base = self.weight if dense else kernels.NF4Weight(self.weight_nf4, self.weight_absmax, self.quant_shape)
        return frozen_base_onto(acc, x, base, self.bias)

    # ---- merge ----------------------------------------------------------------------------------
    def delta(self) -> torch.Tensor:
        """``s * B @ A`` in fp32, ``[out, in]``."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    @torch.no_grad()
    def merge(self, exact: bool = False) -> None:
        """``W += s * B @ A`` in place. ``exact``: keep a copy of ``W`` (same device) so that ``unmerge`` restores
        it bit for bit (subtracting again is off by up to one ulp per element in bf16, which adds up over many
        merge/unmerge cycles)."""
        if self.quant_shape is not None:
            raise UserError("cannot merge a LoRA adapter into a 4-bit (NF4) base in place; export with --merge instead")
        if not self.merged:
            self._backup = self.weight.detach().clone() if exact else None
            self.weight.copy_(self.weight.float() + self.delta())
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            backup = getattr(self, "_backup", None)
            if backup is not None:
                self.weight.copy_(backup)
            else:
                self.weight.copy_(self.weight.float() - self.delta())
            self._backup = None
            self.merged = False

    # ---- QLoRA ----------------------------------------------------------------------------------
    @torch.no_grad()
    def quantize_nf4(self) -> None:
        """Replace the frozen base weight by its NF4 quantization (frees the full-precision weight)."""
        if self.quant_shape is not None:
            return
        if self.merged:
            raise UserError("unmerge the adapter before quantizing the base")
        packed, absmax = quantize_nf4(self.weight.detach())
        self.quant_shape = (self.out_features, self.in_features)
        del self.weight
        self.register_buffer("weight_nf4", packed)
        self.register_buffer("weight_absmax", absmax)

    @torch.no_grad()
    def base_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The frozen base weight ``[out, in]`` as a dense tensor (dequantized for NF4)."""
        if self.quant_shape is None:
            return self.weight.detach().to(dtype)
        return dequantize_nf4(self.weight_nf4, self.weight_absmax, self.quant_shape, dtype)

    def extra_repr(self) -> str:
        q = ", base=nf4" if self.quant_shape is not None else ""
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, scaling={self.scaling:g}{q}"
