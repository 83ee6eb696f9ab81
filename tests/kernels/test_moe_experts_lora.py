"""moe_experts_lora: the reference (``moe_experts`` on the materialised ``W + s B @ A``) against a per-token closed
form, and the Triton path (each adapter's rank-r product a second K segment of its grouped GEMM; no ``W'``, no
base weight gradient) against the reference in fp64: the output and the gradients of x, the routing weights and
the four adapter factors, with adapters on both projections or on one, awkward routings (experts without tokens,
k = 1, T = 1), ranks that do not fill a tile, non-contiguous adapters (PEFT's layout viewed as [E, out, r]), no
host reads, and the base refused when it asks for a gradient; LoraExperts (fp32 PEFT-layout Parameters, a bf16
base) through the Triton path. On the GPU: a Qwen3-30B-A3B-like shape in bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyrl.errors import UserError
from polyrl.kernels import registry
from polyrl.kernels.moe_lora.reference import moe_experts_lora as ref_lora

NAMES = ("y", "dx", "dtopk_weights", "dgate_up_a", "dgate_up_b", "ddown_a", "ddown_b")


def _problem(t, h, inter, e, k, r, dtype, device, seed=0, empty=(), targets=("gate_up", "down")):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    allowed = torch.tensor([i for i in range(e) if i not in empty])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(t)]).to(torch.int32)
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    gu = torch.randn(e, 2 * inter, h, generator=g) * h**-0.5
    dn = torch.randn(e, h, inter, generator=g) * inter**-0.5
    # B is not zero (a trained adapter): each factor's gradient then depends on the other
    ad = {
        "gate_up": (torch.randn(e, r, h, generator=g) * h**-0.5, torch.randn(e, 2 * inter, r, generator=g) * 0.3),
        "down": (torch.randn(e, r, inter, generator=g) * inter**-0.5, torch.randn(e, h, r, generator=g) * 0.3),
    }
    adapters = [v for name in ("gate_up", "down") for v in (ad[name] if name in targets else (None, None))]
    cast = [v.to(device, dtype) if v is not None else None for v in (x, w, gu, dn, *adapters)]
    return cast[0], ids.to(device), cast[1], cast[2], cast[3], cast[4:]


def _fwd_bwd(fn, x, ids, w, gu, dn, adapters, scale, dtype=None, seed=1):
    def leaf(v):
        return None if v is None else v.detach().clone().to(dtype or v.dtype).requires_grad_(True)

    lx, lw = leaf(x), leaf(w)
    la = [leaf(a) for a in adapters]
    base = [v.detach().to(dtype or v.dtype) for v in (gu, dn)]
    y = fn(lx, ids, lw, *base, *la, scale)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(y.device, y.dtype)
    y.backward(dy)
    return [y.detach(), lx.grad, lw.grad] + [None if a is None else a.grad for a in la]


def _check(kernel_check, got, want, dtype, scale=1.0, label=""):
    for name, a, b in zip(NAMES, got, want):
        if b is None:
            assert a is None, f"{label}{name}: a gradient for an absent adapter"
            continue
        assert a is not None and a.dtype == dtype, f"{label}{name}: {None if a is None else a.dtype}"
        kernel_check.assert_close(a, b, dtype, f"{label}{name}", scale)


def test_reference_matches_per_token_closed_form():
    x, ids, w, gu, dn, (ga, gb, da, db) = _problem(5, 12, 6, 4, 2, 3, torch.float64, "cpu", seed=3, empty=(1,))
    s = 0.7
    y = ref_lora(x, ids, w, gu, dn, ga, gb, da, db, s)
    for t in range(5):
        want = torch.zeros(12, dtype=torch.float64)
        for j in range(2):
            e = int(ids[t, j])
            h = (gu[e] + s * gb[e] @ ga[e]) @ x[t]
            act = F.silu(h[:6]) * h[6:]
            want += w[t, j] * ((dn[e] + s * db[e] @ da[e]) @ act)
        torch.testing.assert_close(y[t], want, rtol=1e-12, atol=1e-12)


def test_reference_refuses_a_base_that_wants_a_gradient():
    x, ids, w, gu, dn, ad = _problem(3, 8, 4, 2, 1, 2, torch.float32, "cpu")
    with pytest.raises(UserError, match="frozen LoRA base"):
        ref_lora(x, ids, w, gu.requires_grad_(True), dn, *ad, 1.0)
    with torch.no_grad():  # inference: nothing to refuse
        ref_lora(x, ids, w, gu, dn, *ad, 1.0)


CASES = {
    # name: (T, H, I, E, k, r, empty experts, targets)
    "both": (7, 32, 16, 4, 2, 4, (), ("gate_up", "down")),
    "empty_experts": (9, 32, 24, 6, 2, 8, (0, 3), ("gate_up", "down")),
    "gate_up_only_k1": (5, 48, 16, 3, 1, 16, (), ("gate_up",)),
    "down_only_T1": (1, 32, 16, 8, 4, 5, (), ("down",)),
    "rank_over_a_tile_width": (6, 32, 16, 3, 2, 20, (2,), ("gate_up", "down")),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_forward_and_grads_match_reference(triton_kernels, kernel_check, case, dtype):
    fn = triton_kernels.load("moe_lora", "moe_experts_lora")
    t, h, inter, e, k, r, empty, targets = CASES[case]
    x, ids, w, gu, dn, ad = _problem(t, h, inter, e, k, r, dtype, triton_kernels.device, len(case), empty, targets)
    got = _fwd_bwd(fn, x, ids, w, gu, dn, ad, 0.5)
    want = _fwd_bwd(ref_lora, x, ids, w, gu, dn, ad, 0.5, dtype=torch.float64)
    scale = 2.0 if triton_kernels.interpreted and dtype == torch.bfloat16 else 1.0
    _check(kernel_check, got, want, dtype, scale, f"{case}: ")
    for i in (3, 4, 5, 6):  # an expert without tokens gets zero adapter gradients
        if empty and got[i] is not None:
            assert got[i][list(empty)].abs().max().item() == 0.0, f"{NAMES[i]} of an expert without tokens"


def test_triton_peft_layout_views_and_partial_grads(triton_kernels, kernel_check):
    """The adapters as LoraExperts passes them (views of PEFT's [E*r, in] / [out, E*r] layouts, B permuted, so not
    contiguous) and a backward where x and the routing weights take no gradient."""
    fn = triton_kernels.load("moe_lora", "moe_experts_lora")
    dev = triton_kernels.device
    e, r, h, inter = 4, 4, 32, 16
    x, ids, w, gu, dn, (ga, gb, da, db) = _problem(7, h, inter, e, 2, r, torch.float32, dev, seed=21)
    gb_peft = gb.permute(1, 2, 0).reshape(2 * inter, r * e).clone()  # [out, r*E], rank-major as PEFT stores it
    db_peft = db.permute(1, 2, 0).reshape(h, r * e).clone()
    leaves = [
        v.clone().requires_grad_(True) for v in (ga.reshape(e * r, h), gb_peft, da.reshape(e * r, inter), db_peft)
    ]
    ga_v, gb_v = leaves[0].view(e, r, h), leaves[1].view(2 * inter, r, e).permute(2, 0, 1)
    da_v, db_v = leaves[2].view(e, r, inter), leaves[3].view(h, r, e).permute(2, 0, 1)
    assert not gb_v.is_contiguous() and torch.equal(gb_v, gb)
    y = fn(x, ids, w, gu, dn, ga_v, gb_v, da_v, db_v, 2.0)
    y.sum().backward()
    want = _fwd_bwd(ref_lora, x, ids, w, gu, dn, [ga, gb, da, db], 2.0, dtype=torch.float64)
    kernel_check.assert_close(y, want[0], torch.float32, "y")
    grads = [leaves[0].grad.view(e, r, h), leaves[1].grad.view(2 * inter, r, e).permute(2, 0, 1)]
    grads += [leaves[2].grad.view(e, r, inter), leaves[3].grad.view(h, r, e).permute(2, 0, 1)]
    ones = torch.ones(y.shape, dtype=torch.float64)
    ref_leaves = [v.double().requires_grad_(True) for v in (ga, gb, da, db)]
    ref_lora(x.double(), ids, w.double(), gu.double(), dn.double(), *ref_leaves, 2.0).backward(ones)
    for name, a, b in zip(NAMES[3:], grads, ref_leaves):
        kernel_check.assert_close(a, b.grad, torch.float32, name)


def test_triton_no_routed_token(triton_kernels):
    """T = 0 (an empty micro-batch): an empty output, and zero gradients for every factor."""
    fn = triton_kernels.load("moe_lora", "moe_experts_lora")
    x, ids, w, gu, dn, ad = _problem(2, 32, 16, 4, 2, 4, torch.float32, triton_kernels.device, seed=8)
    got = _fwd_bwd(fn, x[:0], ids[:0], w[:0], gu, dn, ad, 0.5)
    assert got[0].shape == (0, 32) and got[1].shape == (0, 32) and got[2].shape == (0, 2)
    for name, g, a in zip(NAMES[3:], got[3:], ad):
        assert g.shape == a.shape and g.abs().max().item() == 0.0, name


def test_triton_reads_nothing_back_to_the_host_and_is_deterministic(triton_kernels, host_reads):
    fn = triton_kernels.load("moe_lora", "moe_experts_lora")
    x, ids, w, gu, dn, ad = _problem(6, 32, 16, 4, 2, 4, torch.float32, triton_kernels.device, seed=13, empty=(1,))
    runs = []
    for _ in range(2):
        with host_reads() as reads:
            runs.append(_fwd_bwd(fn, x, ids, w, gu, dn, ad, 0.5))
        assert reads.seen == [], f"host reads (a sync; breaks CUDA-graph capture): {reads.seen}"
    for name, a, b in zip(NAMES, *runs):
        assert torch.equal(a, b), f"{name} differs between two identical calls"


def test_triton_rejects_bad_adapters(triton_kernels):
    fn = triton_kernels.load("moe_lora", "moe_experts_lora")
    x, ids, w, gu, dn, (ga, gb, da, db) = _problem(3, 16, 8, 2, 1, 4, torch.float32, triton_kernels.device)
    with pytest.raises(UserError, match="needs both A and B"):
        fn(x, ids, w, gu, dn, ga, None, da, db, 1.0)
    with pytest.raises(UserError, match=r"A \[E, r, in\]"):
        fn(x, ids, w, gu, dn, ga[:, :, :8], gb, da, db, 1.0)
    with pytest.raises(UserError, match="outside 1..128"):
        fn(x, ids, w, gu, dn, ga[:, :0], gb[:, :, :0], None, None, 1.0)
    with pytest.raises(UserError, match="cast them to the compute dtype"):
        fn(x, ids, w, gu, dn, ga.double(), gb.double(), None, None, 1.0)
    with pytest.raises(UserError, match="frozen LoRA base"):
        fn(x, ids, w, gu, dn.clone().requires_grad_(True), ga, gb, da, db, 1.0)


def test_triton_runs_a_rank_above_its_tile_through_the_materialised_path(triton_kernels, kernel_check):
    """The fused path is the default on CUDA, but its rank-r segment is one tile (``MAX_RANK`` 128): a larger
    adapter (r = 160) still trains, through ``W'`` (the materialised path), with the same results."""
    fn = triton_kernels.load("moe_lora", "moe_experts_lora")
    x, ids, w, gu, dn, ad = _problem(4, 16, 8, 2, 1, 160, torch.float32, triton_kernels.device, seed=7)
    got = _fwd_bwd(fn, x, ids, w, gu, dn, ad, 0.5)
    want = _fwd_bwd(ref_lora, x, ids, w, gu, dn, ad, 0.5, dtype=torch.float64)
    _check(kernel_check, got, want, torch.float32, 1.0, "r=160: ")


def test_registry_runs_the_fused_path_first_on_cuda_and_the_materialised_one_elsewhere():
    """The fused path won on the H200 (2.1x the op, +10% LoRA SFT at qwen3-30b-a3b-L8, 10 GiB less peak)."""
    names = {i.name: i for i in registry.implementations("moe_experts_lora")}
    assert names["triton"].devices == {"cuda"}
    assert names["triton"].priority > names["materialized"].priority > names["reference"].priority
    assert registry.select("moe_experts_lora", "cpu", "float32")[0] == "materialized"
    assert registry.select("moe_experts_lora", "cpu", "bfloat16")[0] == "materialized"


def test_materialised_path_equals_the_reference_bit_for_bit_on_the_cpu():
    """On the CPU the materialised path is what LoraExperts always ran: ``W'`` then the moe_experts op (its reference
    here), so the same numbers as the spec, gradients included."""
    from polyrl.kernels.moe_lora.materialized import moe_experts_lora as mat

    x, ids, w, gu, dn, ad = _problem(7, 16, 8, 4, 2, 3, torch.float32, "cpu", seed=4, empty=(2,))
    for a, b in zip(_fwd_bwd(mat, x, ids, w, gu, dn, ad, 0.5), _fwd_bwd(ref_lora, x, ids, w, gu, dn, ad, 0.5)):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_bf16_qwen3_30b_shape_matches_reference(triton_kernels, kernel_check):
    """Qwen3-30B-A3B's expert block (H 2048, I 768, E 128, k 8), 2,048 tokens, rank 16 on both projections."""
    fn = triton_kernels.load("moe_lora", "moe_experts_lora")
    dev = triton_kernels.device
    x, ids, w, gu, dn, ad = _problem(2048, 2048, 768, 128, 8, 16, torch.bfloat16, dev, seed=5)
    got = _fwd_bwd(fn, x, ids, w, gu, dn, ad, 2.0)
    want = _fwd_bwd(ref_lora, x, ids, w, gu, dn, ad, 2.0, dtype=torch.float32)
    _check(kernel_check, got, want, torch.bfloat16)


def test_lora_experts_layer_through_the_fused_op(triton_kernels, kernel_check, monkeypatch):
    """LoraExperts as training runs it (fp32 adapter Parameters in PEFT's layouts, a frozen bf16 base, bf16
    activations) with ``kernels.moe_experts_lora`` bound to the Triton path: the layer hands the op bf16 copies of
    PEFT's views (B permuted) and the gradients land in the fp32 Parameters as the fp64 spec gives them; a base that
    requires grad, or a merged adapter, does not take the fused op."""
    from polyrl import kernels
    from polyrl.models.lora.experts import LoraExperts
    from polyrl.models.moe import Experts

    fn = triton_kernels.load("moe_lora", "moe_experts_lora")
    calls = []

    def fused(*args):
        calls.append(args)
        return fn(*args)

    monkeypatch.setattr(kernels, "moe_experts_lora", fused)
    e, h, inter, r, t, k, s = 4, 32, 16, 4, 9, 2, 2.0
    g = torch.Generator().manual_seed(31)
    base = Experts(e, h, inter)
    base.reset_parameters(h**-0.5, generator=g)
    layer = LoraExperts(base.to(torch.bfloat16).requires_grad_(False), ["gate_up_proj", "down_proj"], r, s)
    layer.reset_adapter(g)
    with torch.no_grad():
        for name in layer.targets:
            layer.lora_B[name].normal_(0.0, 0.3, generator=g)
    dev = triton_kernels.device
    layer.to(dev)
    x = torch.randn(t, h, generator=g).to(dev, torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
    w = torch.softmax(torch.randn(t, k, generator=g), -1).to(dev, torch.bfloat16)
    dy = torch.randn(t, h, generator=g).to(dev, torch.bfloat16)
    layer(x, ids, w).backward(dy)
    assert len(calls) == 1
    # the spec in fp64 on the same Parameters
    ref = {f"{n}.{p}": getattr(layer, f"lora_{p}")[n].detach().double().requires_grad_(True) for n in layer.targets
           for p in "AB"}  # fmt: skip
    factors = []
    for name in layer.targets:
        a, b = ref[f"{name}.A"], ref[f"{name}.B"]
        factors += [a.view(e, r, a.shape[1]), b.view(b.shape[0], r, e).permute(2, 0, 1)]
    base64 = [v.detach().double() for v in (layer.gate_up_proj, layer.down_proj)]
    ref_lora(x.double(), ids, w.double(), *base64, *factors, s).backward(dy.double())
    scale = 2.0 if triton_kernels.interpreted else 1.0
    for name in layer.targets:
        for p in "AB":
            got = getattr(layer, f"lora_{p}")[name].grad
            assert got is not None and got.dtype == torch.float32, f"{name}.{p}"
            kernel_check.assert_close(got, ref[f"{name}.{p}"].grad, torch.bfloat16, f"{name}.lora_{p}", scale)
    assert layer.gate_up_proj.grad is None and layer.down_proj.grad is None
    # a base that trains takes moe_experts on adapted(); so does a merged adapter
    layer.gate_up_proj.requires_grad_(True)
    layer(x, ids, w).backward(dy)
    assert len(calls) == 1 and layer.gate_up_proj.grad is not None
    layer.gate_up_proj.requires_grad_(False)
    with torch.no_grad():
        layer.merge(exact=True)
        layer(x, ids, w)
        layer.unmerge()
    assert len(calls) == 1
