"""Validation cases for every op: input factories, shapes (awkward sizes), gradients, tolerances.

Importing this module fills ``polyrl.validate.ops_spec.CASES`` (``polyrl.validate.ops`` imports it). Each
factory draws from a CPU generator (same values on every device) and returns the op's arguments in call order;
the sweep rounds float inputs to the test dtype and gives the reference the same values in fp64. Shapes are
"tiny" (fast enough for the Triton interpreter), "small" (CPU) or "large" (accelerators: real widths).

Tolerances: the defaults in ``ops_spec.DEFAULT_TOL`` suit elementwise ops; ops with long reductions or matmuls
(attention, linear + cross-entropy, token log-probs) allow more in fp32 because Triton's ``tl.dot`` uses
TF32 for fp32 inputs by default, and bf16 gradients of long reductions drift further.

Deliberately not here: the sweep logic (``ops.py``) and any timing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from polyrl.kernels.fp8.reference import quantize as fp8_quantize_ref
from polyrl.kernels.rope.reference import rope_cos_sin
from polyrl.validate.ops_spec import DEFAULT_TOL, OpCases, Shape, Tol, register_cases

MATMUL_TOL = {
    "float32": Tol(3e-3, 1e-3, 1e-2),  # TF32 in tl.dot; an exact fp32 path passes with room
    "float16": Tol(5e-3, 2e-3, 2e-2),
    "bfloat16": Tol(3e-2, 2e-2, 8e-2),
}
EXACT_TOL = {name: Tol(0.0, 0.0, 0.0) for name in DEFAULT_TOL}


def _randn(gen: torch.Generator, *shape: int, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device)


def _cu_seqlens(lengths: list[int], device: torch.device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu.to(device)


# --- rmsnorm -----------------------------------------------------------------------------------------


def _make_rmsnorm(p, dtype, device, gen):
    t, h = p["T"], p["H"]
    return {
        "x": _randn(gen, t, h, device=device, scale=2.0),
        "weight": (torch.rand(h, generator=gen) + 0.5).to(device),
        "eps": 1e-6,
        "residual": _randn(gen, t, h, device=device) if p.get("residual") else None,
    }


def _rmsnorm_shapes():
    return [
        Shape("T=7,H=127", {"T": 7, "H": 127}, "tiny"),
        Shape("T=1,H=1025,res", {"T": 1, "H": 1025, "residual": True}, "tiny"),
        Shape("T=1025,H=127,res", {"T": 1025, "H": 127, "residual": True}),
        Shape("T=127,H=1024", {"T": 127, "H": 1024}),
        Shape("T=16384,H=1024,res", {"T": 16384, "H": 1024, "residual": True}, "large"),
        Shape("T=4096,H=4096", {"T": 4096, "H": 4096}, "large"),
    ]


# --- rope --------------------------------------------------------------------------------------------


def _make_rope(p, dtype, device, gen):
    t, hq, hk, d = p["T"], p["Hq"], p["Hk"], p["D"]
    # Packed sequences: positions restart at 0 every 97 tokens.
    pos = (torch.arange(t) % 97 + p.get("offset", 0)).to(device)
    cos, sin = rope_cos_sin(pos, d, p.get("theta", 1e6))
    return {
        "q": _randn(gen, t, hq, d, device=device),
        "k": _randn(gen, t, hk, d, device=device),
        "cos": cos,
        "sin": sin,
    }


def _rope_call(fn, inputs):
    # cos/sin are position tables, never differentiated: pass them detached, in fp32.
    args = dict(inputs)
    args["cos"], args["sin"] = args["cos"].detach().float(), args["sin"].detach().float()
    return fn(*args.values())


def _rope_shapes():
    return [
        Shape("T=7,Hq=4,Hk=2,D=64", {"T": 7, "Hq": 4, "Hk": 2, "D": 64}, "tiny"),
        Shape("T=1,Hq=2,Hk=1,D=128", {"T": 1, "Hq": 2, "Hk": 1, "D": 128, "offset": 4000}, "tiny"),
        Shape("T=1025,Hq=4,Hk=2,D=64", {"T": 1025, "Hq": 4, "Hk": 2, "D": 64}),
        Shape("T=127,Hq=16,Hk=8,D=128", {"T": 127, "Hq": 16, "Hk": 8, "D": 128}),
        Shape("T=16384,Hq=16,Hk=8,D=128", {"T": 16384, "Hq": 16, "Hk": 8, "D": 128}, "large"),
    ]


# --- swiglu / silu / linear (plain torch rows as in the community report) ----------------------------


def _make_swiglu(p, dtype, device, gen):
    return {
        "gate": _randn(gen, p["T"], p["I"], device=device, scale=3.0),
        "up": _randn(gen, p["T"], p["I"], device=device),
    }


def _swiglu_shapes():
    return [
        Shape("T=7,I=127", {"T": 7, "I": 127}, "tiny"),
        Shape("T=1,I=1025", {"T": 1, "I": 1025}, "tiny"),
        Shape("T=1025,I=127", {"T": 1025, "I": 127}),
        Shape("T=127,I=3072", {"T": 127, "I": 3072}),
        Shape("T=16384,I=3072", {"T": 16384, "I": 3072}, "large"),
    ]


def _make_silu(p, dtype, device, gen):
    return {"x": _randn(gen, p["T"], p["I"], device=device, scale=3.0)}


def _make_linear(p, dtype, device, gen):
    return {
        "x": _randn(gen, p["T"], p["in"], device=device),
        "weight": _randn(gen, p["out"], p["in"], device=device, scale=p["in"] ** -0.5),
        "bias": _randn(gen, p["out"], device=device) if p.get("bias", True) else None,
    }


def _linear_shapes():
    return [
        Shape("T=7,in=127,out=33", {"T": 7, "in": 127, "out": 33}, "tiny"),
        Shape("T=127,in=1025,out=7,nobias", {"T": 127, "in": 1025, "out": 7, "bias": False}),
        Shape("T=1025,in=256,out=1024", {"T": 1025, "in": 256, "out": 1024}),
        Shape("T=4096,in=1024,out=3072", {"T": 4096, "in": 1024, "out": 3072}, "large"),
    ]


def _make_qk_norm_rope(p, dtype, device, gen):
    t, hq, hk, d = p["T"], p["Hq"], p["Hk"], p["D"]
    cos, sin = rope_cos_sin(torch.arange(t, device=device), d, 10000.0, dtype=torch.float32)
    return {
        "q": _randn(gen, t, hq, d, device=device, scale=3.0),
        "k": _randn(gen, t, hk, d, device=device, scale=3.0),
        "q_weight": 1.0 + _randn(gen, d, device=device, scale=0.3),
        "k_weight": 1.0 + _randn(gen, d, device=device, scale=0.3),
        "cos": cos,
        "sin": sin,
    }


def _qk_norm_rope_shapes():
    return [
        Shape("T=5,Hq=4,Hk=2,D=16", {"T": 5, "Hq": 4, "Hk": 2, "D": 16}, "tiny"),
        Shape("T=256,Hq=16,Hk=8,D=128", {"T": 256, "Hq": 16, "Hk": 8, "D": 128}),
    ]


def _skinny_shapes():
    return [
        Shape("T=3,in=127,out=33", {"T": 3, "in": 127, "out": 33}, "tiny"),
        Shape("T=1,in=1024,out=2048", {"T": 1, "in": 1024, "out": 2048}),
        Shape("T=8,in=3072,out=1024,nobias", {"T": 8, "in": 3072, "out": 1024, "bias": False}, "large"),
    ]


# --- attention ---------------------------------------------------------------------------------------


def _make_attention(p, dtype, device, gen):
    lens, hq, hk, d = p["lens"], p["Hq"], p["Hk"], p["D"]
    t = sum(lens)
    return {
        "q": _randn(gen, t, hq, d, device=device),
        "k": _randn(gen, t, hk, d, device=device),
        "v": _randn(gen, t, hk, d, device=device),
        "cu_seqlens": _cu_seqlens(lens, device),
        "max_seqlen": max(lens),
        "scale": None,
        "window": p.get("window"),
    }


def _attention_shapes():
    return [
        Shape("lens=1,7;Hq=2,Hk=1,D=64", {"lens": [1, 7], "Hq": 2, "Hk": 1, "D": 64}, "tiny"),
        Shape("lens=7,3;Hq=4,Hk=2,D=128,win=4", {"lens": [7, 3], "Hq": 4, "Hk": 2, "D": 128, "window": 4}, "tiny"),
        Shape("lens=1,7,127;Hq=4,Hk=2,D=128", {"lens": [1, 7, 127], "Hq": 4, "Hk": 2, "D": 128}),
        Shape("lens=127,33;Hq=4,Hk=1,D=64,win=16", {"lens": [127, 33], "Hq": 4, "Hk": 1, "D": 64, "window": 16}),
        Shape("lens=1025,1,7;Hq=4,Hk=2,D=64", {"lens": [1025, 1, 7], "Hq": 4, "Hk": 2, "D": 64}),
        # Equal lengths: the "cudnn" implementation's batched-SDPA path (same Triton keys as the shapes above).
        Shape("lens=127,127;Hq=4,Hk=2,D=128", {"lens": [127, 127], "Hq": 4, "Hk": 2, "D": 128}),
        Shape(
            "lens=2048,1025,127,1;Hq=16,Hk=8,D=128",
            {"lens": [2048, 1025, 127, 1], "Hq": 16, "Hk": 8, "D": 128},
            "large",
        ),
        Shape(
            "lens=4096;Hq=16,Hk=8,D=128,win=1024",
            {"lens": [4096], "Hq": 16, "Hk": 8, "D": 128, "window": 1024},
            "large",
        ),
    ]


# --- paged attention and the KV-cache write ----------------------------------------------------------


def _block_tables(ctx_lens: list[int], block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Distinct, shuffled physical blocks per sequence; returns (tables [B, max_blocks], num_blocks)."""
    need = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(ctx_lens), max(need), dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[start : start + n].to(torch.int32)
        start += n
    return tables, num_blocks


def _make_paged(p, dtype, device, gen):
    ctx, qlens, hq, hk, d, bs = p["ctx"], p["qlens"], p["Hq"], p["Hk"], p["D"], p.get("block", 16)
    tables, num_blocks = _block_tables(ctx, bs, gen)
    return {
        "q": _randn(gen, sum(qlens), hq, d, device=device),
        "k_cache": _randn(gen, num_blocks, bs, hk, d, device=device),
        "v_cache": _randn(gen, num_blocks, bs, hk, d, device=device),
        "block_tables": tables.to(device),
        "context_lens": torch.tensor(ctx, dtype=torch.int32, device=device),
        "cu_seqlens_q": _cu_seqlens(qlens, device),
        "max_seqlen_q": max(qlens),
        "scale": None,
        "window": p.get("window"),
    }


def _paged_shapes():
    dec = lambda ctx, **kw: {"ctx": ctx, "qlens": [1] * len(ctx), **kw}  # noqa: E731
    return [
        Shape("decode ctx=1,7,33;Hq=4,Hk=2,D=64", dec([1, 7, 33], Hq=4, Hk=2, D=64), "tiny"),
        Shape("prefill ctx=7,20 q=3,7;D=128", {"ctx": [7, 20], "qlens": [3, 7], "Hq": 2, "Hk": 1, "D": 128}, "tiny"),
        Shape("decode ctx=1,7,127,1025;Hq=8,Hk=2,D=128", dec([1, 7, 127, 1025], Hq=8, Hk=2, D=128)),
        Shape(
            "prefill ctx=127,40 q=127,9;win=32",
            {"ctx": [127, 40], "qlens": [127, 9], "Hq": 4, "Hk": 2, "D": 64, "window": 32},
        ),
        Shape("decode B=64 ctx=2048;Hq=16,Hk=8,D=128", dec([2048] * 64, Hq=16, Hk=8, D=128), "large"),
    ]


def _make_kv_write(p, dtype, device, gen):
    t, hk, d, bs, nb = p["T"], p["Hk"], p["D"], p.get("block", 16), p["blocks"]
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[:: max(1, p.get("skip_every", 5))] = -1  # padding tokens: skipped
    return {
        "k": _randn(gen, t, hk, d, device=device),
        "v": _randn(gen, t, hk, d, device=device),
        "k_cache": torch.zeros(nb, bs, hk, d, device=device),
        "v_cache": torch.zeros(nb, bs, hk, d, device=device),
        "slot_mapping": slots.to(device),
    }


def _kv_write_call(fn, inputs):
    fn(*inputs.values())
    return inputs["k_cache"], inputs["v_cache"]


def _kv_write_shapes():
    return [
        Shape("T=7,Hk=2,D=64", {"T": 7, "Hk": 2, "D": 64, "blocks": 3}, "tiny"),
        Shape("T=1025,Hk=8,D=128", {"T": 1025, "Hk": 8, "D": 128, "blocks": 80}),
        Shape("T=16384,Hk=8,D=128", {"T": 16384, "Hk": 8, "D": 128, "blocks": 1100}, "large"),
    ]


# --- linear + cross-entropy and token log-probs (vocab not a multiple of any block) --------------------


def _make_lce(p, dtype, device, gen):
    t, h, v = p["T"], p["H"], p["V"]
    labels = torch.randint(0, v, (t,), generator=gen)
    labels[torch.rand(t, generator=gen) < 0.25] = -100
    return {
        "hidden": _randn(gen, t, h, device=device),
        "weight": _randn(gen, v, h, device=device, scale=2 * h**-0.5),
        "labels": labels.to(device),
        "ignore_index": -100,
        "reduction": p.get("reduction", "sum"),
    }


def _lce_shapes():
    return [
        Shape("T=7,H=32,V=1025,sum", {"T": 7, "H": 32, "V": 1025}, "tiny"),
        Shape("T=1,H=16,V=7,mean", {"T": 1, "H": 16, "V": 7, "reduction": "mean"}, "tiny"),
        Shape("T=127,H=64,V=1025,none", {"T": 127, "H": 64, "V": 1025, "reduction": "none"}),
        Shape("T=1025,H=64,V=4097,mean", {"T": 1025, "H": 64, "V": 4097, "reduction": "mean"}),
        Shape("T=1024,H=1024,V=151936,sum", {"T": 1024, "H": 1024, "V": 151936}, "large"),
    ]


def _make_tlp(p, dtype, device, gen):
    t, h, v = p["T"], p["H"], p["V"]
    return {
        "hidden": _randn(gen, t, h, device=device),
        "weight": _randn(gen, v, h, device=device, scale=2 * h**-0.5),
        "tokens": torch.randint(0, v, (t,), generator=gen).to(device),
        "temperature": p.get("temperature", 1.0),
        "return_entropy": True,
    }


def _tlp_shapes():
    return [
        Shape("T=7,H=32,V=1025,temp=0.7", {"T": 7, "H": 32, "V": 1025, "temperature": 0.7}, "tiny"),
        Shape("T=1,H=16,V=7", {"T": 1, "H": 16, "V": 7}, "tiny"),
        Shape("T=127,H=64,V=1025", {"T": 127, "H": 64, "V": 1025}),
        Shape("T=1025,H=64,V=4097,temp=1.3", {"T": 1025, "H": 64, "V": 4097, "temperature": 1.3}),
        Shape("T=1024,H=1024,V=151936", {"T": 1024, "H": 1024, "V": 151936}, "large"),
    ]


# --- moe_experts --------------------------------------------------------------------------------------------


def _make_moe(p, dtype, device, gen):
    """Top-k routing (k distinct experts per token) from random logits, softmax-normalised weights; experts listed
    in ``empty`` get no tokens."""
    t, h, inter, e, k = p["T"], p["H"], p["I"], p["E"], p["k"]
    logits = torch.randn(t, e, generator=gen)
    logits[:, list(p.get("empty", ()))] = -float("inf")
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return {
        "x": _randn(gen, t, h, device=device),
        "topk_ids": ids.to(device),
        "topk_weights": (w / w.sum(-1, keepdim=True)).to(device),
        "gate_up": _randn(gen, e, 2 * inter, h, device=device, scale=h**-0.5),
        "down": _randn(gen, e, h, inter, device=device, scale=inter**-0.5),
    }


def _moe_shapes():
    return [
        Shape("T=7,H=32,I=16,E=4,k=2", {"T": 7, "H": 32, "I": 16, "E": 4, "k": 2, "empty": (3,)}, "tiny"),
        Shape("T=1,H=64,I=32,E=16,k=8", {"T": 1, "H": 64, "I": 32, "E": 16, "k": 8}, "tiny"),
        Shape("T=127,H=128,I=64,E=8,k=2", {"T": 127, "H": 128, "I": 64, "E": 8, "k": 2}),
        Shape("T=1024,H=2048,I=768,E=128,k=8", {"T": 1024, "H": 2048, "I": 768, "E": 128, "k": 8}, "large"),
    ]


def _make_moe_lora(p, dtype, device, gen):
    """``_make_moe``'s problem plus a rank-``r`` adapter on both projections (B not zero: a trained adapter)."""
    inputs = _make_moe(p, dtype, device, gen)
    h, inter, e, r = p["H"], p["I"], p["E"], p["r"]
    return {
        **inputs,
        "gate_up_a": _randn(gen, e, r, h, device=device, scale=h**-0.5),
        "gate_up_b": _randn(gen, e, 2 * inter, r, device=device, scale=0.3),
        "down_a": _randn(gen, e, r, inter, device=device, scale=inter**-0.5),
        "down_b": _randn(gen, e, h, r, device=device, scale=0.3),
        "scale": 2.0,
    }


def _moe_lora_shapes():
    return [
        Shape("T=7,H=32,I=16,E=4,k=2,r=4", {"T": 7, "H": 32, "I": 16, "E": 4, "k": 2, "r": 4, "empty": (3,)}, "tiny"),
        Shape("T=127,H=128,I=64,E=8,k=2,r=16", {"T": 127, "H": 128, "I": 64, "E": 8, "k": 2, "r": 16}),
        Shape("T=1024,H=2048,I=768,E=128,k=8,r=16", {"T": 1024, "H": 2048, "I": 768, "E": 128, "k": 8, "r": 16},
              "large"),
    ]  # fmt: skip


# --- fp8_quantize / fp8_scaled_mm ----------------------------------------------------------------------------------


def _make_fp8_quantize(p, dtype, device, gen):
    x = _randn(gen, p["M"], p["K"], device=device, scale=3.0)
    x[0, 0] = 40.0  # an outlier: it sets its row's (or the tensor's) scale
    return {"x": x, "fp8_dtype": p["fp8"], "rowwise": p["rowwise"]}


def _fp8_quantize_shapes():
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    return [
        Shape("M=7,K=127,e4m3", {"M": 7, "K": 127, "fp8": e4m3, "rowwise": False}, "tiny"),
        Shape("M=7,K=127,e5m2,rowwise", {"M": 7, "K": 127, "fp8": e5m2, "rowwise": True}, "tiny"),
        Shape("M=1025,K=1025,e4m3,rowwise", {"M": 1025, "K": 1025, "fp8": e4m3, "rowwise": True}),
        Shape("M=127,K=4097,e5m2", {"M": 127, "K": 4097, "fp8": e5m2, "rowwise": False}),
        Shape("M=8192,K=2048,e4m3,rowwise", {"M": 8192, "K": 2048, "fp8": e4m3, "rowwise": True}, "large"),
        Shape("M=8192,K=6144,e5m2", {"M": 8192, "K": 6144, "fp8": e5m2, "rowwise": False}, "large"),
    ]


def _make_fp8_mm(p, dtype, device, gen):
    return {
        "a": _randn(gen, p["M"], p["K"], device=device),
        "w": _randn(gen, p["N"], p["K"], device=device, scale=p["K"] ** -0.5),
        "rowwise": p["rowwise"],
    }


def _fp8_mm_call(fn, inputs):
    """Quantise ``a`` and the weight ``w [N, K]`` with the reference (e4m3; per row / per output channel when
    row-wise), then ``fn(aq, wq^T, ...)``: bf16 out for bf16 inputs, fp32 otherwise (the fp64 reference included)."""
    rowwise = inputs["rowwise"]
    aq, sa = fp8_quantize_ref(inputs["a"], torch.float8_e4m3fn, rowwise)
    wq, sw = fp8_quantize_ref(inputs["w"], torch.float8_e4m3fn, rowwise)
    out_dtype = torch.bfloat16 if inputs["a"].dtype == torch.bfloat16 else torch.float32
    return (fn(aq, wq.t(), sa, sw.reshape(1, -1) if rowwise else sw, out_dtype, False),)


def _fp8_mm_shapes():
    return [
        Shape("M=7,K=32,N=48", {"M": 7, "K": 32, "N": 48, "rowwise": False}, "tiny"),
        Shape("M=127,K=1000,N=72,rowwise", {"M": 127, "K": 1000, "N": 72, "rowwise": True}),
        Shape("M=1025,K=1025,N=127", {"M": 1025, "K": 1025, "N": 127, "rowwise": False}),
        Shape("M=4096,K=2048,N=6144,rowwise", {"M": 4096, "K": 2048, "N": 6144, "rowwise": True}, "large"),
        Shape("M=4096,K=2048,N=6144", {"M": 4096, "K": 2048, "N": 6144, "rowwise": False}, "large"),
    ]


def _register_all() -> None:
    register_cases(OpCases("rmsnorm", _make_rmsnorm, _rmsnorm_shapes(), ("y", "sum"), ("x", "weight", "residual")))
    register_cases(OpCases("rope", _make_rope, _rope_shapes(), ("q", "k"), ("q", "k"), call=_rope_call))
    register_cases(OpCases("swiglu", _make_swiglu, _swiglu_shapes(), ("y",), ("gate", "up")))
    register_cases(
        OpCases("attention", _make_attention, _attention_shapes(), ("out",), ("q", "k", "v"), tol=dict(MATMUL_TOL),
                bf16_dot=True)
    )  # fmt: skip
    register_cases(
        OpCases("paged_attention", _make_paged, _paged_shapes(), ("out",), tol=dict(MATMUL_TOL), bf16_dot=True)
    )
    register_cases(
        OpCases("kv_cache_write", _make_kv_write, _kv_write_shapes(), ("k_cache", "v_cache"), call=_kv_write_call,
                tol=dict(EXACT_TOL), note="a copy: must be exact")
    )  # fmt: skip
    register_cases(
        OpCases("linear_cross_entropy", _make_lce, _lce_shapes(), ("loss",), ("hidden", "weight"), tol=dict(MATMUL_TOL))
    )  # fmt: skip
    register_cases(
        OpCases("token_logprobs", _make_tlp, _tlp_shapes(), ("logprobs", "entropy"), ("hidden", "weight"),
                tol=dict(MATMUL_TOL))
    )  # fmt: skip
    register_cases(
        OpCases("skinny_linear", _make_linear, _skinny_shapes(), ("y",), tol=dict(MATMUL_TOL),
                note="the decode step's projections at a few rows (no autograd)")
    )  # fmt: skip
    register_cases(
        OpCases("qk_norm_rope", _make_qk_norm_rope, _qk_norm_rope_shapes(), ("q", "k"),
                note="Qwen3's q/k norms + RoPE of a decode step, one pass (no autograd)")
    )  # fmt: skip
    swiglu_shapes = _swiglu_shapes()
    register_cases(
        OpCases("silu", _make_silu, swiglu_shapes, ("y",), ("x",), torch_impls=[("torch", F.silu)],
                note="plain torch on this device vs fp64, as in the community report")
    )  # fmt: skip
    register_cases(
        OpCases("linear", _make_linear, _linear_shapes(), ("y",), ("x", "weight", "bias"), tol=dict(MATMUL_TOL),
                torch_impls=[("torch", F.linear)], note="matmul + bias on this device vs fp64")
    )  # fmt: skip
    register_cases(
        OpCases("moe_experts", _make_moe, _moe_shapes(), ("y",), ("x", "topk_weights", "gate_up", "down"),
                tol=dict(MATMUL_TOL), note="routed SwiGLU experts (Qwen3-MoE layout), weighted sum per token")
    )  # fmt: skip
    register_cases(
        OpCases("moe_experts_lora", _make_moe_lora, _moe_lora_shapes(), ("y",),
                ("x", "topk_weights", "gate_up_a", "gate_up_b", "down_a", "down_b"), tol=dict(MATMUL_TOL),
                note="routed experts with a LoRA adapter per expert over a frozen base (W' not built by Triton)")
    )  # fmt: skip

    register_cases(
        OpCases("fp8_quantize", _make_fp8_quantize, _fp8_quantize_shapes(), ("q", "scale"), tol=dict(EXACT_TOL),
                note="current-scaling FP8 cast (tensor-/row-wise): bit-equal to the reference")
    )  # fmt: skip
    register_cases(
        OpCases("fp8_scaled_mm", _make_fp8_mm, _fp8_mm_shapes(), ("y",), call=_fp8_mm_call, tol=dict(MATMUL_TOL),
                note="scaled FP8 GEMM (e4m3 operands quantised by the reference) vs dequantise + matmul")
    )  # fmt: skip


_register_all()
