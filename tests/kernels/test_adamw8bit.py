"""8-bit AdamW (kernels/adamw8bit): the codes, quantise/dequantise bounds, the reference update against the fp32
AdamW formula, and the Triton kernel against the reference bit for bit (interpreter on the CPU; CUDA on a GPU)."""

from __future__ import annotations

import pytest
import torch

from polyrl.kernels.adamw8bit import reference as ref
from polyrl.kernels.adamw8bit.reference import BLOCK, StepScalars


def test_codes_sorted_in_unit_range_and_exact_zero_one():
    for code in (ref.SIGNED, ref.UNSIGNED):
        assert code.shape == (256,) and code.dtype == torch.float32
        assert bool((code[1:] >= code[:-1]).all())
        assert code.abs().max().item() == 1.0 and 0.0 in code.tolist() and 1.0 in code.tolist()
    assert torch.equal(ref.SIGNED[:255], -ref.SIGNED[:255].flip(0))  # symmetric; index 255 repeats 1.0
    assert ref.SIGNED[ref.SIGNED_ZERO].item() == 0.0 and ref.UNSIGNED[0].item() == 0.0
    assert len(set(ref.UNSIGNED.tolist())) == 256
    assert ref.UNSIGNED[1].item() == pytest.approx(1e-7)  # 8 decades: sqrt(v) down to 1e-7 of its block max


@pytest.mark.parametrize("n", [1, 7, 256, 257, 1025])
def test_quantize_is_nearest_code_and_roundtrips(n, seeded):
    x = torch.randn(n, generator=seeded) * torch.logspace(-4, 0, n)
    for code, data in ((ref.SIGNED, x), (ref.UNSIGNED, x.abs())):
        mid = ref.midpoints(code)
        q, absmax = ref.quantize(data, code, mid)
        assert q.dtype == torch.uint8 and q.shape == (n,) and absmax.shape == (ref.num_blocks(n),)
        back = ref.dequantize(q, absmax, code)
        scale = absmax.repeat_interleave(BLOCK)[:n]
        best = (data[:, None] / scale[:, None] - code[None, :]).abs().min(1).values * scale
        assert ((back - data).abs() - best).abs().max().item() <= 1e-6 * scale.max().item()
        # each block's absmax element is exact, and requantising the dequantised values is a fixed point
        assert torch.equal(back.abs().max(), data.abs().max())
        q2, a2 = ref.quantize(back, code, mid)
        assert torch.equal(q2, q) and torch.equal(a2, absmax)
    # relative error of the top decade (|x| > absmax / 10): half a step of 0.9 / 64 of the block max
    q, a = ref.quantize(x, ref.SIGNED, ref.midpoints(ref.SIGNED))
    top = x.abs() > a.repeat_interleave(BLOCK)[:n] / 10
    err = (ref.dequantize(q, a, ref.SIGNED) - x).abs()[top]
    assert err.max().item() <= 0.45 / 64 * a.max().item() + 1e-7


def _fp32_adamw(p, g, m, v, t, lr, b1, b2, eps, wd):
    """The textbook AdamW step in float64."""
    p, g, m, v = (x.double() for x in (p, g, m, v))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p * (1 - lr * wd) - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    return p, m, v


def test_reference_first_step_is_adamw_sign_step(seeded):
    # step 1 from zero moments: m = (1-b1) g and v = (1-b2) g^2, so the update is lr * g / (|g| + eps') = lr * sign
    n = 700
    p = torch.randn(n, generator=seeded)
    g = torch.randn(n, generator=seeded)
    st = ref.init_state(n, "cpu")
    p0 = p.clone()
    ref.adamw8bit_step(p, g, st, StepScalars.at(1, 1e-2, 0.9, 0.95, 1e-8, 0.1))
    want, _, _ = _fp32_adamw(p0, g, torch.zeros(n), torch.zeros(n), 1, 1e-2, 0.9, 0.95, 1e-8, 0.1)
    assert (p.double() - want).abs().max().item() < 1e-6
    m = ref.dequantize(st["qm"], st["am"], ref.SIGNED)
    assert torch.allclose(m, 0.1 * g, rtol=0.0, atol=0.45 / 64 * 0.1 * g.abs().max().item() * 1.0001 + 1e-5)


def test_reference_tracks_fp32_adamw_over_steps(seeded):
    n = 3000
    p = torch.randn(n, generator=seeded)
    p32, m32, v32 = p.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    st = ref.init_state(n, "cpu")
    for t in range(1, 31):
        g = torch.randn(n, generator=seeded) * 0.1 + 0.02 * p  # noisy pull towards 0
        ref.adamw8bit_step(p, g, st, StepScalars.at(t, 1e-2, 0.9, 0.999, 1e-8, 0.0))
        p32, m32, v32 = _fp32_adamw(p32, g, m32, v32, t, 1e-2, 0.9, 0.999, 1e-8, 0.0)
    moved = (p32 - p.double().new_tensor(0)).abs().mean()
    # 30 steps of lr 1e-2 move each weight ~0.1-0.3; the 8-bit run stays within a few % of that movement
    diff = (p.double() - p32).abs().mean().item()
    assert diff < 0.02 * moved.item() + 2e-3, (diff, moved.item())


def _case(n: int, dtype: torch.dtype, seed: int, steps: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).to(dtype)
    grads = [(torch.randn(n, generator=g) * torch.logspace(-3, 0, n)).to(dtype) for _ in range(steps)]
    return p, grads


def _assert_bf16_close(a: torch.Tensor, b: torch.Tensor, ulps: int, exact: bool) -> None:
    """Equal on a device; under the interpreter (fp32 -> bf16 truncates) within ``ulps`` bf16 ulps."""
    if exact:
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()
        return
    ulp = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp_min(1e-30)
    assert bool(((a.float() - b.float()).abs() <= ulps * ulp * 2).all()), (a.float() - b.float()).abs().max()


@pytest.mark.parametrize("n", [1, 255, 257, 1025, 3 * BLOCK * 4 + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference_bitwise(triton_kernels, n, dtype):
    """States bit-exact over 3 steps (they never read the weights); fp32 weights bit-exact; bf16 weights (and the bf16
    compute copy of an fp32 master) bit-exact on a device, within a bf16 ulp per step under the interpreter."""
    fn = triton_kernels.load("adamw8bit", "adamw8bit_step")
    dev = triton_kernels.device
    exact = not triton_kernels.interpreted
    steps = 3
    p, grads = _case(n, dtype, n, steps)
    pk, pr = p.clone().to(dev), p.clone().to(dev)
    sk, sr = ref.init_state(n, dev), ref.init_state(n, dev)
    outk = torch.empty(n, dtype=torch.bfloat16, device=dev) if dtype == torch.float32 else None
    outr = torch.empty(n, dtype=torch.bfloat16, device=dev) if dtype == torch.float32 else None
    for t, gr in enumerate(grads, start=1):
        sc = StepScalars.at(t, 3e-3, 0.9, 0.95, 1e-8, 0.1)
        fn(pk, gr.to(dev), sk, sc, outk)
        ref.adamw8bit_step(pr, gr.to(dev), sr, sc, outr)
        for key in ("qm", "am", "qs", "as"):
            assert torch.equal(sk[key], sr[key]), (t, key)
        if dtype == torch.float32:
            assert torch.equal(pk, pr), (pk - pr).abs().max()
            _assert_bf16_close(outk, outr, 1, exact)
        else:
            _assert_bf16_close(pk, pr, 1, exact)
            pk.copy_(pr)  # under the interpreter the truncation error would compound; compare each step alone
    assert (pr.float() - p.float().to(dev)).abs().max() > 0  # it moved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_matches_reference_on_cuda_large():
    from polyrl.kernels.adamw8bit.triton import adamw8bit_step

    n = 4096 * 1024 + 77
    p, grads = _case(n, torch.float32, 1, 4)
    pk, pr = p.cuda(), p.cuda()
    sk, sr = ref.init_state(n, "cuda"), ref.init_state(n, "cuda")
    ok, orf = torch.empty(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    for t, gr in enumerate(grads, start=1):
        sc = StepScalars.at(t, 1e-4, 0.9, 0.95, 1e-8, 0.01)
        adamw8bit_step(pk, gr.cuda(), sk, sc, ok)
        ref.adamw8bit_step(pr, gr.cuda(), sr, sc, orf)
    assert torch.equal(pk, pr) and torch.equal(ok, orf)
    for key in ("qm", "am", "qs", "as"):
        assert torch.equal(sk[key], sr[key]), key


def test_registry_picks_triton_on_cuda_and_the_reference_elsewhere(monkeypatch):
    from polyrl.kernels import registry

    impls = {i.name: i for i in registry.implementations("adamw8bit")}
    assert impls["reference"].supports("cpu", "float32") and impls["reference"].supports("npu", "bfloat16")
    assert impls["triton"].supports("cuda", "bfloat16") and not impls["triton"].supports("cpu", "float32")
    registry.reset_cache()
    assert registry.select("adamw8bit", "cpu", "float32")[0] == "reference"
    monkeypatch.setenv("POLYRL_KERNELS", "adamw8bit:triton")
    with pytest.raises(registry.KernelUnavailable, match="does not support cpu"):
        registry.select("adamw8bit", "cpu", "float32")
    registry.reset_cache()
