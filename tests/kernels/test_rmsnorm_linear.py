"""rmsnorm_linear: the reference against the unfused ops (rmsnorm -> F.linear -> swiglu), the Triton kernel
against the reference (fp32 and bf16, with and without the residual, both epilogues, ragged M and N tiles)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyrl import kernels
from polyrl.kernels.rmsnorm_linear.reference import rmsnorm_linear as ref_rmsnorm_linear


def _inputs(m, h, n, dtype, residual, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, h, generator=g) * 2).to(device=device, dtype=dtype)
    r = torch.randn(m, h, generator=g).to(device=device, dtype=dtype) if residual else None
    nw = (torch.rand(h, generator=g) + 0.5).to(device=device, dtype=dtype)
    w = (torch.randn(n, h, generator=g) / h**0.5).to(device=device, dtype=dtype)
    return x, r, nw, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
def test_reference_is_the_unfused_composition(dtype, residual, epilogue):
    x, r, nw, w = _inputs(5, 48, 40, dtype, residual)
    y, s = ref_rmsnorm_linear(x, r, nw, w, 1e-5, epilogue)
    if residual:
        h, s_want = kernels.rmsnorm(x, nw, 1e-5, residual=r)
        assert torch.equal(s, s_want) and torch.equal(s, x + r)
    else:
        h, s_want = kernels.rmsnorm(x, nw, 1e-5), None
        assert s is None
    want = F.linear(h, w)
    if epilogue == "swiglu":
        want = kernels.swiglu(want[:, :20], want[:, 20:])
    assert y.dtype == dtype and y.shape == want.shape
    assert torch.equal(y, want)
    # The public op dispatches to the reference on the CPU.
    y2, s2 = kernels.rmsnorm_linear(x, r, nw, w, 1e-5, epilogue)
    assert torch.equal(y2, y) and (s2 is None if s is None else torch.equal(s2, s))


def test_reference_matches_independent_formula():
    x, r, nw, w = _inputs(3, 32, 24, torch.float64, True)
    s = x + r
    h = nw * s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-6)
    y, _ = ref_rmsnorm_linear(x, r, nw, w, 1e-6)
    # fp32 statistics in the rmsnorm spec: fp32-level agreement.
    torch.testing.assert_close(y, h @ w.T, rtol=1e-6, atol=1e-6)
    ys, _ = ref_rmsnorm_linear(x, r, nw, w, 1e-6, "swiglu")
    gu = h @ w.T
    torch.testing.assert_close(ys, F.silu(gu[:, :12]) * gu[:, 12:], rtol=1e-6, atol=1e-6)


def test_rejects_bad_arguments():
    x, r, nw, w = _inputs(4, 16, 10, torch.float32, True)
    with pytest.raises(ValueError, match="epilogue"):
        ref_rmsnorm_linear(x, r, nw, w, 1e-6, "gelu")
    with pytest.raises(ValueError, match="gate rows"):
        ref_rmsnorm_linear(x, r, nw, w[:9], 1e-6, "swiglu")
    with pytest.raises(ValueError, match="must be"):
        ref_rmsnorm_linear(x, r, nw, w[:, :8], 1e-6)
    with pytest.raises(ValueError, match="residual"):
        ref_rmsnorm_linear(x, r[:3], nw, w, 1e-6)


# (M, H, N): M not a multiple of the 16..64-row tiles, N (or I = N / 2) not a multiple of BLOCK_N, H not of BLOCK_K.
SHAPES = [(5, 96, 70), (37, 64, 132), (70, 200, 36)]


def _check(fn, kernel_check, m, h, n, dtype, residual, epilogue, device, tuning=None, scale=1.0):
    x, r, nw, w = _inputs(m, h, n, dtype, residual, device=device, seed=m + n)
    with torch.no_grad():
        y, s = fn(x, r, nw, w, 1e-6, epilogue, **({"tuning": tuning} if tuning else {}))
        y_ref, s_ref = ref_rmsnorm_linear(x, r, nw, w, 1e-6, epilogue)
    assert y.dtype == dtype and y.shape == y_ref.shape
    kernel_check.assert_close(y, y_ref, dtype, f"y {epilogue}", scale=scale)
    if residual and (dtype == torch.float32 or torch.device(device).type != "cpu"):
        assert torch.equal(s, s_ref)  # the same one rounding of the sum
    elif residual:  # the interpreter's bf16 conversion truncates: at most one ulp off
        assert ((s.float() - s_ref.float()).abs() <= s_ref.float().abs() * 2**-7).all()
    else:
        assert s is None
    return y, y_ref


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
def test_triton_fp32_matches_reference(triton_kernels, kernel_check, shape, residual, epilogue):
    fn = triton_kernels.load("rmsnorm_linear")
    _check(fn, kernel_check, *shape, torch.float32, residual, epilogue, triton_kernels.device)


def _bf16(t: torch.Tensor, truncate: bool) -> torch.Tensor:
    """fp32 -> bf16 as the kernel's conversion does: round to nearest even on the device, truncation under the
    interpreter (conftest)."""
    if not truncate:
        return t.bfloat16()
    return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32).bfloat16()


def _rounding_model(x, r, nw, w, eps, epilogue, truncate):
    """The kernel's documented rounding points in plain fp32 torch, with the conversion of ``_bf16``."""
    s = _bf16(x.float() + r.float(), truncate) if r is not None else x
    sf = s.float()
    rstd = torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    a = _bf16(_bf16(sf * rstd, truncate).float() * nw.float(), truncate)
    acc = a.float() @ w.float().T
    if epilogue == "none":
        return _bf16(acc, truncate), s
    inter = w.shape[0] // 2
    g, u = _bf16(acc[:, :inter], truncate).float(), _bf16(acc[:, inter:], truncate).float()
    return _bf16(g * torch.sigmoid(g) * u, truncate), s


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
def test_triton_bf16_matches_reference_and_rounding_points(triton_kernels, kernel_check, residual, epilogue):
    fn = triton_kernels.load("rmsnorm_linear")
    dev = triton_kernels.device
    x, r, nw, w = _inputs(37, 96, 132, torch.bfloat16, residual, device=dev, seed=3)
    with torch.no_grad():
        y, s = fn(x, r, nw, w, 1e-6, epilogue)
    y_ref, s_ref = ref_rmsnorm_linear(x, r, nw, w, 1e-6, epilogue)
    assert y.dtype == torch.bfloat16
    # Under the interpreter every conversion truncates (a bias of about 0.4% each), so against the reference only
    # the dtype's tolerance, doubled for the five conversions in a row of the swiglu path.
    kernel_check.assert_close(y, y_ref, torch.bfloat16, f"y {epilogue}", scale=2.0)
    # The rounding points themselves: a model of them with the same conversion agrees all but bit-exactly (only
    # the fp32 summation order differs, which can move a value across a bf16 boundary: at most one ulp).
    y_model, s_model = _rounding_model(x, r, nw, w, 1e-6, epilogue, truncate=triton_kernels.interpreted)
    if residual:
        assert torch.equal(s, s_model)
        if not triton_kernels.interpreted:
            assert torch.equal(s, s_ref)
    else:
        assert s is None
    d = (y.float() - y_model.float()).abs()
    assert (d == 0).float().mean().item() > 0.9
    # (+ 1e-4: a value near zero by cancellation moves by the fp32 sum's own error, ~1e-6 here)
    assert (d <= y_model.float().abs() * 2**-7 + 1e-4).all()


def test_triton_explicit_tiles_and_strided_input(triton_kernels, kernel_check):
    """Other tiles give the same result; a row-strided x (a column slice of a fused projection) is read in place."""
    fn = triton_kernels.load("rmsnorm_linear")
    dev = triton_kernels.device
    for tuning in ({"block_m": 16, "block_n": 16, "block_k": 32}, {"block_m": 32, "block_n": 64, "block_k": 128}):
        _check(fn, kernel_check, 21, 80, 48, torch.float32, True, "swiglu", dev, tuning)
    x, r, nw, w = _inputs(9, 64, 24, torch.float32, True, device=dev)
    wide = torch.randn(9, 100, device=dev)
    wide[:, 20:84] = x
    with torch.no_grad():
        y, s = fn(wide[:, 20:84], r, nw, w, 1e-6)
    y_ref, s_ref = ref_rmsnorm_linear(x, r, nw, w, 1e-6)
    kernel_check.assert_close(y, y_ref, torch.float32, "y strided")
    assert torch.equal(s, s_ref)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("epilogue", ["none", "swiglu"])
def test_triton_one_pass_experiment_within_tolerance(triton_kernels, kernel_check, epilogue):
    """``tuning["one_pass"]`` (rstd applied to the accumulator, outside the contract's rounding points): fp32 equal
    to the reference to fp32 rounding, bf16 within the dtype's tolerance; new_residual still exact."""
    fn = triton_kernels.load("rmsnorm_linear")
    dev = triton_kernels.device
    _check(fn, kernel_check, 37, 96, 70, torch.float32, True, epilogue, dev, {"one_pass": True, "block_m": 16})
    # (doubled tolerance: the interpreter's truncating conversions, as in the bf16 test above)
    _check(fn, kernel_check, 37, 96, 70, torch.bfloat16, True, epilogue, dev, {"one_pass": True}, scale=2.0)


def test_triton_rejects_mixed_dtypes_and_autograd(triton_kernels):
    fn = triton_kernels.load("rmsnorm_linear")
    x, r, nw, w = _inputs(4, 16, 8, torch.float32, True, device=triton_kernels.device)
    with pytest.raises(ValueError, match="share a dtype"):
        fn(x, r.bfloat16(), nw, w)
    with pytest.raises(ValueError, match="inference-only"):
        fn(x, r, nw, w.requires_grad_(True))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [256, 64])
@pytest.mark.parametrize("n, epilogue", [(4096, "none"), (6144, "swiglu")], ids=["qkv", "gate_up"])
def test_triton_decode_shape_on_gpu(triton_kernels, kernel_check, m, n, epilogue):
    """qwen3-0.6b's decode shapes in bf16: fused q/k/v (N = 4096) and gate/up (2I = 6144, y is [M, 3072])."""
    assert not triton_kernels.interpreted
    fn = triton_kernels.load("rmsnorm_linear")
    y, y_ref = _check(fn, kernel_check, m, 1024, n, torch.bfloat16, True, epilogue, triton_kernels.device)
    # On the device the roundings are the hardware's: all but a few outputs bit-equal or one ulp apart.
    close = (y.float() - y_ref.float()).abs() <= y_ref.float().abs() * 2**-7 + 1e-6
    assert close.float().mean().item() > 0.99
