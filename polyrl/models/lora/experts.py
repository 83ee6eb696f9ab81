"""``LoraExperts``: an MoE layer's frozen routed experts plus one low-rank adapter per expert and per targeted tensor,
in PEFT's layout (``LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])``).

The math, per expert ``e`` of a targeted 3-D tensor ``W [E, out, in]`` (``gate_up_proj [E, 2I, H]``: out = 2I, in =
H; ``down_proj [E, H, I]``: out = H, in = I): ``W'_e = W_e + s * B_e @ A_e`` with ``A_e [r, in]``, ``B_e [out, r]``
and the scale ``s`` of the config (``alpha / r``). The adapter is held exactly as PEFT's ``ParamWrapper`` holds
(and saves) it, so save and load are plain copies:

- ``lora_A[name]``: ``[E * r, in]``, expert-major: ``A_e = lora_A.view(E, r, in)[e]``;
- ``lora_B[name]``: ``[out, E * r]``, rank-major: ``B_e = lora_B.view(out, r, E)[:, :, e]``.

Init as PEFT: ``A ~ U(-1/sqrt(in), 1/sqrt(in))``, ``B = 0`` (a fresh adapter changes nothing). The base tensors stay
the very ``Parameter`` objects of the ``Experts`` module this replaces (``mlp.experts.gate_up_proj`` keeps its name).

Forward over a frozen dense base: ``kernels.moe_experts_lora`` with the base and the factors apart; the registry's
``materialized`` implementation (the default) builds ``W' = baddbmm(W, B, A, alpha=s)`` and runs ``moe_experts``
on it (autograd reaches ``A`` and ``B`` through the ``baddbmm``; per MoE layer and forward one temporary the size
of each targeted tensor, and in backward the op's full weight gradient of the same size: at Qwen3-30B-A3B's shape
403M + 201M elements per layer, 1.2 GB in bf16), while its ``triton`` implementation adds ``s * (x_e A_e^T) B_e^T``
inside the grouped GEMMs on each expert's routed rows (no ``[E, out, in]`` temporaries, no base weight gradient;
docs/models.md). A merged or disabled adapter, or a base that requires grad, runs ``moe_experts`` on
``adapted(...)``.

PEFT refuses dropout on a parameter adapter (it cannot be factored out of ``W'``), and so does ``LoraConfig``.
Merging adds ``s * B_e @ A_e`` into ``W`` in place, one expert at a time in fp32 (no fp32 copy of the whole tensor);
``merge(exact=True)`` keeps a backup for a bit-exact unmerge. Under QLoRA (``quantize_nf4()``) the base tensors
become NF4 buffers (``gate_up_proj_nf4`` / ``gate_up_proj_absmax``, ... : ``nf4_experts.py``), dequantized just in
time to the input's dtype each forward (only the routed slots' experts when ``T * k < E``), the adapter added on
top in that dtype; such a base cannot be merged in place (as a dense NF4 layer), ``merged_weight`` / ``to_experts``
/ ``merged_state_dict`` dequantize.
Not here: choosing the layers (``apply.py``), file names (``peft_io.py``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from polyrl import kernels
from polyrl.errors import UserError
from polyrl.models.lora.nf4_experts import dequantize_experts, quantize_experts, run_nf4_experts
from polyrl.models.moe import Experts

# the tensors of ``Experts`` in registration order: PEFT nests one ParamWrapper per targeted tensor in this order
# (the first targeted innermost), which decides the saved names (see ``peft_names``)
EXPERT_TENSORS = ("gate_up_proj", "down_proj")


class LoraExperts(nn.Module):
    def __init__(self, base: Experts, targets: list[str] | tuple[str, ...], r: int, scaling: float) -> None:
        super().__init__()
        bad = [t for t in targets if t not in EXPERT_TENSORS]
        if bad or not targets:
            raise UserError(f"LoraExperts targets must be some of {EXPERT_TENSORS}, got {list(targets)}")
        self.gate_up_proj = base.gate_up_proj  # the same Parameters: HF names and identity kept
        self.down_proj = base.down_proj
        self.num_experts = base.gate_up_proj.shape[0]
        self.targets = tuple(t for t in EXPERT_TENSORS if t in targets)
        self.r, self.scaling, self.dropout = r, float(scaling), 0.0
        self.merged = False
        self.disabled = False
        self.quant_shape: dict[str, tuple[int, int, int]] | None = None  # name -> [E, out, in] when the base is NF4
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        dev = base.gate_up_proj.device
        for name in self.targets:
            e, out_f, in_f = self.shape(name)
            self.lora_A[name] = nn.Parameter(torch.zeros(e * r, in_f, device=dev, dtype=torch.float32))
            self.lora_B[name] = nn.Parameter(torch.zeros(out_f, e * r, device=dev, dtype=torch.float32))
        self._backup: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """PEFT's init: A ~ kaiming_uniform(a=sqrt(5)) (= U(-1/sqrt(in), 1/sqrt(in))), B = 0."""
        for name in self.targets:
            a = self.lora_A[name]
            bound = 1.0 / math.sqrt(a.shape[1])
            a.uniform_(-bound, bound, generator=generator)
            self.lora_B[name].zero_()

    def peft_names(self) -> dict[str, str]:
        """Tensor -> its adapter's name prefix inside this module as PEFT saves it: the last targeted tensor's
        wrapper is outermost (``lora_A``), each earlier one sits one ``base_layer.`` deeper."""
        k = len(self.targets)
        return {name: "base_layer." * (k - 1 - i) for i, name in enumerate(self.targets)}

    def factors(self, name: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(``B [E, out, r]``, ``A [E, r, in]``) of tensor ``name`` in ``dtype`` (views of the PEFT layout, with
        autograd)."""
        e = self.num_experts
        a, b = self.lora_A[name], self.lora_B[name]
        a3 = a.view(e, self.r, a.shape[1])
        b3 = b.view(b.shape[0], self.r, e).permute(2, 0, 1)
        return b3.to(dtype), a3.to(dtype)

    def shape(self, name: str) -> tuple[int, int, int]:
        """``[E, out, in]`` of base tensor ``name`` (dense or NF4)."""
        return self.quant_shape[name] if self.quant_shape is not None else tuple(getattr(self, name).shape)

    def base_tensor(self, name: str, dtype: torch.dtype, experts: torch.Tensor | None = None) -> torch.Tensor:
        """The frozen base ``[E', out, in]``: the Parameter itself (dense), or the NF4 base dequantized to ``dtype``
        (every expert, or those in ``experts``)."""
        if self.quant_shape is None:
            return getattr(self, name)
        packed, absmax = getattr(self, f"{name}_nf4"), getattr(self, f"{name}_absmax")
        return dequantize_experts(packed, absmax, self.quant_shape[name], dtype, experts)

    def adapted(self, name: str, dtype: torch.dtype | None = None, experts: torch.Tensor | None = None) -> torch.Tensor:
        """``W + s * B @ A`` for every expert (``[E, out, in]``, the base's dtype; differentiable in A and B). An NF4
        base is dequantized to ``dtype`` (only the experts in ``experts``, if given)."""
        w = self.base_tensor(name, dtype, experts)
        if name not in self.lora_A or self.merged or self.disabled:
            return w
        b, a = self.factors(name, w.dtype)
        if experts is not None:
            b, a = b[experts], a[experts]
        return torch.baddbmm(w, b, a, alpha=self.scaling)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.quant_shape is not None:
            return run_nf4_experts(self, x, ids, weights)
        gu, dn = self.gate_up_proj, self.down_proj
        if self.merged or self.disabled or gu.requires_grad or dn.requires_grad:  # the base as it is (or trained)
            return kernels.moe_experts(x, ids, weights, self.adapted("gate_up_proj"), self.adapted("down_proj"))
        # the adapters apart from the frozen base: the op decides whether W' is built (kernels.moe_experts_lora)
        factors = [f for name in EXPERT_TENSORS for f in self._op_factors(name, gu.dtype)]
        return kernels.moe_experts_lora(x, ids, weights, gu, dn, *factors, self.scaling)

    def _op_factors(
        self, name: str, dtype: torch.dtype, experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(``A [E, r, in]``, ``B [E, out, r]``) of tensor ``name`` for ``moe_experts_lora`` (the experts in
        ``experts``, if given; (None, None): no adapter there)."""
        if name not in self.lora_A:
            return None, None
        e, lora_a, lora_b = self.num_experts, self.lora_A[name], self.lora_B[name]
        a = lora_a.view(e, self.r, lora_a.shape[1]).to(dtype)
        # B's PEFT layout is rank-major ([out, r * E]): its [E, out, r] view is permuted; one contiguous copy (the
        # cast's) so the grouped GEMMs read each expert's B_e in rows, not one element per E
        b = lora_b.view(lora_b.shape[0], self.r, e).permute(2, 0, 1).to(dtype, memory_format=torch.contiguous_format)
        if experts is not None:
            b, a = b[experts], a[experts]
        return a, b

    def expert_weights(
        self, dtype: torch.dtype, experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both adapted tensors of an NF4 base, dequantized to ``dtype`` (the experts in ``experts``, if given)."""
        return self.adapted("gate_up_proj", dtype, experts), self.adapted("down_proj", dtype, experts)

    def run_dequantized(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor | None
    ) -> torch.Tensor:
        """An NF4 base's experts (those in ``experts``, if given; ``ids`` index them) dequantized to x's dtype, the
        adapters apart through ``kernels.moe_experts_lora`` (disabled: the base alone)."""
        gu, dn = (self.base_tensor(name, x.dtype, experts) for name in EXPERT_TENSORS)
        if self.disabled:
            return kernels.moe_experts(x, ids, weights, gu, dn)
        factors = [f for name in EXPERT_TENSORS for f in self._op_factors(name, x.dtype, experts)]
        return kernels.moe_experts_lora(x, ids, weights, gu, dn, *factors, self.scaling)

    def adapter_tensors(self) -> list[torch.Tensor]:
        """The adapter Parameters, in a fixed order (what backward of an NF4 base returns gradients for)."""
        return [t for name in self.targets for t in (self.lora_A[name], self.lora_B[name])]

    # ---- merge ----------------------------------------------------------------------------------
    def delta(self, name: str, expert: int | None = None) -> torch.Tensor:
        """``s * B_e @ A_e`` in fp32: ``[E, out, in]``, or ``[out, in]`` of one ``expert``."""
        b, a = self.factors(name, torch.float32)
        if expert is not None:
            return (b[expert] @ a[expert]) * self.scaling
        return torch.bmm(b, a) * self.scaling

    @torch.no_grad()
    def merge(self, exact: bool = False) -> None:
        """``W_e += s * B_e @ A_e`` in place, expert by expert (fp32 arithmetic, one rounding to W's dtype).
        ``exact``: keep a copy of each targeted tensor for a bit-exact ``unmerge``."""
        if self.quant_shape is not None:
            raise UserError(
                "cannot merge LoRA adapters into 4-bit (NF4) routed experts in place; export with --merge instead"
            )
        if self.merged:
            return
        for name in self.targets:
            w = getattr(self, name)
            if exact:
                self._backup[name] = w.detach().clone()
            for e in range(self.num_experts):
                w[e].copy_(w[e].float() + self.delta(name, e))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        for name in self.targets:
            w = getattr(self, name)
            backup = self._backup.pop(name, None)
            if backup is not None:
                w.copy_(backup)
                continue
            for e in range(self.num_experts):
                w[e].copy_(w[e].float() - self.delta(name, e))
        self.merged = False

    @torch.no_grad()
    def merged_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Base + adapter of tensor ``name`` (a new tensor in ``dtype`` or W's dtype; W is not changed)."""
        if self.quant_shape is not None:  # NF4: dequantized in fp32, the adapter added, one rounding
            dtype = dtype or torch.bfloat16
            w = self.base_tensor(name, torch.float32)
            if name in self.lora_A:
                w = w + self.delta(name)
            return w.to(dtype)
        w = getattr(self, name)
        dtype = dtype or w.dtype
        if self.merged or name not in self.lora_A:
            return w.detach().to(dtype, copy=True)
        out = torch.empty(w.shape, dtype=dtype, device=w.device)
        for e in range(self.num_experts):
            out[e] = w[e].float() + self.delta(name, e)
        return out

    @torch.no_grad()
    def to_experts(self, merge: bool = True) -> Experts:
        """A plain ``Experts`` with this module's tensors (the adapter merged in when ``merge``)."""
        if not merge and self.merged:
            raise UserError("unmerge the expert adapters before unwrapping them without merging")
        with torch.device("meta"):
            plain = Experts(*self.shape("down_proj"))  # [E, H, I]
        for name in EXPERT_TENSORS:
            if self.quant_shape is not None:
                w = self.merged_weight(name) if merge else self.base_tensor(name, torch.bfloat16).detach()
            else:
                w = self.merged_weight(name) if merge else getattr(self, name).detach()
            setattr(plain, name, nn.Parameter(w, requires_grad=False))
        return plain

    # ---- QLoRA ----------------------------------------------------------------------------------
    @torch.no_grad()
    def quantize_nf4(self) -> None:
        """Replace both frozen base tensors by their NF4 quantization (frees the full-precision tensors)."""
        if self.quant_shape is not None:
            return
        if self.merged:
            raise UserError("unmerge the expert adapters before quantizing the base")
        shapes = {}
        for name in EXPERT_TENSORS:
            w = getattr(self, name)
            packed, absmax = quantize_experts(w.detach())
            shapes[name] = tuple(w.shape)
            delattr(self, name)
            self.register_buffer(f"{name}_nf4", packed)
            self.register_buffer(f"{name}_absmax", absmax)
        self.quant_shape = shapes

    def extra_repr(self) -> str:
        e, h, i = self.shape("down_proj")
        q = ", base=nf4" if self.quant_shape is not None else ""
        return (
            f"experts={e}, hidden={h}, inter={i}, targets={list(self.targets)}, r={self.r}, scaling={self.scaling:g}{q}"
        )
