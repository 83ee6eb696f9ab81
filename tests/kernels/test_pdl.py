"""Programmatic Dependent Launch (``kernels/pdl.py``, ``POLYRL_PDL``): when it is on (the decision table, with the
device's capability, the backend and Triton's features monkeypatched), that it is off on the CPU and under the
interpreter whatever the variable says, and that a decode-step-like chain of the kernels that take part (GEMM ->
RMSNorm with residual -> GEMM -> qk_norm_rope_cache -> paged attention, both decode kernels and the split combine ->
GEMM -> SwiGLU, both launch shapes) gives the same bits with ``POLYRL_PDL=1`` as without, and the reference's
numbers. On the GPU (``gpu`` marker) the chain is captured in a CUDA graph and replayed after new inputs, PDL on
against PDL off, bit for bit.
"""

from __future__ import annotations

import types

import pytest
import torch

from polyrl.kernels.paged_attention import reference as paged_ref
from polyrl.kernels.qk_norm_rope import reference as qk_ref
from polyrl.kernels.rmsnorm import reference as rms_ref
from polyrl.kernels.rope.reference import rope_cos_sin
from polyrl.kernels.swiglu import reference as swiglu_ref


def _pdl():
    pytest.importorskip("triton", reason="kernels/pdl.py needs triton")
    from polyrl.kernels import pdl

    return pdl


# --- the decision ------------------------------------------------------------------------------


@pytest.fixture
def cuda_hopper(monkeypatch):
    """``pdl`` with every condition but the variable met: not interpreting, Triton has PDL, a 9.0 CUDA device."""
    pdl = _pdl()
    monkeypatch.setattr(pdl, "interpreting", lambda: False)
    monkeypatch.setattr(pdl, "triton_supports_pdl", lambda: True)
    monkeypatch.setattr(pdl, "_capability", lambda dev: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("POLYRL_PDL", "1")
    return pdl


def test_enabled_only_where_every_condition_holds(cuda_hopper, monkeypatch):
    pdl = cuda_hopper
    cuda = torch.device("cuda", 0)
    assert pdl.enabled(cuda) and pdl.enabled("cuda:0")
    assert pdl.launch_options(cuda) == {"launch_pdl": True}
    assert pdl.kernel_kwargs(cuda) == {"PDL": True, "launch_pdl": True}
    assert not pdl.enabled("cpu")  # not a CUDA device
    for cap, on in (((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True), ((12, 1), True), (None, False)):
        monkeypatch.setattr(pdl, "_capability", lambda dev, cap=cap: cap)
        assert pdl.enabled(cuda) is on, cap
    monkeypatch.setattr(pdl, "_capability", lambda dev: (9, 0))
    for value, on in (("0", False), ("", False), ("true", False), ("2", False), (" 1 ", True)):
        monkeypatch.setenv("POLYRL_PDL", value)
        assert pdl.enabled(cuda) is on, repr(value)
    monkeypatch.delenv("POLYRL_PDL")
    assert not pdl.enabled(cuda) and pdl.launch_options(cuda) == {} and pdl.kernel_kwargs(cuda) == {"PDL": False}
    monkeypatch.setenv("POLYRL_PDL", "1")
    monkeypatch.setattr(torch.version, "hip", "6.2.0")  # ROCm: torch calls it "cuda" too
    assert not pdl.enabled(cuda)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(pdl, "triton_supports_pdl", lambda: False)  # an older Triton
    assert not pdl.enabled(cuda)
    monkeypatch.setattr(pdl, "triton_supports_pdl", lambda: True)
    monkeypatch.setattr(pdl, "interpreting", lambda: True)
    assert not pdl.enabled(cuda) and pdl.kernel_kwargs(cuda) == {"PDL": False}


def test_off_inside_torch_compile(cuda_hopper):
    """A launch traced by ``torch.compile`` (the compiled training layers) decides without PDL, in one graph."""
    pdl = cuda_hopper

    @torch.compile(fullgraph=True, backend="eager")
    def traced(x):
        return x + (1 if pdl.kernel_kwargs(torch.device("cuda", 0))["PDL"] else 0)

    assert pdl.enabled("cuda:0")
    torch._dynamo.reset()
    try:
        assert torch.equal(traced(torch.zeros(3)), torch.zeros(3))
    finally:
        torch._dynamo.reset()


def test_off_on_this_machine_without_a_hopper_gpu(monkeypatch):
    """With the variable set the real checks still say no on the CPU and under the interpreter."""
    pdl = _pdl()
    monkeypatch.setenv("POLYRL_PDL", "1")
    assert pdl.requested()
    assert not pdl.enabled("cpu") and pdl.kernel_kwargs(torch.device("cpu")) == {"PDL": False}
    if pdl.interpreting():
        assert not pdl.enabled("cuda:0")
    # this Triton (3.9 here, 3.6 on the H200 machines) has both halves of PDL
    assert pdl.triton_supports_pdl()


def test_the_variable_is_declared():
    from polyrl.platform import envvars

    assert envvars.POLYRL_PDL in envvars.ALL and envvars.POLYRL_PDL.name == "POLYRL_PDL"


# --- what the compiler makes of it (CPU: compiled for sm_90, not run) ---------------------------

# Run in a fresh process: this one interprets Triton (conftest.py), which compiles nothing.
_PTX_SCRIPT = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from polyrl.kernels.paged_attention import decode, triton as paged
from polyrl.kernels.qk_norm_rope import triton as qk
from polyrl.kernels.rmsnorm import triton as rms
from polyrl.kernels.swiglu import triton as sw

def signature(fn, consts, ptrs):
    def kind(a):
        if a in consts:
            return "constexpr"
        if a in ("eps", "qk_scale"):
            return "fp32"
        return ptrs.get(a, "*bf16" if a.endswith("_ptr") or a.isupper() else "i32")
    return {a: kind(a) for a in fn.arg_names}

paged_ptrs = {"BT": "*i32", "CTX": "*i32", "CUQ": "*i32", "OP": "*fp32", "LP": "*fp32"}
attn = dict(GROUP=2, HEAD_DIM=128, PAGE=16, ROWS=16, SPLIT=True, WINDOW=False, DOT_PREC="tf32", F16_DOTS=False)
cases = [
    (sw._flat_fwd_kernel, dict(BLOCK=4096), {}),
    (sw._rows_fwd_kernel, dict(BLOCK_M=4, BLOCK_N=1024), {}),
    (rms._rmsnorm_fwd_kernel, dict(HAS_RESIDUAL=True, BLOCK_M=8, BLOCK_N=1024), {"rstd_ptr": "*fp32"}),
    (qk._qk_norm_rope_cache_kernel, dict(PAGE=16, FP8_MAX=0.0, BLOCK_HQ=16, BLOCK_HK=8, BLOCK_D=64),
     {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "slots_ptr": "*i64"}),
    (decode._paged_decode_kernel, dict(attn, HC=4, BLOCK_N=16), paged_ptrs),
    (decode._combine_splits_kernel, dict(HEAD_DIM=128, SPLITS=4, BLOCK_H=16, BY_SEQ=True, DECODE_ROWS=True),
     paged_ptrs),
    (paged._paged_fwd_kernel, dict(attn, BLOCK_Q=1, BLOCK_N=64, SKIP_DECODE=False), paged_ptrs),
]
report = {}
for fn, consts, ptrs in cases:
    for on in (True, False) if fn is sw._flat_fwd_kernel else (True,):
        c = dict(consts, PDL=on)
        k = triton.compile(ASTSource(fn=fn, signature=signature(fn, c, ptrs), constexprs=c),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": on})
        body = k.asm["ptx"][k.asm["ptx"].index(".entry"):]
        first_access = min(i for i in (body.find("ld.global"), body.find("st.global")) if i >= 0)
        report[f"{fn.__name__}:{on}"] = {
            "wait": body.count("griddepcontrol.wait"),
            "launch": body.count("griddepcontrol.launch_dependents"),
            "wait_first": 0 <= body.find("griddepcontrol.wait") < first_access,
            "launch_pdl": bool(k.metadata.launch_pdl),
        }
print(json.dumps(report))
"""


@pytest.mark.slow  # ~5 s on a cold Triton cache (seven kernels compiled for sm_90 on the CPU), ~2 s warm
def test_the_compiled_kernels_wait_before_their_first_memory_access():
    """Each kernel compiled for sm_90 with ``PDL``: one ``griddepcontrol.wait`` before its first global load or store,
    one ``launch_dependents``, the launch option in the metadata; without it neither instruction (the PTX is then
    the kernel's PTX from before this switch, apart from ``.loc`` line numbers: checked once by hand on Triton 3.9
    against the tree before it, all seven kernels)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pdl = _pdl()
    if not pdl.triton_supports_pdl():
        pytest.skip("this Triton has no PDL")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", _PTX_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(report) == 8
    for name, got in report.items():
        if name.endswith(":True"):
            assert got == {"wait": 1, "launch": 1, "wait_first": True, "launch_pdl": True}, name
        else:
            assert got == {"wait": 0, "launch": 0, "wait_first": False, "launch_pdl": False}, name


# --- the kernels -------------------------------------------------------------------------------


def _inputs(dev, dtype, b, hidden, hq, hk, d, inter, ctx_max, page, seed):
    """One decode step's tensors: ``b`` sequences of one new token over shuffled cache blocks."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)

    ctx = torch.randint(1, ctx_max, (b,), generator=g)
    n_blocks = (ctx + page - 1) // page
    total = int(n_blocks.sum()) + 1
    perm = torch.randperm(total, generator=g)
    tables = torch.full((b, int(n_blocks.max())), total - 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(n_blocks.tolist()):
        tables[i, :n] = perm[used : used + n].int()
        used += n
    last = ctx - 1
    slots = tables[torch.arange(b), last // page].long() * page + last % page
    cos, sin = rope_cos_sin(last, d, 10000.0, dtype=torch.float32)
    t = types.SimpleNamespace(
        src=rand(b, hidden), w_in=rand(hidden, hidden, scale=hidden**-0.5), res=rand(b, hidden),
        w_norm=1 + 0.3 * rand(hidden), w_qkv=rand(hidden, (hq + 2 * hk) * d, scale=hidden**-0.5),
        wq=1 + 0.3 * rand(d), wk=1 + 0.3 * rand(d), cos=cos.to(dev), sin=sin.to(dev),
        kc=rand(total, page, hk, d), vc=rand(total, page, hk, d), tables=tables.to(dev), ctx=ctx.int().to(dev),
        cu=torch.arange(b + 1, dtype=torch.int32, device=dev), slots=slots.to(dev),
        w_gu=rand(hq * d, 2 * inter, scale=(hq * d) ** -0.5), shape=(b, hq, hk, d),
    )  # fmt: skip
    return t


def _step(t, k) -> dict[str, torch.Tensor]:
    """GEMM -> RMSNorm(+residual) -> GEMM -> qk_norm_rope_cache -> paged attention (as the engine calls it, then the
    decode kernel and the general kernel each with two key-range splits and their combine) -> GEMM -> SwiGLU (rows
    and flat)."""
    b, hq, hk, d = t.shape
    x = t.src @ t.w_in  # the producer
    h, s = k.rmsnorm(x, t.w_norm, 1e-6, t.res)
    q, kk, v = (h @ t.w_qkv).split([hq * d, hk * d, hk * d], -1)
    q = k.qk_norm_rope_cache(q.view(b, hq, d), kk.view(b, hk, d), v.view(b, hk, d), t.wq, t.wk, t.cos, t.sin, 1e-6,
                             t.kc, t.vc, t.slots)  # fmt: skip
    attn = k.attention(q, t.kc, t.vc, t.tables, t.ctx, t.cu, None, None)  # as the engine calls it
    attn_heads = k.attention(q, t.kc, t.vc, t.tables, t.ctx, t.cu, 2, {"decode": "heads"})
    attn_rows = k.attention(q, t.kc, t.vc, t.tables, t.ctx, t.cu, 2, {"decode": "rows"})
    gate, up = (attn.flatten(1) @ t.w_gu).chunk(2, -1)  # strided halves: the rows kernel
    y_rows = k.swiglu(gate, up)
    y_flat = k.swiglu(gate.contiguous(), up.contiguous())  # the flat kernel
    return {"h": h, "s": s, "q": q, "kc": t.kc, "vc": t.vc, "attn": attn, "attn_heads": attn_heads,
            "attn_rows": attn_rows,             "y_rows": y_rows, "y_flat": y_flat}  # fmt: skip


def _triton_ops(triton_kernels):
    paged = triton_kernels.load("paged_attention", "_paged_attention")
    return types.SimpleNamespace(
        rmsnorm=triton_kernels.load("rmsnorm"),
        qk_norm_rope_cache=triton_kernels.load("qk_norm_rope", "qk_norm_rope_cache"),
        attention=lambda q, kc, vc, bt, ctx, cu, splits, tuning: paged(
            q, kc, vc, bt, ctx, cu, 1, None, None, splits, tuning
        ),  # fmt: skip
        swiglu=triton_kernels.load("swiglu"),
    )


_REFERENCE = types.SimpleNamespace(
    rmsnorm=rms_ref.rmsnorm,
    qk_norm_rope_cache=qk_ref.qk_norm_rope_cache,
    attention=lambda q, kc, vc, bt, ctx, cu, splits, tuning: paged_ref.paged_attention(q, kc, vc, bt, ctx, cu, 1),
    swiglu=swiglu_ref.swiglu,
)

_TINY = dict(b=3, hidden=32, hq=4, hk=2, d=16, inter=32, ctx_max=20, page=4)


def test_kernels_with_pdl_requested_give_the_same_bits_and_the_reference(triton_kernels, kernel_check, monkeypatch):
    """With ``POLYRL_PDL=1`` the chain runs (without PDL here: the CPU, the interpreter) to exactly the bits of the
    variable unset, and within fp32 tolerance of the reference ops."""
    dev = triton_kernels.device
    ops = _triton_ops(triton_kernels)
    with torch.no_grad():
        monkeypatch.delenv("POLYRL_PDL", raising=False)
        off = _step(_inputs(dev, torch.float32, seed=1, **_TINY), ops)
        monkeypatch.setenv("POLYRL_PDL", "1")
        on = _step(_inputs(dev, torch.float32, seed=1, **_TINY), ops)
        want = _step(_inputs(dev, torch.float32, seed=1, **_TINY), _REFERENCE)
    for name, got in on.items():
        assert torch.equal(got, off[name]), name
        kernel_check.assert_close(got.cpu(), want[name].cpu(), torch.float32, name, scale=4.0)


# --- GPU: captured in a CUDA graph, PDL on against off -------------------------------------------


def _refresh(t) -> None:
    """New values in the inputs the step's producers read (the same values on every call)."""
    g = torch.Generator().manual_seed(99)
    for x in (t.src, t.res):
        x.copy_(torch.randn(x.shape, generator=g).to(x.dtype))


def _eager(t, ops):
    """The step run eagerly twice (as ``_graphed`` runs it once before the capture), the second time over the
    refreshed inputs."""
    _step(t, ops)
    _refresh(t)
    return _step(t, ops)


def _graphed(t, ops, device):
    """The step captured in a CUDA graph (after one eager run that compiles the kernels), then replayed over new
    values of every input the producers read; returns the replay's outputs."""
    graph_cls, graph_ctx = device.graph_api()
    _step(t, ops)
    graph = graph_cls()
    with graph_ctx(graph):
        out = _step(t, ops)
    _refresh(t)
    graph.replay()
    device.synchronize()
    return {k: v.clone() for k, v in out.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("batch,ctx_max", [(256, 300), (4, 2000)])
def test_gpu_graph_with_pdl_equals_without(triton_kernels, monkeypatch, batch, ctx_max):
    """qwen3-0.6b shapes (hidden 1024, 16 / 8 heads of 128, intermediate 3072, page 16) in bf16: at batch 256 the
    decode kernel serves the step, at batch 4 the general kernel with key-range splits and their combine; the replayed
    graph with PDL gives exactly the bits of the graph without it, and of eager runs on the new inputs."""
    from polyrl.platform import device

    pdl = _pdl()
    dev = triton_kernels.device
    monkeypatch.setenv("POLYRL_PDL", "1")
    if triton_kernels.interpreted or device.graph_api() is None or not pdl.enabled(dev):
        pytest.skip("PDL needs a CUDA GPU of compute capability >= 9.0 with CUDA graphs and Triton >= 3.4")
    ops = _triton_ops(triton_kernels)
    shape = dict(b=batch, hidden=1024, hq=16, hk=8, d=128, inter=3072, ctx_max=ctx_max, page=16)
    with torch.inference_mode():
        on = _graphed(_inputs(dev, torch.bfloat16, seed=7, **shape), ops, device)
        monkeypatch.delenv("POLYRL_PDL")
        off = _graphed(_inputs(dev, torch.bfloat16, seed=7, **shape), ops, device)
        eager = _eager(_inputs(dev, torch.bfloat16, seed=7, **shape), ops)
        monkeypatch.setenv("POLYRL_PDL", "1")
        eager_on = _eager(_inputs(dev, torch.bfloat16, seed=7, **shape), ops)
    for name in on:
        assert torch.equal(on[name], off[name]), f"{name}: graph with PDL != graph without"
        assert torch.equal(off[name], eager[name]), f"{name}: graph without PDL != eager"
        assert torch.equal(eager_on[name], eager[name]), f"{name}: eager with PDL != eager without"
