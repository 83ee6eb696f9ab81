"""``polyrl bench kernels`` cases of the mixture-of-experts ops (``moe_experts``, ``moe_experts_lora``) at
Qwen3-30B-A3B's expert shapes (a tiny shape on the CPU); registered in ``kernel_cases.BENCHES`` when
``kernels.py`` imports this module. The harness: ``kernel_cases.py``; the other ops, timing and printing:
``kernels.py``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import polyrl.kernels as K
from polyrl.bench.kernel_cases import Case, Ctx, bench, candidate, forward_only, fwd_bwd, impl_name, rand
from polyrl.kernels import registry

# Qwen3-30B-A3B's routed experts: hidden, expert intermediate, experts, experts per token; and the tokens of one
# bench call (a 4096-token micro-batch) whatever --tokens says (the tiny preset on the CPU uses --tokens).
MOE_SHAPE = {"hidden": 2048, "inter": 768, "experts": 128, "topk": 8}
MOE_TINY = {"hidden": 64, "inter": 32, "experts": 8, "topk": 2}
MOE_TOKENS = 4096


def _moe_target(fraction: float):
    def check(rows: dict[str, dict[str, Any]], ctx: Ctx) -> tuple[str, bool | None]:
        # Device time (graph replays) where both were measured: the eager time carries the routing's launches.
        key = "graph_ms" if rows.get("polyrl", {}).get("graph_ms") and rows.get("dense", {}).get("graph_ms") else "ms"
        p, d = rows.get("polyrl", {}).get(key), rows.get("dense", {}).get(key)
        label = f">= {fraction:.0%} of dense GEMMs' TFLOP/s" + (" (graph)" if key == "graph_ms" else "")
        return label, (None if p is None or d is None else d / p >= fraction)

    return check


@bench("moe_experts")
def bench_moe(ctx: Ctx) -> list[Case]:
    """The routed experts of a Qwen3-30B-A3B layer (bf16): polyrl (the registry's pick: the Triton grouped GEMMs),
    ``grouped_mm`` (torch._grouped_mm), ``eager`` (the reference: a Python loop over experts) and ``dense``: the
    same FLOPs as two plain GEMMs ([T*k, H] x [H, 2I], SwiGLU, [T*k, I] x [I, H], one expert's weights, no
    routing): the "x base" column of polyrl is its fraction of the dense GEMMs' throughput (target >= 70%)."""
    tiny = ctx.device.type == "cpu" or ctx.shape["hidden"] <= 64
    h, inter, e, k = (MOE_TINY if tiny else MOE_SHAPE).values()
    t = ctx.tokens if tiny else MOE_TOKENS
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    x = rand(ctx, t, h)
    w, ids = torch.topk(torch.softmax(torch.randn(t, e, device=ctx.device, generator=gen), -1), k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(ctx.dtype)
    gate_up, down = rand(ctx, e, 2 * inter, h, scale=h**-0.5), rand(ctx, e, h, inter, scale=inter**-0.5)
    rows = rand(ctx, t * k, h)

    def dense(rows, gu0, dn0):
        hh = F.linear(rows, gu0)
        return F.linear(F.silu(hh[:, :inter]) * hh[:, inter:], dn0)

    def moe_ref(*args):
        # lazy: the reference is this case's baseline only
        from polyrl.kernels.moe.reference import moe_experts

        return moe_experts(*args)

    args = [x, ids, w, gate_up, down]
    impl = impl_name("moe_experts", x)

    def make(fn, a, grads):
        return fwd_bwd(fn, a, grads) if grads is not None else forward_only(fn, a)

    cases = []
    for grads, dense_grads, label, mult in ((None, None, "fwd", 1), ({0, 2, 3, 4}, {0, 1, 2}, "fwd+bwd", 3)):
        cands = [candidate("polyrl", lambda g=grads: make(K.moe_experts, args, g))]
        cands.append(candidate("grouped_mm", lambda g=grads: make(registry.load("moe_experts", "grouped_mm"), args, g)))
        cands.append(candidate("dense", lambda g=dense_grads: make(dense, [rows, gate_up[0], down[0]], g)))
        if "eager" in ctx.baselines:
            cands.append(candidate("eager", lambda g=grads: make(moe_ref, args, g)))
        flops = float(mult * 2 * t * k * 3 * h * inter)
        cases.append(Case("moe_experts", f"{label} T={t} H={h} I={inter} E={e} k={k}", cands, flops=flops,
                          target=_moe_target(0.7), extra={"impl": impl}, base="dense", graph=True))  # fmt: skip
    return cases


@bench("moe_experts_lora")
def bench_moe_lora(ctx: Ctx) -> list[Case]:
    """A Qwen3-30B-A3B layer's routed experts with a rank-16 adapter per expert on both projections over a frozen
    base (bf16), forward + backward (gradients of x, the routing weights and the four factors): the registry's
    ``triton`` implementation (no ``W'``, no base weight gradient) against ``materialized`` (``W'`` built, then
    ``moe_experts``: what LoRA training runs by default); the "x base" column is triton's speed-up over it. FLOPs:
    the forward and the input gradients of the experts (4 x 3 GEMMs of [T*k, H] x [H, I]); the adapter products
    and, for ``materialized``, its base weight gradients are extra work not counted."""
    tiny = ctx.device.type == "cpu" or ctx.shape["hidden"] <= 64
    h, inter, e, k = (MOE_TINY if tiny else MOE_SHAPE).values()
    t, r = (ctx.tokens if tiny else MOE_TOKENS), 16
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    x = rand(ctx, t, h)
    w, ids = torch.topk(torch.softmax(torch.randn(t, e, device=ctx.device, generator=gen), -1), k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(ctx.dtype)
    gate_up, down = rand(ctx, e, 2 * inter, h, scale=h**-0.5), rand(ctx, e, h, inter, scale=inter**-0.5)
    adapters = [rand(ctx, e, r, h, scale=h**-0.5), rand(ctx, e, 2 * inter, r, scale=0.1)]
    adapters += [rand(ctx, e, r, inter, scale=inter**-0.5), rand(ctx, e, h, r, scale=0.1)]
    args = [x, ids, w, gate_up, down, *adapters, 2.0]
    grads = {0, 2, 5, 6, 7, 8}
    cands = [
        candidate(name, lambda n=name: fwd_bwd(registry.load("moe_experts_lora", n), args, grads))
        for name in ("triton", "materialized")
    ]
    flops = float(4 * 2 * t * k * 3 * h * inter)
    return [Case("moe_experts_lora", f"fwd+bwd T={t} H={h} I={inter} E={e} k={k} r={r}", cands, flops=flops,
                 extra={"impl": impl_name("moe_experts_lora", x)}, base="materialized", graph=True)]  # fmt: skip
