"""``polyrl bench kernels``: every op at real shapes against torch eager, torch.compile and Liger-Kernel,
in one run, printed as time, achieved bandwidth or TFLOP/s, peak extra memory and ratios.

The polyrl candidate always calls the public function in ``polyrl.kernels`` (so it measures whatever the
registry dispatches to here, and says which). Baselines: ``eager`` (the reference, i.e. what HF runs),
``compile`` (``torch.compile`` of the reference), ``liger`` (where Liger-Kernel has the same op and is
importable; otherwise skipped with the reason), plus op-specific ones (SDPA flash for attention, the
materialised-logits loss for linear_cross_entropy / token_logprobs, dense SDPA for paged decode).
Targets of issue 3 are evaluated in the same run: rmsnorm/swiglu/rope >= 85% of the measured copy
bandwidth, attention at least as fast as SDPA flash, fused losses <= 1/8 the memory and <= 1.1x the time
of the materialised version, paged decode >= 70% of copy bandwidth. ``sampling`` compares the fused
``sample_tokens`` (and the whole ``Sampler`` call) with the old torch path (softmax + exponential_ per seeded
row + argmax + log_softmax gather).

On the CPU it still runs (tiny preset, small ``--tokens``) so a test can smoke it; the numbers mean little
there. Deliberately not here: correctness (``polyrl validate ops``), end-to-end model benchmarks.
"""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import polyrl.kernels as K
from polyrl.bench import common
from polyrl.bench.kernel_cases import (
    BENCHES,
    Candidate,
    Case,
    Ctx,
    bench,
    candidate,
    forward_only,
    fwd_bwd,
    impl_name,
    rand,
)
from polyrl.errors import ConfigError
from polyrl.infer.sampler import Sampler
from polyrl.infer.sampling_params import SamplingParams
from polyrl.infer.sequence import Sequence
from polyrl.kernels import registry
from polyrl.kernels.attention.reference import varlen_attention as attention_ref
from polyrl.kernels.paged_attention.reference import paged_attention as paged_attention_ref
from polyrl.kernels.rmsnorm.reference import rmsnorm as rmsnorm_ref
from polyrl.kernels.rope.reference import apply_rope as rope_ref
from polyrl.kernels.swiglu.reference import swiglu as swiglu_ref
from polyrl.platform import device as dev

PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 64, "inter": 128, "hq": 4, "hk": 2, "d": 32, "vocab": 1000, "seq": 64, "ctx": 64, "batch": 4},
    "qwen3-0.6b": {"hidden": 1024, "inter": 3072, "hq": 16, "hk": 8, "d": 128, "vocab": 151936},
    "qwen3-8b": {"hidden": 4096, "inter": 12288, "hq": 32, "hk": 8, "d": 128, "vocab": 151936},
}
DEFAULTS = {"seq": 4096, "ctx": 2048, "batch": 256}
BASELINES = ("eager", "compile", "liger")


def _candidates(
    ctx: Ctx,
    polyrl_fn: Callable[..., Any],
    ref_fn: Callable[..., Any],
    args: list[Any],
    grads: set[int] | None,
    liger: Callable[[], Callable[..., Any]] | None,
    compile_ok: bool = True,
) -> list[Candidate]:
    """polyrl + eager + compile + liger for one op (``grads=None``: forward only)."""

    def make(fn):
        return fwd_bwd(fn, args, grads) if grads is not None else forward_only(fn, args)

    out = [candidate("polyrl", lambda: make(polyrl_fn))]
    if "eager" in ctx.baselines:
        out.append(candidate("eager", lambda: make(ref_fn)))
    if "compile" in ctx.baselines:
        if compile_ok:
            out.append(candidate("compile", lambda: make(torch.compile(ref_fn, dynamic=False))))
        else:
            out.append(Candidate("compile", skip="reference has a data-dependent Python loop"))
    if "liger" in ctx.baselines:
        if liger is None:
            out.append(Candidate("liger", skip="Liger-Kernel has no such op"))
        else:
            out.append(candidate("liger", lambda: make(liger())))
    return out


def _bw_target(fraction: float):
    def check(rows: dict[str, dict[str, Any]], ctx: Ctx) -> tuple[str, bool | None]:
        row = rows.get("polyrl") or {}
        # Device time (graph replay) where it was measured; the eager time carries Python/launch overhead.
        graph_pct = row.get("graph_pct_copy_bw")
        pct = graph_pct if graph_pct is not None else row.get("pct_copy_bw")
        label = f">= {fraction:.0%} of copy bandwidth" + (" (graph)" if graph_pct is not None else "")
        return label, (None if pct is None else pct >= fraction * 100)

    return check


# --- the ops ---------------------------------------------------------------------------------------------


@bench("rmsnorm")
def bench_rmsnorm(ctx: Ctx) -> list[Case]:
    t, h, e = ctx.tokens, ctx.shape["hidden"], torch.finfo(ctx.dtype).bits // 8
    x, r, w = rand(ctx, t, h), rand(ctx, t, h), rand(ctx, h) * 0.1 + 1

    def liger():
        # lazy: Liger-Kernel is an optional baseline, imported only when its row runs
        from liger_kernel.transformers.functional import liger_rms_norm

        # By default Liger writes dx into dy in place, which would change our fixed cotangent every rep.
        kw = {"in_place": False} if "in_place" in inspect.signature(liger_rms_norm).parameters else {}
        return lambda x, w: liger_rms_norm(x, w, 1e-6, **kw)

    plain = _candidates(
        ctx, lambda x, w: K.rmsnorm(x, w, 1e-6), lambda x, w: rmsnorm_ref(x, w, 1e-6), [x, w], {0, 1}, liger
    )
    fused = _candidates(
        ctx,
        lambda x, r, w: K.rmsnorm(x, w, 1e-6, r),
        lambda x, r, w: rmsnorm_ref(x, w, 1e-6, r),
        [x, r, w],
        {0, 1, 2},
        None,
    )
    note = {"impl": impl_name("rmsnorm", x)}
    return [
        Case("rmsnorm", f"fwd+bwd T={t} H={h}", plain, 5 * t * h * e, target=_bw_target(0.85), extra=note, graph=True),
        Case(
            "rmsnorm",
            f"+residual fwd+bwd T={t} H={h}",
            fused,
            8 * t * h * e,
            target=_bw_target(0.85),
            extra=note,
            graph=True,
        ),
    ]


@bench("swiglu")
def bench_swiglu(ctx: Ctx) -> list[Case]:
    t, i, e = ctx.tokens, ctx.shape["inter"], torch.finfo(ctx.dtype).bits // 8
    g, u = rand(ctx, t, i), rand(ctx, t, i)

    def liger():
        # lazy: Liger-Kernel is an optional baseline, imported only when its row runs
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return LigerSiLUMulFunction.apply

    cands = _candidates(ctx, K.swiglu, swiglu_ref, [g, u], {0, 1}, liger)
    return [
        Case("swiglu", f"fwd+bwd T={t} I={i}", cands, 8 * t * i * e, target=_bw_target(0.85),
             extra={"impl": impl_name("swiglu", g)}, graph=True)
    ]  # fmt: skip


@bench("rope")
def bench_rope(ctx: Ctx) -> list[Case]:
    t, hq, hk, d = ctx.tokens, ctx.shape["hq"], ctx.shape["hk"], ctx.shape["d"]
    e = torch.finfo(ctx.dtype).bits // 8
    pos = torch.arange(t, device=ctx.device) % ctx.shape.get("seq", DEFAULTS["seq"])
    cos, sin = K.rope_cos_sin(pos, d, 1e6)
    q, k = rand(ctx, t, hq, d), rand(ctx, t, hk, d)

    def liger():
        # lazy: Liger-Kernel is an optional baseline, imported only when its row runs
        from liger_kernel.transformers.functional import liger_rope

        def fn(q, k, cos, sin):  # Liger wants [B, H, S, D] and cos/sin [1, S, D]
            qo, ko = liger_rope(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), cos[None], sin[None])
            return qo.transpose(1, 2)[0], ko.transpose(1, 2)[0]

        return fn

    cands = _candidates(ctx, K.apply_rope, rope_ref, [q, k, cos, sin], {0, 1}, liger)
    moved = 2 * (2 * t * (hq + hk) * d * e + 2 * t * d * 4)  # fwd and bwd: q, k in and out + cos/sin (fp32)
    return [Case("rope", f"fwd+bwd T={t} Hq={hq} Hk={hk} D={d}", cands, moved, target=_bw_target(0.85),
                 extra={"impl": impl_name("rope", q)}, graph=True)]  # fmt: skip


def _sdpa(q, k, v, lens: list[int], causal: bool = True, backend: str = "FLASH_ATTENTION"):
    """SDPA (``backend`` on CUDA, math elsewhere) on padded [B, H, L, D] built from packed q/k/v."""
    b, lmax = len(lens), max(lens)

    def pad(x):
        if all(n == lmax for n in lens):
            return x.view(b, lmax, *x.shape[1:]).transpose(1, 2)
        out = x.new_zeros(b, lmax, *x.shape[1:])
        start = 0
        for i, n in enumerate(lens):
            out[i, :n] = x[start : start + n]
            start += n
        return out.transpose(1, 2)

    backends = [getattr(SDPBackend, backend)] if q.device.type == "cuda" else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        return F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=causal, enable_gqa=True)


def _attention_case(ctx: Ctx, lens: list[int], label: str) -> Case:
    hq, hk, d, t = ctx.shape["hq"], ctx.shape["hk"], ctx.shape["d"], sum(lens)
    q, k, v = rand(ctx, t, hq, d), rand(ctx, t, hk, d), rand(ctx, t, hk, d)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    cu = cu.to(ctx.device)
    args = [q, k, v]
    chosen = impl_name("attention", q)
    cands = [
        candidate(
            "polyrl", lambda: fwd_bwd(lambda q, k, v: K.varlen_attention(q, k, v, cu, max(lens)), args, {0, 1, 2})
        )
    ]
    cands.append(candidate("sdpa_flash", lambda: fwd_bwd(lambda q, k, v: _sdpa(q, k, v, lens), args, {0, 1, 2})))
    if ctx.device.type == "cuda":
        cudnn = lambda q, k, v: _sdpa(q, k, v, lens, backend="CUDNN_ATTENTION")  # noqa: E731
        cands.append(candidate("sdpa_cudnn", lambda: fwd_bwd(cudnn, args, {0, 1, 2})))
        if chosen != "triton":  # what the registry would run without the fast path, for comparison

            def triton_only(q, k, v):
                return registry.load("attention", "triton")(q, k, v, cu, max(lens))

            cands.append(candidate("polyrl_triton", lambda: fwd_bwd(triton_only, args, {0, 1, 2})))
    if "eager" in ctx.baselines:
        cands.append(
            candidate("eager", lambda: fwd_bwd(lambda q, k, v: attention_ref(q, k, v, cu, max(lens)), args, {0, 1, 2}))
        )
    flops = sum(7.0 * hq * d * n * n for n in lens)  # causal fwd (2 L^2 D H) + bwd (2.5x)

    def target(rows, ctx):
        p, s = rows.get("polyrl", {}).get("ms"), rows.get("sdpa_flash", {}).get("ms")
        return "time <= SDPA flash", (None if p is None or s is None else p <= s)

    impl = {"impl": chosen}
    return Case("attention", label, cands, flops=flops, target=target, extra=impl, base="sdpa_flash")


@bench("attention")
def bench_attention(ctx: Ctx) -> list[Case]:
    seq = min(ctx.shape.get("seq", DEFAULTS["seq"]), ctx.tokens)
    even = [seq] * max(1, ctx.tokens // seq)
    pattern = [seq, seq // 4, seq // 2, seq // 8, 3 * seq // 4, seq // 16]
    mixed: list[int] = []
    while sum(mixed) < ctx.tokens:
        mixed.append(max(1, min(pattern[len(mixed) % len(pattern)], ctx.tokens - sum(mixed))))
    return [
        _attention_case(ctx, even, f"fwd+bwd causal {len(even)}x{seq} D={ctx.shape['d']}"),
        _attention_case(ctx, mixed, f"fwd+bwd varlen mixed {len(mixed)} seqs (SDPA padded to {max(mixed)})"),
    ]


@bench("paged_attention")
def bench_paged(ctx: Ctx) -> list[Case]:
    b, c = ctx.shape.get("batch", DEFAULTS["batch"]), ctx.shape.get("ctx", DEFAULTS["ctx"])
    hq, hk, d, bs = ctx.shape["hq"], ctx.shape["hk"], ctx.shape["d"], 16
    nblk = b * (c // bs + 1)
    kc, vc = rand(ctx, nblk, bs, hk, d), rand(ctx, nblk, bs, hk, d)
    tables = torch.randperm(nblk, device=ctx.device)[: b * (c // bs + 1)].view(b, -1).to(torch.int32)
    lens = torch.full((b,), c, dtype=torch.int32, device=ctx.device)
    cu = torch.arange(b + 1, dtype=torch.int32, device=ctx.device)
    q = rand(ctx, b, hq, d)
    kd, vd = rand(ctx, b, hk, c, d), rand(ctx, b, hk, c, d)

    def dense(q, kd, vd):
        return F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, enable_gqa=True)

    cands = [
        candidate("polyrl", lambda: forward_only(lambda q: K.paged_attention(q, kc, vc, tables, lens, cu, 1), [q]))
    ]
    cands.append(candidate("sdpa_dense", lambda: forward_only(dense, [q, kd, vd])))
    if "eager" in ctx.baselines:
        cands.append(
            candidate("eager", lambda: forward_only(lambda q: paged_attention_ref(q, kc, vc, tables, lens, cu, 1), [q]))
        )
    e = torch.finfo(ctx.dtype).bits // 8
    moved = 2 * b * c * hk * d * e + 2 * b * hq * d * e
    return [Case("paged_attention", f"decode B={b} ctx={c}", cands, moved, target=_bw_target(0.70),
                 extra={"impl": impl_name("paged_attention", q)}, base="sdpa_dense")]  # fmt: skip


def _loss_target(rows: dict[str, dict[str, Any]], ctx: Ctx) -> tuple[str, bool | None]:
    p, m = rows.get("polyrl", {}), rows.get("materialised", {})
    if p.get("ms") is None or m.get("ms") is None:
        return "mem <= 1/8, time <= 1.1x materialised", None
    ok = p["ms"] <= 1.1 * m["ms"]
    if p.get("peak_bytes") is not None and m.get("peak_bytes"):
        ok = ok and p["peak_bytes"] <= m["peak_bytes"] / 8
    return "mem <= 1/8, time <= 1.1x materialised", ok


@bench("linear_cross_entropy")
def bench_lce(ctx: Ctx) -> list[Case]:
    t, h, v = ctx.tokens, ctx.shape["hidden"], ctx.shape["vocab"]
    hid, w = rand(ctx, t, h), rand(ctx, v, h, scale=h**-0.5)
    labels = torch.randint(0, v, (t,), device=ctx.device)
    labels[::7] = -100

    def materialised(hid, w):
        return F.cross_entropy((hid @ w.t()).float(), labels, ignore_index=-100, reduction="sum")

    def liger():
        # lazy: Liger-Kernel is an optional baseline, imported only when its row runs
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return lambda hid, w: liger_fused_linear_cross_entropy(hid, w, labels, ignore_index=-100, reduction="sum")

    cands = _candidates(
        ctx, lambda hid, w: K.linear_cross_entropy(hid, w, labels), materialised, [hid, w], {0, 1}, liger
    )
    for c in cands:
        c.name = {"eager": "materialised"}.get(c.name, c.name)
    return [Case("linear_cross_entropy", f"fwd+bwd T={t} H={h} V={v}", cands, target=_loss_target,
                 extra={"impl": impl_name("linear_cross_entropy", hid)}, base="materialised")]  # fmt: skip


@bench("token_logprobs")
def bench_tlp(ctx: Ctx) -> list[Case]:
    t, h, v = ctx.tokens, ctx.shape["hidden"], ctx.shape["vocab"]
    hid, w = rand(ctx, t, h), rand(ctx, v, h, scale=h**-0.5)
    tokens = torch.randint(0, v, (t,), device=ctx.device)

    def materialised(hid, w):
        logp = torch.log_softmax((hid @ w.t()).float(), dim=-1)
        return logp.gather(-1, tokens[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    cands = _candidates(ctx, lambda hid, w: K.token_logprobs(hid, w, tokens, 1.0, True), materialised, [hid, w],
                        {0, 1}, None)  # fmt: skip
    for c in cands:
        c.name = {"eager": "materialised"}.get(c.name, c.name)
    return [Case("token_logprobs", f"fwd+bwd +entropy T={t} H={h} V={v}", cands, target=_loss_target,
                 extra={"impl": impl_name("token_logprobs", hid)}, base="materialised")]  # fmt: skip


@bench("sampling")
def bench_sampling(ctx: Ctx) -> list[Case]:
    """Next-token sampling of a rollout decode step: B = min(512, tokens) rows of fp32 logits over the vocab."""
    b, v = min(512, ctx.tokens), ctx.shape["vocab"]
    logits = torch.randn(b, v, device=ctx.device, dtype=torch.float32) * 3
    temps = torch.full((b,), 0.9, device=ctx.device)
    seeds = torch.arange(b, device=ctx.device, dtype=torch.int64) + 1234
    offsets = torch.full((b,), 100, device=ctx.device, dtype=torch.int64)
    greedy = torch.zeros(b, dtype=torch.bool, device=ctx.device)
    gens = [torch.Generator(device=ctx.device).manual_seed(i) for i in range(b)]
    seqs = [Sequence(i, "r", i, [0], SamplingParams(temperature=0.9, seed=i)) for i in range(b)]

    def old_style(per_row_generators: bool):
        # The pre-kernel sampler: log_softmax for the report, softmax, Exp(1) noise (one torch.Generator per
        # seeded row), exponential race, gather.
        def run():
            z = logits / temps[:, None]
            report = torch.log_softmax(z, dim=-1)
            probs = torch.softmax(z, dim=-1)
            noise = torch.empty_like(probs).exponential_()
            if per_row_generators:
                for row, g in enumerate(gens):
                    noise[row].exponential_(generator=g)
            tok = (probs / noise).argmax(dim=-1)
            return tok, report.gather(-1, tok[:, None])[:, 0]

        return run

    sampler = Sampler()
    cands = [
        candidate("polyrl", lambda: forward_only(K.sample_tokens, [logits, temps, seeds, offsets, greedy])),
        candidate("polyrl_sampler", lambda: forward_only(lambda: sampler(logits, seqs), [])),
        candidate("old_batched", lambda: forward_only(old_style(False), [])),
        candidate("old_seeded", lambda: forward_only(old_style(True), [])),
    ]

    def target(rows, ctx):
        p, o = rows.get("polyrl", {}).get("ms"), rows.get("old_batched", {}).get("ms")
        return "time <= old batched path", (None if p is None or o is None else p <= o)

    # Batch 1 from the LM head's bf16 logits (what a batch-1 decode graph hands over): one row split over programs.
    one = logits[:1].to(ctx.dtype)
    one_rows = [temps[:1], seeds[:1], offsets[:1], greedy[:1]]
    one_case = Case("sampling", f"decode step B=1 V={v} {str(ctx.dtype).replace('torch.', '')}",
                    [candidate("polyrl", lambda: forward_only(K.sample_tokens, [one, *one_rows]))], bytes_moved=float(
                        one.numel() * one.element_size()), extra={"impl": impl_name("sample_tokens", one)},
                    base="polyrl", graph=True)  # fmt: skip
    # polyrl_sampler: the whole Sampler call (host lists, [B] tensors, kernel, .tolist()) for B seeded rows.
    return [one_case, Case("sampling", f"decode step B={b} V={v} fp32, all rows seeded", cands, bytes_moved=4.0 * b * v,
                 target=target, extra={"impl": impl_name("sample_tokens", logits)}, base="old_seeded")]  # fmt: skip


@bench("skinny_linear")
def bench_skinny_linear(ctx: Ctx) -> list[Case]:
    """The decode step's projections at batch 1 and 8 (weights read once): ``skinny_linear`` against cuBLAS
    (``F.linear``), both also timed as graph replays (the decode graph's device time)."""
    h, inter, hq, hk, d = (ctx.shape[k] for k in ("hidden", "inter", "hq", "hk", "d"))
    shapes = {"q": (hq * d, h), "kv": (hk * d, h), "o": (h, hq * d), "gate/up": (inter, h), "down": (h, inter)}
    e = torch.finfo(ctx.dtype).bits // 8
    cases = []
    for rows in (1, 8):
        for name, (n, k) in shapes.items():
            x, w = rand(ctx, rows, k), rand(ctx, n, k, scale=k**-0.5)
            cands = [candidate("polyrl", lambda x=x, w=w: forward_only(lambda: K.skinny_linear(x, w), []))]
            cands.append(candidate("cublas", lambda x=x, w=w: forward_only(lambda: F.linear(x, w), [])))
            cases.append(Case("skinny_linear", f"{name} M={rows} N={n} K={k}", cands, bytes_moved=float(n * k * e),
                              target=_bw_target(0.5), extra={"impl": impl_name("skinny_linear", x)}, base="cublas",
                              graph=True))  # fmt: skip
    return cases


@bench("fp8")
def bench_fp8(ctx: Ctx) -> list[Case]:
    """FP8 training pieces at the preset's widths: the current-scaling cast of an activation ``[tokens, hidden]``
    (tensor-wise, row-wise, and the fused cast that also writes the transposed copy, ``fp8_quantize_t``, against the
    reference + ``.t().contiguous()``) in eager and compiled torch; one decoder projection (``hidden -> inter``, the
    gate/up shape) forward + backward as ``fp8_linear`` (three FP8 GEMMs plus the casts, ``models/fp8_linear.py``:
    fused casts, saved transposed copies, the gradient cast with a delayed scale as ``Fp8Linear`` runs it), with
    the gradient's current scale instead (``current-grad``), as ``fp8_linear_unfused`` (the earlier composition:
    separate casts, transposes copied, the weight re-cast in the backward), and with fast accumulation in the
    gradient GEMMs too, against the bf16 ``F.linear`` it replaces; the gate + up pair reading one input (quantised
    once by the fused path) against two bf16 linears; and the gradient's cast alone (``e5m2 delayed+t``: one pass)
    against its current-scaling cast (amax pass + cast). Every case is also timed as a CUDA-graph replay (device
    time)."""
    # lazy: the FP8 linear lives in models (bench may import anything; the kernels bench needs it only here)
    from polyrl.kernels.fp8 import AmaxState, fp8_quantize_t, fp8_quantize_t_delayed
    from polyrl.kernels.fp8.reference import quantize as quantize_ref
    from polyrl.kernels.fp8.reference import quantize_t as quantize_t_ref
    from polyrl.models import fp8_linear as fl

    t, h, inter = ctx.tokens, ctx.shape["hidden"], ctx.shape["inter"]
    e = torch.finfo(ctx.dtype).bits // 8
    x = rand(ctx, t, h)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    cases = []
    for rowwise in (False, True):
        cands = _candidates(
            ctx, lambda x, r=rowwise: K.fp8_quantize(x, e4m3, r), lambda x, r=rowwise: quantize_ref(x, e4m3, r), [x],
            None, None,
        )  # fmt: skip
        label = "rowwise" if rowwise else "tensorwise"
        cases.append(Case("fp8_quantize", f"{label} T={t} H={h} e4m3", cands, bytes_moved=float(t * h * (e + 1)),
                          extra={"impl": impl_name("fp8_quantize", x)}, graph=True))  # fmt: skip
    for rowwise in (False, True):
        cands = _candidates(
            ctx, lambda x, r=rowwise: fp8_quantize_t(x, e4m3, r), lambda x, r=rowwise: quantize_t_ref(x, e4m3, r),
            [x], None, None,
        )  # fmt: skip
        label = "rowwise+t" if rowwise else "tensorwise+t"
        # bytes: one read of x for the cast (the amax read is the price of current scaling) and two fp8 writes
        cases.append(Case("fp8_quantize_t", f"{label} T={t} H={h} e4m3", cands, bytes_moved=float(t * h * (e + 2)),
                          extra={"impl": impl_name("fp8_quantize_t", x)}, graph=True))  # fmt: skip
    # the gradient's cast: e5m2 with the transposed copy, current (amax pass + cast) against delayed (one pass with
    # the previous call's amax; what ``Fp8Linear`` runs on dY); the shape of the gate/up projections' dY
    g = rand(ctx, t, inter)
    state = AmaxState(g.device)
    cands = [
        candidate("polyrl", lambda: forward_only(lambda: fp8_quantize_t_delayed(g, e5m2, state, 16), [])),
        candidate("current", lambda: forward_only(lambda: fp8_quantize_t(g, e5m2, False, 16), [])),
    ]
    cases.append(Case("fp8_quantize_t", f"e5m2 delayed+t T={t} N={inter}", cands,
                      bytes_moved=float(t * inter * (e + 2)), base="current",
                      extra={"impl": impl_name("fp8_quantize_t_delayed", g)}, graph=True))  # fmt: skip
    w = rand(ctx, inter, h, scale=h**-0.5)
    w2 = rand(ctx, inter, h, scale=h**-0.5)

    def fast_grad(x, w, r, st):
        old, fl.GRAD_FAST_ACCUM = fl.GRAD_FAST_ACCUM, True
        try:
            return fl.fp8_linear(x, w, None, r, grad_amax=st)  # the flag is read in the forward, kept for the backward
        finally:
            fl.GRAD_FAST_ACCUM = old

    impl = impl_name("fp8_scaled_mm", x[:1].to(e4m3))
    for rowwise in (False, True):
        label = "rowwise" if rowwise else "tensorwise"
        st = AmaxState(x.device)  # "polyrl": as ``Fp8Linear`` runs (delayed gradient scale); "current-grad": without
        cands = [
            candidate(
                "polyrl",
                lambda r=rowwise, st=st: fwd_bwd(
                    lambda x, w: fl.fp8_linear(x, w, None, r, grad_amax=st), [x, w], {0, 1}
                ),
            ),  # fmt: skip
            candidate(
                "current-grad", lambda r=rowwise: fwd_bwd(lambda x, w: fl.fp8_linear(x, w, None, r), [x, w], {0, 1})
            ),
            candidate(
                "unfused", lambda r=rowwise: fwd_bwd(lambda x, w: fl.fp8_linear_unfused(x, w, None, r), [x, w], {0, 1})
            ),  # fmt: skip
            candidate(
                "fast-grad",
                lambda r=rowwise, st=AmaxState(x.device): fwd_bwd(lambda x, w: fast_grad(x, w, r, st), [x, w], {0, 1}),
            ),  # fmt: skip
            candidate("bf16", lambda: fwd_bwd(F.linear, [x, w], {0, 1})),
        ]
        cases.append(Case("fp8_linear", f"{label} fwd+bwd T={t} {h}->{inter}", cands, flops=6.0 * t * h * inter,
                          base="bf16", extra={"impl": impl}, graph=True))  # fmt: skip
    pair = [x, w, w2]
    sa, sb = AmaxState(x.device), AmaxState(x.device)
    cands = [
        candidate("polyrl", lambda: fwd_bwd(lambda x, a, b: (fl.fp8_linear(x, a, None, grad_amax=sa),
                                                        fl.fp8_linear(x, b, None, grad_amax=sb)), pair, {0, 1, 2})),
        candidate("unfused", lambda: fwd_bwd(lambda x, a, b: (fl.fp8_linear_unfused(x, a, None),
                                                         fl.fp8_linear_unfused(x, b, None)), pair, {0, 1, 2})),
        candidate("bf16", lambda: fwd_bwd(lambda x, a, b: (F.linear(x, a), F.linear(x, b)), pair, {0, 1, 2})),
    ]  # fmt: skip
    cases.append(Case("fp8_linear", f"gate+up pair tensorwise fwd+bwd T={t} {h}->2x{inter}", cands,
                      flops=12.0 * t * h * inter, base="bf16", extra={"impl": impl}, graph=True))  # fmt: skip
    return cases


# --- running and printing ----------------------------------------------------------------------------


def measure_case(case: Case, ctx: Ctx) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for cand in case.candidates:
        row: dict[str, Any] = {"op": case.op, "case": case.case, "impl": cand.name, "skip": cand.skip}
        if cand.run is not None:
            try:
                row["ms"] = common.time_fn(cand.run, ctx.device, ctx.warmup, ctx.reps)["median_ms"]
                row["peak_bytes"] = common.peak_memory(cand.run, ctx.device)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory in a baseline
                row["skip"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                row.pop("ms", None)
                common.dev.empty_cache()
            if case.graph and ctx.graphs and row.get("ms") is not None:
                timed = common.time_graph(cand.run, ctx.device, ctx.warmup, ctx.reps)
                row["graph_ms"] = timed.get("median_ms")
                row["graph_error"] = timed.get("error", "")
        rows[cand.name] = row
    eager_ms = rows.get(case.base, {}).get("ms")
    for row in rows.values():
        ms = row.get("ms")
        if ms is None:
            continue
        if case.bytes_moved:
            row["tb_per_s"] = case.bytes_moved / (ms * 1e-3) / 1e12
            row["pct_copy_bw"] = 100 * case.bytes_moved / (ms * 1e-3) / ctx.copy_bw
            gms = row.get("graph_ms")
            if gms:
                row["graph_tb_per_s"] = case.bytes_moved / (gms * 1e-3) / 1e12
                row["graph_pct_copy_bw"] = 100 * case.bytes_moved / (gms * 1e-3) / ctx.copy_bw
        if case.flops:
            row["tflops"] = case.flops / (ms * 1e-3) / 1e12
            if row.get("graph_ms"):
                row["graph_tflops"] = case.flops / (row["graph_ms"] * 1e-3) / 1e12
        row["peak_gib"] = common.gib(row.get("peak_bytes"))
        row["speedup_vs_base"] = eager_ms / ms if eager_ms else None
    if case.target is not None and "polyrl" in rows:
        text, met = case.target(rows, ctx)
        rows["polyrl"]["target"] = text
        rows["polyrl"]["met"] = {True: "yes", False: "NO", None: "-"}[met]
        rows["polyrl"]["dispatch"] = case.extra.get("impl")
    return list(rows.values())


COLUMNS = (
    "op",
    "case",
    "impl",
    "ms",
    "tb_per_s",
    "pct_copy_bw",
    "graph_ms",
    "graph_tb_per_s",
    "graph_pct_copy_bw",
    "tflops",
    "graph_tflops",
    "peak_gib",
    "speedup_vs_base",
    "target",
    "met",
)
HEADERS = ("op", "case", "impl", "ms", "TB/s", "%copy", "graph ms", "graph TB/s", "graph %copy", "TFLOP/s",
           "graph TFLOP/s", "peak GiB", "x base", "target", "met")  # fmt: skip
# "x base": the case's base time / this time (> 1 is faster than the base: eager, SDPA or materialised); eager
# times. "graph ...": the same fwd+bwd replayed from a CUDA graph (device time without Python/launch overhead).


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(PRESETS), help="model dimensions (default: qwen3-0.6b; tiny on CPU)")
    parser.add_argument("--tokens", type=int, help="tokens per op (default: 16384; 64 on CPU)")
    parser.add_argument("--ops", default="", help=f"comma list (default: all): {', '.join(BENCHES)}")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--baselines", default=",".join(BASELINES), help="comma list of eager,compile,liger")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per candidate (median reported)")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replay timing of elementwise ops")
    parser.add_argument("--json", metavar="FILE", help="write all rows and device facts as JSON")


def run(args: argparse.Namespace) -> int:
    device = dev.torch_device()
    on_cpu = device.type == "cpu"
    preset = args.shape or ("tiny" if on_cpu else "qwen3-0.6b")
    shape = {**DEFAULTS, **PRESETS[preset]}
    tokens = args.tokens or (64 if on_cpu else 16384)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] or list(BENCHES)
    unknown = [o for o in ops if o not in BENCHES]
    if unknown:
        raise ConfigError(f"unknown op(s) {unknown} for --ops; choose from {', '.join(BENCHES)}")
    baselines = {b.strip() for b in args.baselines.split(",") if b.strip()}
    if baselines - set(BASELINES):
        raise ConfigError(f"--baselines takes a comma list of {', '.join(BASELINES)}, got {args.baselines!r}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    copy_bw = common.measure_copy_bandwidth(device)
    mm = common.measure_matmul_flops(device)
    print(f"device: {dev.name()} ({device.type}); copy bandwidth {copy_bw / 1e9:.1f} GB/s (read+write); "
          f"matmul {mm / 1e12:.2f} TFLOP/s; shape {preset}, {tokens} tokens, {args.dtype}")  # fmt: skip
    graphs = not getattr(args, "no_graphs", False) and dev.supports_graphs()
    ctx = Ctx(device, dtype, shape, tokens, baselines, copy_bw, reps=args.reps, graphs=graphs)
    rows: list[dict[str, Any]] = []
    for op in ops:
        for case in BENCHES[op](ctx):
            rows.extend(measure_case(case, ctx))
            del case
            dev.empty_cache()
    common.print_table(rows, COLUMNS, HEADERS)
    for row in rows:
        if row.get("skip"):
            print(f"  skipped {row['op']}/{row['impl']}: {row['skip']}")
        if row.get("graph_error"):
            print(f"  no graph timing for {row['op']}/{row['impl']}: {row['graph_error']}")
        if row.get("dispatch"):
            print(f"  {row['op']} [{row['case']}]: polyrl dispatched to '{row['dispatch']}'")
    if args.json:
        facts = {"device": dev.name(), "device_type": device.type, "copy_bw_bytes_per_s": copy_bw, "matmul_flops": mm,
                 "shape": preset, "tokens": tokens, "dtype": args.dtype}  # fmt: skip
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"facts": facts, "rows": rows}, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


# the MoE cases, registered after the others (the default order of --ops)
from polyrl.bench import kernels_moe as _kernels_moe  # noqa: E402,F401  isort: skip
