"""Where the memory of an MoE SFT step goes: polyrl's engine vs HF transformers (+ Liger), accounted on the CPU.

``bench sft --shape qwen3-30b-a3b-L8 --seq 4096 --batch 4 --baselines hf-liger --numerics bf16 --master-dtype none``
on the H200 measures peaks; this script explains them without a device. It runs one training step of a scaled-down
Qwen3-MoE (the preset's per-layer structure: top-8 of 128 experts, 8:1 query:kv heads, q width 2H, kv width H/4,
expert width 0.375H; 2 layers of H = 192 on 3 x 20 tokens by default) in bf16 and records:

- every tensor autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``): shape, dtype, bytes of
  its storage (each storage counted once, parameters left out: they are static), the module that saved it (forward
  hooks keep a module stack) and the source line that saved it;
- tensors a custom ``autograd.Function`` keeps on its ctx instead of ``save_for_backward`` (polyrl's fused
  linear-cross-entropy keeps its gradients, the MoE experts their routing): found by walking each new autograd node's
  attributes after every module's forward and after the loss;
- the order in which backward releases saved tensors (a storage is counted free after the last unpack of its last
  saver: autograd drops a node's saved tensors once the node ran) and allocates parameter gradients
  (post-accumulate-grad hooks).

What it cannot see: temporaries that never reach autograd (a kernel's scratch buffers, the activations' gradients
flowing between nodes, allocator fragmentation and caching). The experts' backward working set and the loss's
logits chunk are therefore modelled from the kernels' code (``polyrl/kernels/moe/triton.py``, Liger's fused MoE and
FLCE) and listed separately; the fused AdamW step is assumed to allocate nothing large (moments exist from the
bench's warm-up on).

polyrl's step runs as ``bench/sft.py`` builds it (``TrainEngine`` with ``optim.master_dtype = "none"``, bf16 compute,
the kernels the device would select: Triton rmsnorm / rope / linear-cross-entropy run by Triton's interpreter, the
Triton moe_experts Function with its launches done in torch; attention goes to per-sequence SDPA on the CPU (the
Triton wrapper's CPU fallback), which saves what the device's cuDNN SDPA saves: q, k, v, out, fp32 log-sum-exp).
HF's is ``Qwen3MoeForCausalLM`` with ``experts_implementation="grouped_mm"``, sdpa attention, pure bf16. Liger is
applied when ``liger_kernel`` imports; otherwise the HF+Liger column is modelled from what Liger's patched modules
save (fused MoE: x and the pre-activation ``[T*k, 2I]``; RMSNorm: input and fp32 rstd; FLCE: bf16 grad_input and
grad_weight from the forward) and says so.

Each recorded tensor is scaled to the real shape dimension by dimension: every dimension of the small model has a
distinct size (tokens, routed rows, H, q width, ...) that maps to its real size; a dimension that maps to nothing is
kept as is and counted in ``unscaled``. Prints per-layer saved bytes by kind, the predicted peak and where it occurs.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/moe_memory_account.py [--layers 8] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton: run the device kernels on the CPU

import argparse
import json
import traceback
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

GIB = 1024**3
KINDS = ("attention", "router", "experts", "norms", "embed", "head/loss", "other")

# real and small dimensions: Qwen3-30B-A3B (its first 8 layers) at 4 x 4096 tokens, and the CPU stand-in
REAL = dict(B=4, S=4096, H=2048, Hq=32, Hk=4, D=128, I=768, E=128, k=8, V=151936)
SMALL = dict(B=3, S=20, H=192, Hq=16, Hk=2, D=24, I=72, E=128, k=8, V=1000)


def dim_table(d: dict[str, int]) -> dict[str, int]:
    """Every size a tensor of the step can have, by name."""
    t = d["B"] * d["S"]
    return {
        "T": t, "Tk": t * d["k"], "H": d["H"], "q": d["Hq"] * d["D"], "kv": d["Hk"] * d["D"], "D": d["D"],
        "Hq": d["Hq"], "Hk": d["Hk"], "I": d["I"], "2I": 2 * d["I"], "E": d["E"], "E+1": d["E"] + 1, "k": d["k"],
        "V": d["V"], "B": d["B"], "S": d["S"], "B+1": d["B"] + 1, "3I": 3 * d["I"], "T*Hq": t * d["Hq"],
        "T*Hk": t * d["Hk"],
    }  # fmt: skip


def size_map(small: dict[str, int], real: dict[str, int]) -> dict[int, int]:
    """small size -> real size; refuses a small shape whose sizes are not all distinct (the map would be ambiguous)."""
    s, r = dim_table(small), dim_table(real)
    out: dict[int, int] = {}
    for name, v in s.items():
        if v in out and out[v] != r[name]:
            raise ValueError(f"small dimension {name}={v} collides with another of the same size; pick other sizes")
        out[v] = r[name]
    return out


@dataclass
class Scaler:
    sizes: dict[int, int]
    unscaled: set[tuple[int, ...]] = field(default_factory=set)

    def __call__(self, shape: tuple[int, ...], nbytes: int) -> float:
        """``nbytes`` of a tensor of ``shape`` at the small size -> bytes at the real size (per-dimension factors)."""
        f = 1.0
        for n in shape:
            if n <= 1:
                continue
            if n not in self.sizes:
                self.unscaled.add(tuple(shape))
                continue
            f *= self.sizes[n] / n
        return nbytes * f


@dataclass
class Saved:
    kind: str
    layer: int | None
    module: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    real: float
    where: str
    via: str = "save_for_backward"


def kind_of(module: str) -> tuple[str, int | None]:
    """(kind, layer) of a qualified module name (polyrl's and HF's names are the same up to the loss)."""
    parts = module.split(".")
    layer = None
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            layer = int(parts[i + 1])
    if "experts" in parts:
        return "experts", layer
    if "self_attn" in parts:
        return "attention", layer
    if "mlp" in parts:  # the block itself (routing math) or its gate
        return "router", layer
    if any(p.endswith("layernorm") for p in parts) or parts[-1] == "norm":
        return ("norms" if layer is not None else "head/loss"), layer  # the final norm goes with the head
    if "embed_tokens" in parts:
        return "embed", layer
    return "head/loss", layer  # outside the decoder layers: LM head and loss


def _frame() -> str:
    """The innermost source line in polyrl or transformers (not this script, not torch) that is saving a tensor."""
    for fr in reversed(traceback.extract_stack(limit=40)):
        name = fr.filename
        if ("polyrl" in name or "transformers" in name or "liger" in name) and "moe_memory_account" not in name:
            return f"{os.path.basename(name)}:{fr.lineno} {fr.name}"
    return "?"


def _tensors_in(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """Tensors reachable from ``obj`` through attributes, dicts, lists and tuples (3 levels)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth >= 3:
        return []
    if isinstance(obj, dict):
        vals = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        vals = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
        vals = list(vars(obj).values())
    else:
        return []
    return [t for v in vals for t in _tensors_in(v, depth + 1)]


class Recorder:
    """Records saved tensors, ctx-held tensors, their release in backward and the parameter gradients' allocation,
    as a timeline of events ``(phase, what, kind, layer, +/- real bytes)``."""

    def __init__(self, model: nn.Module, scale: Scaler) -> None:
        self.model, self.scale = model, scale
        self.stack: list[str] = []
        self.saved: dict[int, Saved] = {}  # storage pointer -> record
        self.packs: dict[int, int] = defaultdict(int)  # storage pointer -> saved references not yet unpacked
        self.events: list[tuple[str, str, str, int | None, float]] = []
        self.phase = "forward"
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen_nodes: set[int] = set()
        self.ctx_ptrs: set[int] = set()
        self.names = {m: n for n, m in model.named_modules()}
        self._handles = []
        for m in model.modules():
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))
        for n, p in model.named_parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(n)))
        self._granted: set[str] = set()

    # -- modules
    def _pre(self, module, args):
        self.stack.append(self.names.get(module, "?"))

    def _post(self, module, args, out):
        name = self.stack.pop() if self.stack else "?"
        if torch.is_grad_enabled():
            self.collect_ctx(out, name)

    def current(self) -> str:
        return self.stack[-1] if self.stack else "(loss)"

    # -- saved tensors
    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.param_ptrs or t.untyped_storage().nbytes() == 0:
            return (t, None)
        if self.phase != "forward":
            return (t, None)
        self.packs[ptr] += 1
        if ptr not in self.saved:
            base = t._base if t._base is not None else t
            nbytes = t.untyped_storage().nbytes()
            kind, layer = kind_of(self.current())
            rec = Saved(kind, layer, self.current(), tuple(base.shape), str(t.dtype).replace("torch.", ""), nbytes,
                        self.scale(tuple(base.shape), nbytes), _frame())  # fmt: skip
            self.saved[ptr] = rec
            self.events.append(("forward", f"save {rec.module} {list(rec.shape)}", kind, layer, rec.real))
        return (t, ptr)

    def unpack(self, packed):
        t, ptr = packed
        if ptr is not None and self.phase == "backward" and ptr in self.packs:
            self.packs[ptr] -= 1
            if self.packs[ptr] == 0:
                rec = self.saved[ptr]
                del self.packs[ptr]
                self.events.append(("backward", f"free {rec.module} {list(rec.shape)}", rec.kind, rec.layer, -rec.real))
        return t

    def collect_ctx(self, out: Any, module: str) -> None:
        """Tensors held on the ctx of autograd nodes created since the last call (custom Functions' attributes)."""
        roots = [o.grad_fn for o in _tensors_in(out) if o.grad_fn is not None]
        todo = list(roots)
        while todo:
            node = todo.pop()
            if node is None or id(node) in self.seen_nodes:
                continue
            self.seen_nodes.add(id(node))
            todo.extend(nxt for nxt, _ in node.next_functions)
            held = _tensors_in(vars(node)) if hasattr(node, "__dict__") else []
            for t in held:
                ptr = t.untyped_storage().data_ptr()
                if ptr in self.param_ptrs or ptr in self.saved or t.untyped_storage().nbytes() == 0:
                    continue
                kind, layer = kind_of(module)
                base = t._base if t._base is not None else t
                nbytes = t.untyped_storage().nbytes()
                real = self.scale(tuple(base.shape), nbytes)
                if type(node).__name__ == "_LinearCrossEntropyBackward" and base.dim() == 2 and real > 2**30 / 2:
                    real = lce_accumulator_bytes(real)
                rec = Saved(kind, layer, module, tuple(base.shape), str(t.dtype).replace("torch.", ""), nbytes, real,
                            type(node).__name__, via="ctx attribute")  # fmt: skip
                self.saved[ptr] = rec
                self.ctx_ptrs.add(ptr)
                self.events.append(("forward", f"ctx {type(node).__name__} {list(rec.shape)}", kind, layer, rec.real))

    # -- gradients
    def _grad_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            if name in self._granted or p.grad is None:
                return
            self._granted.add(name)
            kind, layer = kind_of(name.rsplit(".", 1)[0])
            real = self.scale(tuple(p.shape), p.grad.numel() * p.grad.element_size())
            self.events.append(("backward", f"grad {name}", kind, layer, real))

        return hook

    def end_backward(self) -> None:
        """Saved tensors never unpacked and ctx-held ones are released with the graph at the end of backward."""
        for ptr in list(self.packs):
            rec = self.saved[ptr]
            self.events.append(("backward", f"free (graph end) {rec.module}", rec.kind, rec.layer, -rec.real))
        for ptr in self.ctx_ptrs:
            rec = self.saved[ptr]
            self.events.append(("backward", f"free ctx {rec.where}", rec.kind, rec.layer, -rec.real))
        self.packs.clear()

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def lce_accumulator_bytes(real_bf16: float, real: dict[str, int] = REAL) -> float:
    """polyrl's linear-cross-entropy keeps its [V, H] weight-gradient sum from the forward: in the weight's dtype when
    the tokens fit one logits chunk (the small run), in fp32 when they take several (``token_logprobs.triton``:
    ``GradWeightAccumulator``) - the real shape's 16384 tokens take 5 chunks of 1 GiB."""
    from polyrl.kernels.token_logprobs import triton as tlp

    t = real["B"] * real["S"]
    rows = tlp.chunk_rows(t, real["V"], 2, tlp.CHUNK_BYTES)
    return real_bf16 * (2 if rows < t else 1)


# --- the two steps ------------------------------------------------------------------------------------------------


def small_config(layers: int, small: dict[str, int] = SMALL):
    """polyrl's ModelConfig: qwen3-30b-a3b's preset with the small sizes and ``layers`` layers."""
    from polyrl.models.config import ModelConfig
    from polyrl.models.presets import get_preset

    hf = dict(get_preset("qwen3-30b-a3b").hf)
    hf.update(
        hidden_size=small["H"], num_attention_heads=small["Hq"], num_key_value_heads=small["Hk"], head_dim=small["D"],
        moe_intermediate_size=small["I"], intermediate_size=3 * small["I"], num_experts=small["E"],
        num_experts_per_tok=small["k"], vocab_size=small["V"], num_hidden_layers=layers, bos_token_id=None,
        eos_token_id=0, pad_token_id=1,
    )  # fmt: skip
    return ModelConfig.from_hf_dict(hf)


@contextmanager
def _device_kernels():
    """Make ``polyrl.kernels`` pick the implementations the H200 runs (Triton; cuDNN attention -> Triton's, which
    saves the same tensors), interpreted on the CPU."""
    from polyrl.kernels import ops, registry

    device_impl = {"rmsnorm": "triton", "rope": "triton", "attention": "triton", "linear_cross_entropy": "triton",
                   "moe_experts": "triton", "swiglu": "triton"}  # fmt: skip
    original = ops._impl

    def impl(op: str, t: torch.Tensor):
        name = device_impl.get(op)
        return registry.load(op, name) if name is not None else original(op, t)

    # the globals of the module the registry loaded moe_experts from (a test run may have re-imported the module since)
    mt = registry.load("moe_experts", "triton").__globals__
    names = ("_rows_gemm", "_wgrad_gemm", "_combine")
    saved = {n: mt[n] for n in names}
    ops._impl = impl
    mt.update(_moe_launches_in_torch())
    try:
        yield
    finally:  # leave the process as it was (a test runs this next to others)
        ops._impl = original
        mt.update(saved)


def _moe_launches_in_torch() -> dict[str, Any]:
    """Torch stand-ins for the Triton MoE module's kernel launches (``_rows_gemm``, ``_wgrad_gemm``, ``_combine``),
    writing the same output buffers, so that its autograd Function (what it saves and keeps: the thing measured)
    runs as on the device, at CPU speed (its 128 experts' grids take minutes in Triton's interpreter)."""
    import torch.nn.functional as F

    def bmat(b, strides, k, n, offset=0):
        return b.as_strided((b.shape[0], k, n), strides, b.storage_offset() + offset)

    def ranges(route):
        off = route.offsets.tolist()
        return [(e, off[e], off[e + 1]) for e in range(route.num_experts) if off[e + 1] > off[e]]

    def rows_gemm(route, a, a_idx, b, b_strides, n, k, out, *, cfg, epi=0, h=None, store_h=False, b_up=0,
                  w_rows=None, wact=None, need_dw=False):  # fmt: skip
        rows = a[a_idx.long()] if a_idx is not None else a
        dw = torch.zeros(route.n, 1, dtype=torch.float32) if need_dw else None
        for e, s, t in ranges(route):
            acc = rows[s:t].float() @ bmat(b, b_strides, k, n)[e].float()
            if epi == 0:
                out[s:t] = acc.to(out.dtype)
            elif epi == 1:
                u = (rows[s:t].float() @ bmat(b, b_strides, k, n, b_up)[e].float()).to(out.dtype)
                g = acc.to(out.dtype)
                if store_h:
                    h[s:t, :n], h[s:t, n:] = g, u
                out[s:t] = (F.silu(g.float()) * u.float()).to(out.dtype)
            else:
                g, u = h[s:t, :n].float(), h[s:t, n:].float()
                act = (F.silu(g) * u).to(out.dtype).float()
                if need_dw:
                    dw[s:t, 0] = (act * acc).sum(1)
                w = w_rows[s:t].float()[:, None]
                wact[s:t] = (act * w).to(wact.dtype)
                acc = acc * w
                sig = torch.sigmoid(g)
                out[s:t, :n] = (acc * u * sig * (1 + g * (1 - sig))).to(out.dtype)
                out[s:t, n:] = (acc * g * sig).to(out.dtype)
        return dw

    def wgrad_gemm(route, a, b, b_idx, m, n, out):
        out.zero_()
        brows = b[b_idx.long()] if b_idx is not None else b
        for e, s, t in ranges(route):
            out[e] = (a[s:t].float().t() @ brows[s:t].float()).to(out.dtype)

    def combine(y, route, w, t, h, dtype):
        rows = y[route.pos].float().view(t, route.k, h)
        if w is not None:
            rows = rows * w.float().view(t, route.k, 1)
        return rows.sum(1).to(dtype)

    return {"_rows_gemm": rows_gemm, "_wgrad_gemm": wgrad_gemm, "_combine": combine}


def polyrl_step(cfg, tokens: torch.Tensor, scale: Scaler, seed: int = 0) -> Recorder:
    """One ``TrainEngine.step`` as bench sft builds it for ``--numerics bf16 --master-dtype none``."""
    from polyrl.data import TokenizedSeq, pack_sequences
    from polyrl.models.decoder import build_model
    from polyrl.train import OptimConfig, PrecisionConfig, ScheduleConfig, StepConfig, TrainEngine

    with _device_kernels():
        model = build_model(cfg, dtype=torch.float32, seed=seed)
        engine = TrainEngine(
            model,
            OptimConfig(lr=1e-5, master_dtype="none"),
            ScheduleConfig(decay="constant"),
            PrecisionConfig(compute_dtype="bf16"),
            engine=StepConfig(micro_batch_tokens=tokens.numel(), seed=seed),
            total_steps=None,
        )
        batch = pack_sequences([TokenizedSeq(r.tolist(), [1] * r.numel()) for r in tokens])
        rec = Recorder(model, scale)
        real_backward = torch.Tensor.backward

        def backward(self, *a, **kw):  # the engine's (loss * scale).backward(): the forward is over, the loss exists
            rec.collect_ctx(self, "(loss)")
            rec.phase = "backward"
            real_backward(self, *a, **kw)
            rec.end_backward()
            rec.phase = "optimizer"

        torch.Tensor.backward = backward
        try:
            with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
                engine.step([batch])
        finally:
            torch.Tensor.backward = real_backward
            rec.close()
    return rec


def hf_step(cfg, tokens: torch.Tensor, scale: Scaler, seed: int = 0) -> tuple[Recorder, str]:
    """One pure-bf16 step of transformers' Qwen3MoeForCausalLM (grouped_mm experts, sdpa), Liger applied when it
    imports; returns the recorder and the Liger status."""
    import transformers

    from polyrl.models.decoder import build_model

    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    model = transformers.AutoModelForCausalLM.from_config(
        hf_cfg, attn_implementation="sdpa", experts_implementation="grouped_mm"
    )
    model.load_state_dict(build_model(cfg, dtype=torch.float32, seed=seed).state_dict(), strict=False)
    try:
        import liger_kernel.transformers as liger

        liger.apply_liger_kernel_to_qwen3_moe(model=model)
        status = "liger applied"
    except Exception as exc:  # noqa: BLE001 - any import failure means "model it"
        status = f"liger_kernel not importable ({type(exc).__name__}): HF+Liger modelled"
    model = model.to(torch.bfloat16).train()
    rec = Recorder(model, scale)
    with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
        loss = model(input_ids=tokens, labels=tokens).loss
        rec.collect_ctx(loss, "(loss)")
    rec.phase = "backward"
    loss.backward()
    rec.end_backward()
    rec.close()
    return rec, status


# --- at the real shape --------------------------------------------------------------------------------------------


def per_layer_kinds(rec: Recorder) -> dict[str, float]:
    """Real-shape saved bytes of one decoder layer (the mean over layers) by kind, plus the unlayered kinds whole."""
    layers = {r.layer for r in rec.saved.values() if r.layer is not None}
    out: dict[str, float] = defaultdict(float)
    for r in rec.saved.values():
        out[r.kind] += r.real / (len(layers) if r.layer is not None and layers else 1)
    return dict(out)


def static_bytes(real: dict[str, int], layers: int) -> dict[str, float]:
    """bf16 weights, gradients and the two AdamW moments of qwen3-30b-a3b's first ``layers`` layers (untied head)."""
    h, q, kv, i, e, v = real["H"], real["Hq"] * real["D"], real["Hk"] * real["D"], real["I"], real["E"], real["V"]
    per_layer = h * (q + 2 * kv) + q * h + 2 * real["D"] + 2 * h + h * e + 3 * e * i * h
    params = layers * per_layer + 2 * v * h + h
    return {"params": params, "weights": 2.0 * params, "grads": 2.0 * params, "moments": 4.0 * params}


def _layer_grad(real: dict[str, int]) -> float:
    """bf16 gradient bytes of one decoder layer."""
    return static_bytes(real, 1)["grads"] - static_bytes(real, 0)["grads"]


def expert_backward_transients(real: dict[str, int], which: str) -> float:
    """Largest set of the experts' backward temporaries alive at once (bytes, real shape), from the kernels' code.
    Parameter gradients are not included (the timeline counts them)."""
    tk, h, i = real["B"] * real["S"] * real["k"], real["H"], real["I"]
    t = real["B"] * real["S"]
    dy = 2 * t * h  # the incoming gradient of the layer's output
    if which == "polyrl":  # dy_rows [Tk,H], dh [Tk,2I], wact [Tk,I] (+ dw partials), then dh + dx_rows [Tk,H]
        return dy + max(2 * tk * (h + 2 * i + i) + 4 * tk * 6, 2 * tk * (2 * i + h))
    if which == "polyrl-before":  # dys [Tk,H] + dw [Tk] live to the end, dh [Tk,2I], then dx_rows [Tk,H]
        return dy + 2 * tk * (h + 2 * i + h)
    if which == "liger":  # d_pre_act [Tk,2I], weighted_act [Tk,I], dS, dx_expanded [Tk,H] all live together
        return dy + 2 * tk * (2 * i + i + h) + 2 * tk
    raise ValueError(which)


def liger_model(hf: Recorder, real: dict[str, int]) -> dict[str, float]:
    """HF+Liger's per-layer saved bytes by kind: HF's measured attention and router, with the experts, the patched
    norms and the loss replaced by what Liger's Functions keep."""
    t, h, tk, i, v = real["B"] * real["S"], real["H"], real["B"] * real["S"] * real["k"], real["I"], real["V"]
    out = per_layer_kinds(hf)
    # LigerFusedMoEFunction: x (the norm output, already counted by the router's linear), pre_act [Tk,2I] bf16,
    # topk weights [Tk], int32 routing indices (expert starts, gather/scatter/reverse-scatter idx, tiles)
    out["experts"] = 2 * tk * 2 * i + 2 * tk + 4 * tk * 3 + 4 * (real["E"] + 1)
    # LigerRMSNorm on input/post-attention norms: input bf16 [T,H] + rstd fp32 [T] each (q/k norms stay HF's)
    out["norms"] = 2 * (2 * t * h + 4 * t)
    # LigerFusedLinearCrossEntropy: grad_input [T,H] and grad_weight [V,H] in bf16, computed in the forward;
    # final norm as above
    out["head/loss"] = 2 * t * h + 2 * v * h + 2 * t * h + 4 * t
    out.pop("embed", None)
    return out


def timeline_peak(rec: Recorder, static: float, transient_by_layer: float) -> tuple[float, str, list[tuple]]:
    """Walk the events at the real shape: static (weights + moments) + live saved tensors + gradients so far, plus the
    experts' backward working set while a layer's experts run backward (entered at the first free of an expert
    tensor of that layer). Returns (peak bytes, where, [(event, live bytes)])."""
    live, peak, where, curve = static, static, "start", []
    in_experts: set[int | None] = set()
    for phase, what, kind, layer, delta in rec.events:
        extra = 0.0
        if phase == "backward" and kind == "experts" and delta < 0 and layer not in in_experts:
            in_experts.add(layer)
            extra = transient_by_layer  # the working set exists while the experts' backward runs
        live += delta
        now = live + extra
        curve.append((f"{phase}: {what}", now))
        if now > peak:
            peak, where = now, f"{phase}: {what}"
    return peak, where, curve


def with_expert_extra(rec: Recorder, extra: float) -> Recorder:
    """``rec``'s events with ``extra`` more bytes saved per layer by the experts (from their first save to their
    first release in backward): the kernel before commit 808574c, which also kept act [T*k, I] and y [T*k, H]."""
    out = Recorder.__new__(Recorder)
    out.events, added, freed = [], set(), set()
    for e in rec.events:
        phase, what, kind, layer, delta = e
        if kind == "experts" and phase == "backward" and delta < 0 and layer in added and layer not in freed:
            freed.add(layer)
            out.events.append((phase, "free act, y (before 808574c)", kind, layer, -extra))
        out.events.append(e)
        if kind == "experts" and phase == "forward" and layer not in added:
            added.add(layer)
            out.events.append((phase, "save act, y (before 808574c)", kind, layer, extra))
    return out


def lce_state_freed_early(rec: Recorder) -> Recorder:
    """``rec``'s events with the linear-cross-entropy's ctx state (its gradients computed in the forward) released
    right after the LM head's gradient exists instead of with the graph at the end of backward: what freeing
    ``ctx.acc`` / ``ctx.grad_h`` in its backward (when the graph is not retained) would give."""
    out = Recorder.__new__(Recorder)
    lce = [e for e in rec.events if e[0] == "backward" and "_LinearCrossEntropyBackward" in e[1] and e[4] < 0]
    rest = [e for e in rec.events if e not in lce]
    at = next((i for i, e in enumerate(rest) if e[1].startswith("grad lm_head")), None)
    out.events = rest if at is None else rest[: at + 1] + lce + rest[at + 1 :]
    return out


def loss_forward_transient(real: dict[str, int] = REAL) -> float:
    """polyrl's linear-cross-entropy forward: one logits chunk ``[rows, V]`` bf16 (reused by every chunk)."""
    from polyrl.kernels.token_logprobs import triton as tlp

    t = real["B"] * real["S"]
    return tlp.chunk_rows(t, real["V"], 2, tlp.CHUNK_BYTES) * real["V"] * 2.0


def report(args: argparse.Namespace) -> dict[str, Any]:
    small = dict(SMALL)
    scale = Scaler(size_map(small, REAL))
    cfg = small_config(args.layers, small)
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, small["V"], (small["B"], small["S"]), generator=g)
    ours = polyrl_step(cfg, tokens, scale, args.seed)
    hf, status = hf_step(cfg, tokens, scale, args.seed)
    st = static_bytes(REAL, args.real_layers)
    static = st["weights"] + st["moments"]
    ours_k, hf_k = per_layer_kinds(ours), per_layer_kinds(hf)
    lig_k = liger_model(hf, REAL) if "modelled" in status else hf_k
    nl = args.real_layers
    layered = ("attention", "router", "experts", "norms")

    def total(k: dict[str, float]) -> float:
        return sum(v * (nl if kind in layered else 1) for kind, v in k.items())

    print(
        f"moe_memory_account: qwen3-30b-a3b-L{nl}, {REAL['B']} x {REAL['S']} tokens, bf16 weights/grads/moments "
        f"(static: weights {st['weights'] / GIB:.2f} + grads {st['grads'] / GIB:.2f} + moments "
        f"{st['moments'] / GIB:.2f} GiB; {st['params'] / 1e9:.2f}B params); recorded on {args.layers} small layers; "
        f"{status}"
    )
    print("\nsaved for backward, GiB at the real shape (per layer for the layer kinds):")
    tk = REAL["B"] * REAL["S"] * REAL["k"]
    act_y = 2.0 * tk * (REAL["I"] + REAL["H"])  # what the experts kept before 808574c besides h
    before_k = dict(ours_k, experts=ours_k.get("experts", 0.0) + act_y)
    print(f"{'kind':12} {'polyrl':>9} {'before':>9} {'HF':>9} {'HF+Liger':>9}   (before: polyrl before 808574c)")
    for kind in KINDS:
        a, a0, b, c = ours_k.get(kind, 0.0), before_k.get(kind, 0.0), hf_k.get(kind, 0.0), lig_k.get(kind, 0.0)
        if a or b or c:
            print(f"{kind:12} {a / GIB:9.3f} {a0 / GIB:9.3f} {b / GIB:9.3f} {c / GIB:9.3f}")
    print(
        f"{'all layers':12} {total(ours_k) / GIB:9.2f} {total(before_k) / GIB:9.2f} {total(hf_k) / GIB:9.2f} "
        f"{total(lig_k) / GIB:9.2f}"
    )

    print("\npolyrl's saved tensors of one layer (layer 0) and outside the layers, real shape:")
    for r in sorted(ours.saved.values(), key=lambda r: -r.real):
        if r.layer in (0, None):
            print(f"  {r.kind:10} {r.module:34} {str(list(r.shape)):18} {r.dtype:9} {r.real / GIB:7.3f} GiB  "
                  f"{r.via}: {r.where}")  # fmt: skip

    t_ours = expert_backward_transients(REAL, "polyrl")
    t_before = expert_backward_transients(REAL, "polyrl-before")
    t_lig = expert_backward_transients(REAL, "liger")
    # the small run has args.layers layers: stretch the timeline to nl layers by repeating layer 0's events
    ours_n = _repeat_layers(ours, nl)
    peak_o, where_o, _ = timeline_peak(ours_n, static, t_ours)
    peak_b, where_b, _ = timeline_peak(with_expert_extra(ours_n, act_y), static, t_before)
    peak_f, where_f, _ = timeline_peak(lce_state_freed_early(ours_n), static, t_ours)
    chunk = loss_forward_transient()
    fwd_o = static + total(ours_k)
    if fwd_o + chunk > peak_o:
        peak_o, where_o = fwd_o + chunk, "forward: the loss's logits chunk"
    if fwd_o + nl * act_y + chunk > peak_b:
        peak_b, where_b = fwd_o + nl * act_y + chunk, "forward: the loss's logits chunk"
    # HF+Liger: the same walk over HF's graph with Liger's per-layer bytes (modelled when Liger is not importable)
    lig_layer = sum(v for k, v in lig_k.items() if k in layered)
    lig_fwd = static + total(lig_k)
    # backward of layer n: layers 0..n still saved, every gradient but theirs (Liger's FLCE grad_weight is the LM
    # head's gradient itself: not counted twice), the experts' working set
    lig_head = lig_k.get("head/loss", 0.0) - 2.0 * REAL["V"] * REAL["H"]
    lig_bwd = max(
        static + lig_layer * (n + 1) + (st["grads"] - _layer_grad(REAL) * (n + 1)) + t_lig + lig_head for n in range(nl)
    )
    peak_l, where_l = max((lig_fwd, "end of forward"), (lig_bwd, "backward"), (static + st["grads"], "end of backward"))
    print(
        f"\nexperts' backward working set (modelled): polyrl {t_ours / GIB:.2f} GiB (before 808574c "
        f"{t_before / GIB:.2f}), Liger {t_lig / GIB:.2f} GiB; polyrl's loss forward: logits chunk "
        f"{chunk / GIB:.2f} GiB"
    )
    print("\npredicted peak at the real shape:")
    print(f"  polyrl (this tree):     {peak_o / GIB:5.1f} GiB at {where_o}")
    print(f"  polyrl, LCE state freed after its backward (not built): {peak_f / GIB:5.1f} GiB at {where_f}")
    print(
        f"  polyrl before 808574c:  {peak_b / GIB:5.1f} GiB at {where_b}  (+act and y per layer: {act_y / GIB:.3f} GiB)"
    )
    print(
        f"  HF+Liger ({'modelled' if 'modelled' in status else 'measured'}):     {peak_l / GIB:5.1f} GiB at {where_l}"
    )
    if scale.unscaled:
        print(f"unscaled shapes (a size the map does not know): {sorted(scale.unscaled)[:8]}")
    return {
        "layers_real": nl,
        "static_gib": {k: v / GIB for k, v in st.items() if k != "params"},
        "saved_per_layer_gib": {
            "polyrl": {k: v / GIB for k, v in ours_k.items()},
            "hf": {k: v / GIB for k, v in hf_k.items()},
            "hf_liger": {k: v / GIB for k, v in lig_k.items()},
        },
        "saved_total_gib": {"polyrl": total(ours_k) / GIB, "hf": total(hf_k) / GIB, "hf_liger": total(lig_k) / GIB},
        "peak_gib": {
            "polyrl": peak_o / GIB,
            "polyrl_before": peak_b / GIB,
            "polyrl_lce_freed": peak_f / GIB,
            "hf_liger": peak_l / GIB,
        },
        "peak_at": {"polyrl": where_o, "polyrl_before": where_b, "hf_liger": where_l},
        "liger": status,
    }


def _repeat_layers(rec: Recorder, layers: int) -> Recorder:
    """A copy of ``rec``'s events with the recorded decoder layers stretched to ``layers``: layer 0's events stand
    for every layer (all layers of the preset have the same structure), in forward and reversed backward order."""
    out = Recorder.__new__(Recorder)
    ev = rec.events
    first = [e for e in ev if e[3] is None or e[3] == 0]
    fwd = [e for e in ev if e[0] == "forward"]
    bwd = [e for e in ev if e[0] != "forward"]
    lay0f = [e for e in fwd if e[3] == 0]
    lay0b = [e for e in bwd if e[3] == 0]
    recorded = max((e[3] for e in ev if e[3] is not None), default=0)
    if not lay0f:
        out.events = list(ev)
        return out
    events: list = []
    i0 = next(i for i, e in enumerate(fwd) if e[3] == 0)
    events += [e for e in fwd[:i0] if e[3] is None]
    for n in range(layers):
        events += [(p, w, k, n, d) for p, w, k, _, d in lay0f]
    events += [e for e in fwd[i0:] if e[3] is None]
    j_last = next((i for i, e in enumerate(bwd) if e[3] == recorded), len(bwd))
    events += [e for e in bwd[:j_last] if e[3] is None]
    for n in reversed(range(layers)):
        events += [(p, w, k, n, d) for p, w, k, _, d in lay0b]
    events += [e for e in bwd[j_last:] if e[3] is None]
    del first
    out.events = events
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the small CPU model")
    p.add_argument("--real-layers", type=int, default=8, help="layers of the real shape (qwen3-30b-a3b-L8: 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = report(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
