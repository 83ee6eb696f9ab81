"""moe_experts: the reference against a per-token closed form, the Triton grouped-GEMM kernel (forward and the
four gradients) against the reference in fp64, awkward routings (experts with no tokens, k=1, k=8, T=1),
non-contiguous inputs, no host reads (CUDA-graph safe), and on the GPU a Qwen3-30B-A3B-like shape and a CUDA
graph replayed with changing routing.

Under the Triton interpreter fp32 -> bf16 conversions truncate (the device rounds to nearest even), which
roughly doubles the bf16 error of a chain of roundings; the bf16 checks allow twice the tolerance there.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyrl.errors import UserError
from polyrl.kernels import registry
from polyrl.kernels.moe.reference import moe_experts as ref_moe

GRAD_NAMES = ("y", "dx", "dtopk_weights", "dgate_up", "ddown")


def _problem(t, h, inter, e, k, dtype, device, seed=0, empty_experts=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    allowed = torch.tensor([i for i in range(e) if i not in empty_experts])
    # k distinct experts per token (as top-k routing gives), drawn from the allowed ones
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(t)]).to(torch.int32)
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    gate_up = torch.randn(e, 2 * inter, h, generator=g) * h**-0.5
    down = torch.randn(e, h, inter, generator=g) * inter**-0.5
    cast = [v.to(device, dtype) for v in (x, w, gate_up, down)]
    return cast[0], ids.to(device), cast[1], cast[2], cast[3]


def _fwd_bwd(fn, x, ids, w, gate_up, down, dtype=None, seed=1):
    leaves = [v.detach().clone().to(dtype or v.dtype).requires_grad_(True) for v in (x, w, gate_up, down)]
    y = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.device, y.dtype)
    y.backward(dy)
    return [y.detach()] + [v.grad for v in leaves]


def _scale(triton_kernels, dtype):
    return 2.0 if triton_kernels.interpreted and dtype == torch.bfloat16 else 1.0


def _check_all(kernel_check, got, want, dtype, scale=1.0, label=""):
    for name, a, b in zip(GRAD_NAMES, got, want):
        assert a is not None, f"{label}{name}: no gradient"
        assert a.dtype == dtype, f"{label}{name}: dtype {a.dtype} != {dtype}"
        kernel_check.assert_close(a, b, dtype, f"{label}{name}", scale)


# --- the reference -------------------------------------------------------------------------------------------


def test_reference_matches_per_token_closed_form():
    x, ids, w, gu, dn = _problem(6, 16, 8, 5, 3, torch.float64, "cpu", seed=3, empty_experts=(2,))
    y = ref_moe(x, ids, w, gu, dn)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (gu[e] @ x[t]).split(8)
            want[t] += w[t, j] * (dn[e] @ (F.silu(g) * u))
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)


def test_reference_gradients_match_autograd_of_the_closed_form():
    x, ids, w, gu, dn = _problem(4, 8, 4, 3, 2, torch.float64, "cpu", seed=4)

    def closed(x, ids, w, gu, dn):
        rows = []
        for t in range(x.shape[0]):
            acc = 0
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                g, u = (gu[e] @ x[t]).split(4)
                acc = acc + w[t, j] * (dn[e] @ (F.silu(g) * u))
            rows.append(acc)
        return torch.stack(rows)

    for a, b, name in zip(_fwd_bwd(ref_moe, x, ids, w, gu, dn), _fwd_bwd(closed, x, ids, w, gu, dn), GRAD_NAMES):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


# --- the Triton kernel ---------------------------------------------------------------------------------------

CASES = {
    # name: (T, H, I, E, k, empty experts)
    "basic": (7, 32, 16, 4, 2, ()),
    "empty_experts": (9, 32, 24, 6, 2, (0, 3, 5)),
    "k1": (5, 48, 16, 3, 1, ()),
    "k8": (6, 32, 16, 10, 8, ()),
    "decode_T1": (1, 64, 32, 16, 8, ()),
    "odd_sizes": (11, 40, 20, 5, 3, (4,)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_forward_and_grads_match_reference(triton_kernels, kernel_check, case, dtype):
    fn = triton_kernels.load("moe", "moe_experts")
    t, h, inter, e, k, empty = CASES[case]
    x, ids, w, gu, dn = _problem(t, h, inter, e, k, dtype, triton_kernels.device, seed=len(case), empty_experts=empty)
    got = _fwd_bwd(fn, x, ids, w, gu, dn)
    want = _fwd_bwd(ref_moe, x, ids, w, gu, dn, dtype=torch.float64)
    _check_all(kernel_check, got, want, dtype, _scale(triton_kernels, dtype), f"{case}: ")
    if empty:
        assert got[3][list(empty)].abs().max().item() == 0.0, "an expert without tokens must get a zero dgate_up"
        assert got[4][list(empty)].abs().max().item() == 0.0, "an expert without tokens must get a zero ddown"


def test_triton_non_contiguous_inputs(triton_kernels, kernel_check):
    """Strided x rows, transposed-then-transposed-back weights, routing from a wider [T, 2k] tensor."""
    fn = triton_kernels.load("moe", "moe_experts")
    dev = triton_kernels.device
    x, ids, w, gu, dn = _problem(7, 32, 16, 5, 2, torch.float32, dev, seed=9)
    x_wide = torch.zeros(7, 64, device=dev)
    x_wide[:, ::2] = x
    ids_wide = torch.zeros(7, 4, dtype=torch.int64, device=dev)
    ids_wide[:, 1::2] = ids
    w_t = w.t().contiguous().t()  # column-major [T, k]
    gu_t = gu.transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2I, H] with H not the inner dim
    dn_t = dn.transpose(1, 2).contiguous().transpose(1, 2)
    assert not (x_wide[:, ::2].is_contiguous() or ids_wide[:, 1::2].is_contiguous() or gu_t.is_contiguous())
    got = _fwd_bwd(fn, x_wide[:, ::2], ids_wide[:, 1::2], w_t, gu_t, dn_t)
    want = _fwd_bwd(ref_moe, x, ids, w, gu, dn, dtype=torch.float64)
    _check_all(kernel_check, got, want, torch.float32)


def test_triton_no_grad_forward_and_partial_grads(triton_kernels, kernel_check):
    """Inference (no autograd) and a backward where only the weights need gradients (frozen x, fixed routing)."""
    fn = triton_kernels.load("moe", "moe_experts")
    x, ids, w, gu, dn = _problem(5, 32, 16, 4, 2, torch.float32, triton_kernels.device, seed=11)
    with torch.no_grad():
        kernel_check.assert_close(fn(x, ids, w, gu, dn), ref_moe(x.double(), ids, w.double(), gu.double(),
                                                                 dn.double()), torch.float32, "no_grad y")  # fmt: skip
    gu_l, dn_l = gu.clone().requires_grad_(True), dn.clone().requires_grad_(True)
    y = fn(x, ids, w, gu_l, dn_l)
    y.sum().backward()
    gu_r, dn_r = gu.double().requires_grad_(True), dn.double().requires_grad_(True)
    ref_moe(x.double(), ids, w.double(), gu_r, dn_r).sum().backward()
    kernel_check.assert_close(gu_l.grad, gu_r.grad, torch.float32, "dgate_up")
    kernel_check.assert_close(dn_l.grad, dn_r.grad, torch.float32, "ddown")


def test_triton_is_deterministic(triton_kernels):
    fn = triton_kernels.load("moe", "moe_experts")
    x, ids, w, gu, dn = _problem(9, 32, 16, 3, 3, torch.float32, triton_kernels.device, seed=12)
    a, b = _fwd_bwd(fn, x, ids, w, gu, dn), _fwd_bwd(fn, x, ids, w, gu, dn)
    for name, p, q in zip(GRAD_NAMES, a, b):
        assert torch.equal(p, q), f"{name} differs between two identical calls"


def test_triton_reads_nothing_back_to_the_host(triton_kernels, host_reads):
    fn = triton_kernels.load("moe", "moe_experts")
    x, ids, w, gu, dn = _problem(6, 32, 16, 4, 2, torch.float32, triton_kernels.device, seed=13, empty_experts=(1,))
    leaves = [v.clone().requires_grad_(True) for v in (x, w, gu, dn)]
    with host_reads() as reads:
        y = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3])
        y.backward(torch.ones_like(y))
    assert reads.seen == [], f"host reads (a sync; breaks CUDA-graph capture): {reads.seen}"
    with host_reads() as reads:
        ref_moe(x, ids, w, gu, dn)
    assert "tolist" in reads.seen, "the probe must see the reference's per-expert counts read back"


def test_triton_rejects_bad_shapes_and_dtypes(triton_kernels):
    fn = triton_kernels.load("moe", "moe_experts")
    x, ids, w, gu, dn = _problem(3, 16, 8, 2, 1, torch.float32, triton_kernels.device)
    with pytest.raises(UserError, match="down"):
        fn(x, ids, w, gu, dn[:, :8])
    with pytest.raises(UserError, match="integer"):
        fn(x, ids.float(), w, gu, dn)
    with pytest.raises(UserError, match="cast the expert weights"):
        fn(x, ids, w, gu.double(), dn)


def test_tile_schedule_covers_every_row_once():
    """The m-tile schedule (host-known grid, device-side expert lookup) visits each expert's rows exactly once
    and points spare tiles at an empty range."""
    pytest.importorskip("triton")
    from polyrl.kernels.moe.triton import _Routing

    ids = torch.tensor([[3, 0], [3, 1], [3, 0], [3, 1], [3, 0]])
    route = _Routing(ids, 5)
    assert route.counts.tolist() == [3, 2, 0, 5, 0]
    expert, row, n_tiles = route.tiles(2)
    assert n_tiles == 5 + 5  # cdiv(10, 2) + min(10, 5)
    seen = []
    for e, r in zip(expert.tolist(), row.tolist()):
        end = route.offsets[e + 1].item()
        if r < end:
            assert route.offsets[e].item() <= r
            seen.extend(range(r, min(r + 2, end)))
        else:
            assert r == 10
    assert sorted(seen) == list(range(10))
    # each sorted row's token really routes to the expert that owns the row
    flat = ids.reshape(-1)
    assert torch.equal(flat[route.order], torch.repeat_interleave(torch.arange(5), route.counts))
    assert torch.equal(route.pos[route.order], torch.arange(10))


def test_registry_declares_triton_for_cuda_and_reference_everywhere():
    names = {i.name: i for i in registry.implementations("moe_experts")}
    assert names["triton"].devices == {"cuda"} and names["triton"].dtypes == {"float32", "bfloat16", "float16"}
    assert names["triton"].priority > names["grouped_mm"].priority > names["reference"].priority
    assert registry.select("moe_experts", "cpu", "float32")[0] == "reference"


def test_grouped_mm_forward_matches_reference(kernel_check):
    """The torch._grouped_mm path (registered for CUDA bf16) on whatever device torch runs it on here."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no _grouped_mm")
    from polyrl.kernels.moe.grouped_mm import moe_experts as gmm

    x, ids, w, gu, dn = _problem(9, 32, 16, 4, 2, torch.bfloat16, "cpu", seed=14, empty_experts=(2,))
    try:
        y = gmm(x, ids, w, gu, dn)
    except RuntimeError as exc:
        pytest.skip(f"torch._grouped_mm does not run on the CPU here: {exc}")
    want = ref_moe(x.double(), ids, w.double(), gu.double(), dn.double())
    kernel_check.assert_close(y, want, torch.bfloat16, "y")


# --- the opt-in TMA variant (polyrl/kernels/moe/tma.py) --------------------------------------------------------


def _moe_module():
    import importlib

    return importlib.import_module("polyrl.kernels.moe.triton")


def _tma_problem(dtype, dev):
    """T*k/E = 48 rows per expert (the TMA path skips decode-sized routings); H, I multiples of 8 (16-byte rows for
    TMA), I=24 not a multiple of the interpreter's BLOCK_K: the K tail and the gate tile reaching into the up block
    are exercised."""
    return _problem(96, 32, 24, 4, 2, dtype, dev, seed=21)


def test_tma_path_gives_the_pointer_kernels_bits_under_the_interpreter(triton_kernels, monkeypatch):
    """With the switch on (device check patched: the interpreter emulates descriptor loads) the forward and all four
    gradients equal the default path's bit for bit, every rows GEMM through the TMA kernel ("dact", which has no
    shipped entry, added: its epilogue through descriptors is checked too)."""
    if not triton_kernels.interpreted:
        pytest.skip("the device comparison is test_gpu_tma_path_matches_the_default_path")
    tk = _moe_module()
    fn = triton_kernels.load("moe", "moe_experts")
    x, ids, w, gu, dn = _tma_problem(torch.bfloat16, triton_kernels.device)
    want = _fwd_bwd(fn, x, ids, w, gu, dn)
    monkeypatch.setattr(tk, "TMA", True)
    monkeypatch.setattr(tk, "_tma_device_ok", lambda device: True)
    monkeypatch.setattr(tk, "TMA_CONFIGS", {**tk.TMA_CONFIGS, "dact": tk.TMA_CONFIGS["up"]})
    before = tk.tma_launches
    got = _fwd_bwd(fn, x, ids, w, gu, dn)
    assert tk.tma_launches - before == 4
    for name, a, b in zip(GRAD_NAMES, got, want):
        assert torch.equal(a, b), f"{name}: max abs diff {(a.float() - b.float()).abs().max().item():.3e}"


def test_tma_switch_is_off_by_default_and_falls_back_where_it_cannot_run(triton_kernels, monkeypatch):
    """Default off; on, it engages only on a CUDA device of capability >= 9.0 outside the interpreter, for 16-bit
    inputs with TMA-addressable strides."""
    tk = _moe_module()
    from polyrl.kernels.moe import tma

    assert tk.TMA is False and set(tk.TMA_CONFIGS) == {"up", "down", "dx"}
    fn = triton_kernels.load("moe", "moe_experts")
    x, ids, w, gu, dn = _tma_problem(torch.bfloat16, triton_kernels.device)
    before = tk.tma_launches
    with torch.no_grad():  # the forward's two rows GEMMs ("up", "down") are enough to see the dispatch
        fn(x, ids, w, gu, dn)
        assert tk.tma_launches == before, "the TMA kernel ran with the switch off"
        if triton_kernels.interpreted:
            monkeypatch.setattr(tk, "TMA", True)
            fn(x, ids, w, gu, dn)
            assert tk.tma_launches == before, "the TMA kernel ran under the interpreter without being asked to"
            assert not tk._tma_device_ok(torch.device("cpu"))
    strides = (gu.stride(0), gu.stride(2), gu.stride(1))
    up = dict(b_up=24 * gu.stride(1), epi=1)
    assert tma.plan(x, True, gu, strides, **up) == (False, 24)
    assert tma.plan(x.float(), True, gu.float(), strides, **up) is None  # fp32
    kn = (dn.stride(0), dn.stride(1), dn.stride(2))
    dys = torch.zeros(5, 32, dtype=torch.bfloat16, device=x.device)
    assert tma.plan(dys, False, dn, kn, b_up=0, epi=2) == (True, 0)
    odd = torch.zeros(4, 20, 12, dtype=torch.bfloat16, device=x.device)  # rows of 24 bytes: not 16-byte aligned
    assert tma.plan(dys, False, odd, (odd.stride(0), odd.stride(1), odd.stride(2)), b_up=0, epi=0) is None
    assert tma.plan(dys[:, 1:], False, dn, kn, b_up=0, epi=0) is None  # A base off 16 bytes
    assert tma.plan(dys, False, dn, (dn.stride(0), 1, 1), b_up=0, epi=0) is None  # neither layout


@pytest.mark.slow  # ~4 s: two kernels compiled for sm_90 on the CPU (cold Triton cache)
def test_tma_kernel_compiles_for_sm90_with_tma_into_wgmma():
    """scripts/moe_tma_compile.py --quick: the "down" GEMM loads A and B by TMA (no cp.async left) into wgmma, within
    the H200's shared memory and without spills; the "up" GEMM's gathered A stays a cp.async pointer load beside its
    TMA-loaded weight tiles."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.tools.tensor_descriptor")
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-W", "ignore", str(repo / "scripts" / "moe_tma_compile.py"), "--quick",
                          "--json"], env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    down = next(v for k, v in report.items() if k.startswith("down:"))
    up = next(v for k, v in report.items() if k.startswith("up:"))
    assert "error" not in down and "error" not in up, report
    assert down["tma_loads"] > 0 and down["wgmma"] > 0 and down["cp_async"] == 0 and down["num_warps"] == 8
    assert down["spill_bytes"] in (0, None), down
    assert up["tma_loads"] > 0 and up["wgmma"] > 0 and up["cp_async"] > 0
    for got in (down, up):
        assert got["shared_bytes"] <= 232448, got  # the H200's 227 KiB per block


# --- GPU ------------------------------------------------------------------------------------------------------


def _qwen3_30b_problem(t, dev, seed=0, weights=True):
    """Qwen3-30B-A3B's expert block: H=2048, I=768, E=128, k=8; routing from a softmax over random logits. The expert
    weights (600M values) are drawn on ``dev`` (a host generator takes seconds for them); ``weights=False`` returns
    None for them (a new routing for the same experts)."""
    h, inter, e, k = 2048, 768, 128, 8
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dev, torch.bfloat16)
    logits = torch.randn(t, e, generator=g).to(dev)
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    if not weights:
        return x, ids, w, None, None
    gd = torch.Generator(device=dev).manual_seed(seed)
    gu = (torch.randn(e, 2 * inter, h, generator=gd, device=dev) * h**-0.5).to(torch.bfloat16)
    dn = (torch.randn(e, h, inter, generator=gd, device=dev) * inter**-0.5).to(torch.bfloat16)
    return x, ids, w, gu, dn


@pytest.mark.gpu
def test_gpu_bf16_qwen3_30b_shape_matches_reference(triton_kernels, kernel_check):
    fn = triton_kernels.load("moe", "moe_experts")
    x, ids, w, gu, dn = _qwen3_30b_problem(4096, triton_kernels.device)
    got = _fwd_bwd(fn, x, ids, w, gu, dn)
    want = _fwd_bwd(ref_moe, x, ids, w, gu, dn, dtype=torch.float32)
    _check_all(kernel_check, got, want, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64])
def test_gpu_cuda_graph_replay_with_changing_routing(triton_kernels, kernel_check, t):
    """Capture the forward once (decode: T=1 and a batch of 64), then change the routing and activations in place
    and replay: the output follows the new routing."""
    fn = triton_kernels.load("moe", "moe_experts")
    dev = triton_kernels.device
    x, ids, w, gu, dn = _qwen3_30b_problem(t, dev, seed=1)
    with torch.no_grad():
        fn(x, ids, w, gu, dn)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(x, ids, w, gu, dn)
        gu32, dn32 = gu.float(), dn.float()
        for seed in (2, 3, 4):
            x2, ids2, w2, _, _ = _qwen3_30b_problem(t, dev, seed=seed, weights=False)
            if seed == 4:  # every token to the same k experts: the other experts get no rows
                ids2 = torch.arange(8, device=dev).repeat(t, 1) * 3
            x.copy_(x2)
            ids.copy_(ids2)
            w.copy_(w2)
            graph.replay()
            torch.cuda.synchronize()
            want = ref_moe(x.float(), ids, w.float(), gu32, dn32)
            kernel_check.assert_close(out, want, torch.bfloat16, f"replay seed {seed}")


@pytest.mark.gpu
def test_gpu_tma_path_matches_the_default_path(triton_kernels, kernel_check, monkeypatch):
    """Qwen3-30B-A3B's shape, bf16, forward and all four gradients: the TMA path (each rows GEMM with a TMA_CONFIGS
    entry) against the pointer kernels on the same inputs (same K order: equal up to wgmma rounding) and against the
    fp32 reference."""
    tk = _moe_module()
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs compute capability 9.0")
    fn = triton_kernels.load("moe", "moe_experts")
    x, ids, w, gu, dn = _qwen3_30b_problem(4096, triton_kernels.device)
    base = _fwd_bwd(fn, x, ids, w, gu, dn)
    monkeypatch.setattr(tk, "TMA", True)
    before = tk.tma_launches
    got = _fwd_bwd(fn, x, ids, w, gu, dn)
    assert tk.tma_launches - before == len(tk.TMA_CONFIGS)
    for name, a, b in zip(GRAD_NAMES, got, base):
        assert kernel_check.rel_l2(a, b) <= 2e-3, f"{name}: TMA vs pointer kernel rel L2 {kernel_check.rel_l2(a, b)}"
    want = _fwd_bwd(ref_moe, x, ids, w, gu, dn, dtype=torch.float32)
    _check_all(kernel_check, got, want, torch.bfloat16, label="tma: ")


def test_triton_saves_only_inputs_and_preactivation(triton_kernels):
    """The backward keeps x, the weights, the routing weights and h [T*k, 2I]: neither act [T*k, I] nor y [T*k, H]
    (d topk_weights comes from act recomputed from h and the unweighted d act; module docstring)."""
    fn = triton_kernels.load("moe", "moe_experts")
    t, hid, inter, e, k = 9, 32, 16, 5, 3
    x, ids, w, gu, dn = _problem(t, hid, inter, e, k, torch.float32, triton_kernels.device, seed=14)
    leaves = [v.clone().requires_grad_(True) for v in (x, w, gu, dn)]
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    assert sorted(saved) == sorted([(t, hid), (t * k,), (e, 2 * inter, hid), (e, hid, inter), (t * k, 2 * inter)])
    y.backward(torch.ones_like(y))  # the backward runs from exactly these
    assert all(v.grad is not None for v in leaves)
