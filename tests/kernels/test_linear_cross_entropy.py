"""linear_cross_entropy: the reference against torch's materialised cross-entropy, the Triton kernel against
the reference (forward, grad of hidden and weight; interpreter on CPU, compiled on a GPU), and on the GPU the
memory and time targets at Qwen3-0.6B lm-head shape (16k tokens, H 1024, V 151936, bf16)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from _gpu_measure import measure_fwd_bwd

from polyrl.kernels.linear_cross_entropy.reference import linear_cross_entropy as lce_reference

IGNORE = -100


def _inputs(T, V, H, dtype, device, ignore_every=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (1.5 / H**0.5)  # logits of O(1.5): peaked but not one-hot
    labels = torch.randint(0, V, (T,), generator=g)
    if ignore_every:
        labels[::ignore_every] = IGNORE
    to = dict(device=device, dtype=dtype)
    return hidden.to(**to).requires_grad_(), weight.to(**to).requires_grad_(), labels.to(device)


def _reference(hidden, weight, labels, reduction, upstream, ignore_index=IGNORE):
    """Reference value and grads in fp64 on CPU from the same (possibly bf16-rounded) inputs."""
    h = hidden.detach().cpu().double().requires_grad_()
    w = weight.detach().cpu().double().requires_grad_()
    loss = lce_reference(h, w, labels.cpu(), ignore_index, reduction)
    gh, gw = torch.autograd.grad(loss, (h, w), upstream.cpu().double())
    return loss.detach(), gh, gw


def _run(fn, hidden, weight, labels, reduction, upstream, ignore_index=IGNORE):
    loss = fn(hidden, weight, labels, ignore_index, reduction)
    gh, gw = torch.autograd.grad(loss, (hidden, weight), upstream)
    return loss.detach(), gh, gw


def _upstream(reduction, T, device):
    if reduction == "none":
        return torch.randn(T, generator=torch.Generator().manual_seed(7)).to(device)
    return torch.tensor(1.7, device=device)  # non-unit: backward must scale the stored gradients


def _check_against_reference(fn, kernel_check, hidden, weight, labels, reduction, dtype, ignore_index=IGNORE):
    up = _upstream(reduction, hidden.shape[0], hidden.device)
    loss, gh, gw = _run(fn, hidden, weight, labels, reduction, up, ignore_index)
    r_loss, r_gh, r_gw = _reference(hidden, weight, labels, reduction, up, ignore_index)
    assert loss.dtype == torch.float32
    assert gh.dtype == hidden.dtype and gw.dtype == weight.dtype
    kernel_check.assert_close(loss, r_loss, dtype, f"loss[{reduction}]")
    kernel_check.assert_close(gh, r_gh, dtype, f"grad_hidden[{reduction}]")
    kernel_check.assert_close(gw, r_gw, dtype, f"grad_weight[{reduction}]")


# --- reference is the spec: check it against torch on materialised logits -------------------------------


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_reference_matches_materialised_torch(reduction, monkeypatch):
    ref_mod = importlib.import_module("polyrl.kernels.linear_cross_entropy.reference")
    monkeypatch.setattr(ref_mod, "CHUNK_TOKENS", 5)  # several chunks
    hidden, weight, labels = _inputs(13, 50, 8, torch.float64, "cpu", ignore_every=4)
    ours = ref_mod.linear_cross_entropy(hidden, weight, labels, IGNORE, reduction)
    torch_loss = F.cross_entropy(hidden @ weight.t(), labels, ignore_index=IGNORE, reduction=reduction)
    torch.testing.assert_close(ours, torch_loss, rtol=1e-12, atol=1e-12)
    up = torch.randn_like(ours)
    g_ours = torch.autograd.grad(ours, (hidden, weight), up)
    g_torch = torch.autograd.grad(torch_loss, (hidden, weight), up)
    for a, b in zip(g_ours, g_torch):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_reference_all_ignored_mean_is_zero():
    hidden, weight, labels = _inputs(4, 9, 3, torch.float64, "cpu")
    labels.fill_(IGNORE)
    loss = lce_reference(hidden, weight, labels, IGNORE, "mean")
    assert loss.item() == 0.0
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    assert gh.abs().max().item() == 0.0 and gw.abs().max().item() == 0.0


# --- the Triton kernel against the reference ------------------------------------------------------------


@pytest.mark.parametrize(
    "T,V,reduction",
    [
        (1, 1000, "sum"),
        (7, 1025, "mean"),
        (7, 1000, "none"),
        (127, 1025, "sum"),
        (127, 1000, "mean"),
        (127, 1025, "none"),
    ],
)
def test_triton_fp32_matches_reference(T, V, reduction, triton_kernels, kernel_check):
    fn = triton_kernels.load("linear_cross_entropy")
    hidden, weight, labels = _inputs(T, V, 16, torch.float32, triton_kernels.device, ignore_every=3 if T > 1 else 0)
    _check_against_reference(fn, kernel_check, hidden, weight, labels, reduction, torch.float32)


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_triton_several_chunks_and_vocab_blocks(reduction, triton_kernels, kernel_check, monkeypatch):
    """3-row chunks (3 + 3 + 1) with 256-wide vocab blocks over V = 1025 (4 full blocks + 1 column)."""
    fn = triton_kernels.load("linear_cross_entropy")
    tlp = importlib.import_module("polyrl.kernels.token_logprobs.triton")
    T, V = 7, 1025
    monkeypatch.setattr(tlp, "CHUNK_BYTES", 3 * V * 4)
    monkeypatch.setattr(tlp, "MAX_BLOCK_V", 256)
    assert tlp.chunk_rows(T, V, 4) == 3 and tlp.block_config(V)[0] == 256
    hidden, weight, labels = _inputs(T, V, 16, torch.float32, triton_kernels.device, ignore_every=4)
    _check_against_reference(fn, kernel_check, hidden, weight, labels, reduction, torch.float32)


def test_triton_frozen_weight_takes_the_smaller_chunks_and_matches_reference(triton_kernels, kernel_check, monkeypatch):
    """A frozen LM head (LoRA) accumulates no weight gradient, so its chunks follow CHUNK_BYTES_FROZEN_WEIGHT
    (2 rows here) rather than CHUNK_BYTES (all 7); loss and grad_hidden still equal the reference."""
    fn = triton_kernels.load("linear_cross_entropy")
    tlp = importlib.import_module("polyrl.kernels.token_logprobs.triton")
    T, V = 7, 1025
    monkeypatch.setattr(tlp, "CHUNK_BYTES", 64 * V * 4)
    monkeypatch.setattr(tlp, "CHUNK_BYTES_FROZEN_WEIGHT", 2 * V * 4)
    seen = []
    chunks = tlp.logits_chunks
    monkeypatch.setattr(tlp, "logits_chunks", lambda h, w, rows: (seen.append(rows), chunks(h, w, rows))[1])
    hidden, weight, labels = _inputs(T, V, 16, torch.float32, triton_kernels.device, ignore_every=4)
    weight.requires_grad_(False)
    up = _upstream("mean", T, hidden.device)
    loss = fn(hidden, weight, labels, IGNORE, "mean")
    (gh,) = torch.autograd.grad(loss, (hidden,), up)
    r_loss, r_gh, _ = _reference(hidden, weight.detach().requires_grad_(), labels, "mean", up)
    assert seen == [2]
    kernel_check.assert_close(loss, r_loss, torch.float32, "loss")
    kernel_check.assert_close(gh, r_gh, torch.float32, "grad_hidden")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_low_precision_matches_reference(dtype, triton_kernels, kernel_check):
    fn = triton_kernels.load("linear_cross_entropy")
    hidden, weight, labels = _inputs(7, 1025, 32, dtype, triton_kernels.device, ignore_every=3)
    for reduction in ("mean", "none"):
        _check_against_reference(fn, kernel_check, hidden, weight, labels, reduction, dtype)


def test_triton_all_ignored_gives_zero_loss_and_grads(triton_kernels):
    fn = triton_kernels.load("linear_cross_entropy")
    hidden, weight, labels = _inputs(7, 1000, 16, torch.float32, triton_kernels.device)
    labels.fill_(IGNORE)
    for reduction in ("sum", "mean", "none"):
        loss = fn(hidden, weight, labels, IGNORE, reduction)
        gh, gw = torch.autograd.grad(loss.sum(), (hidden, weight))
        assert torch.all(loss == 0), f"{reduction}: {loss}"
        assert gh.abs().max().item() == 0.0 and gw.abs().max().item() == 0.0, reduction


def test_triton_ignore_index_that_is_a_vocab_id(triton_kernels, kernel_check):
    """ignore_index=5 is also a valid token id: rows labelled 5 must be skipped, not scored."""
    fn = triton_kernels.load("linear_cross_entropy")
    hidden, weight, labels = _inputs(7, 1000, 16, torch.float32, triton_kernels.device)
    labels[1] = labels[4] = 5
    for reduction in ("mean", "none"):
        _check_against_reference(fn, kernel_check, hidden, weight, labels, reduction, torch.float32, ignore_index=5)
    per_token = fn(hidden, weight, labels, 5, "none")
    assert per_token[1].item() == 0.0 and per_token[4].item() == 0.0 and per_token[0].item() > 0


def test_triton_out_of_range_label_gives_nan_not_a_wild_read(triton_kernels):
    fn = triton_kernels.load("linear_cross_entropy")
    hidden, weight, labels = _inputs(7, 1000, 16, torch.float32, triton_kernels.device)
    labels[2] = 1000  # == V
    per_token = fn(hidden.detach(), weight.detach(), labels, IGNORE, "none")
    assert torch.isnan(per_token[2]) and torch.isfinite(per_token[[0, 1, 3, 4, 5, 6]]).all()
    assert torch.isnan(fn(hidden.detach(), weight.detach(), labels, IGNORE, "sum"))


def test_triton_no_grad_path_matches_grad_path(triton_kernels):
    fn = triton_kernels.load("linear_cross_entropy")
    hidden, weight, labels = _inputs(7, 1025, 16, torch.float32, triton_kernels.device, ignore_every=3)
    for reduction in ("sum", "mean", "none"):
        with_grad = fn(hidden, weight, labels, IGNORE, reduction)
        with torch.no_grad():
            without = fn(hidden, weight, labels, IGNORE, reduction)
        assert without.grad_fn is None and with_grad.grad_fn is not None
        torch.testing.assert_close(without, with_grad.detach(), rtol=0, atol=0)


def test_triton_one_input_needs_grad_and_retained_graph(triton_kernels):
    """Frozen lm-head (only hidden needs grad) and frozen trunk (only weight); backward twice adds up."""
    fn = triton_kernels.load("linear_cross_entropy")
    hidden, weight, labels = _inputs(7, 1000, 16, torch.float32, triton_kernels.device, ignore_every=3)
    full = torch.autograd.grad(fn(hidden, weight, labels, IGNORE, "mean"), (hidden, weight))
    (gh,) = torch.autograd.grad(fn(hidden, weight.detach(), labels, IGNORE, "mean"), (hidden,))
    (gw,) = torch.autograd.grad(fn(hidden.detach(), weight, labels, IGNORE, "mean"), (weight,))
    torch.testing.assert_close(gh, full[0], rtol=0, atol=0)
    torch.testing.assert_close(gw, full[1], rtol=0, atol=0)
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = fn(h2, w2, labels, IGNORE, "sum")
    loss.backward(retain_graph=True)
    assert loss.grad_fn.acc is not None and loss.grad_fn.grad_h is not None  # kept for the second backward
    loss.backward()
    assert loss.grad_fn.acc is None and loss.grad_fn.grad_h is None  # freed by the last backward, not with the graph
    once = torch.autograd.grad(fn(hidden, weight, labels, IGNORE, "sum"), (hidden, weight))
    torch.testing.assert_close(h2.grad, 2 * once[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w2.grad, 2 * once[1], rtol=1e-6, atol=1e-6)


def test_triton_under_autocast_runs_in_the_autocast_dtype(triton_kernels):
    """fp32 hidden and weight inside autocast(bf16): bf16 matmuls as ``h @ W^T`` would do, fp32 grads back."""
    fn = triton_kernels.load("linear_cross_entropy")
    hidden, weight, labels = _inputs(7, 1000, 16, torch.float32, triton_kernels.device, ignore_every=3)
    h16 = hidden.detach().bfloat16().requires_grad_()
    w16 = weight.detach().bfloat16().requires_grad_()
    for reduction in ("mean", "none"):
        with torch.autocast(triton_kernels.device.type, dtype=torch.bfloat16):
            loss = fn(hidden, weight, labels, IGNORE, reduction)
        gh, gw = torch.autograd.grad(loss.sum(), (hidden, weight))
        expected = fn(h16, w16, labels, IGNORE, reduction)
        e_gh, e_gw = torch.autograd.grad(expected.sum(), (h16, w16))
        assert gh.dtype == torch.float32 and gw.dtype == torch.float32
        torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=0)
        torch.testing.assert_close(gh, e_gh.float(), rtol=0, atol=0)
        torch.testing.assert_close(gw, e_gw.float(), rtol=0, atol=0)


def test_triton_empty_batch(triton_kernels):
    fn = triton_kernels.load("linear_cross_entropy")
    hidden, weight, labels = _inputs(0, 1000, 16, torch.float32, triton_kernels.device)
    for reduction, shape in (("sum", ()), ("mean", ()), ("none", (0,))):
        loss = fn(hidden, weight, labels, IGNORE, reduction)
        assert loss.shape == shape and loss.sum().item() == 0.0
        _, gw = torch.autograd.grad(loss.sum(), (hidden, weight))
        assert gw.abs().max().item() == 0.0


def test_triton_rejects_bad_arguments(triton_kernels):
    fn = triton_kernels.load("linear_cross_entropy")
    hidden, weight, labels = _inputs(3, 10, 4, torch.float32, triton_kernels.device)
    with pytest.raises(ValueError, match="reduction"):
        fn(hidden, weight, labels, IGNORE, "avg")
    with pytest.raises(ValueError, match="hidden"):
        fn(hidden[:, :3], weight, labels, IGNORE, "sum")
    with pytest.raises(ValueError, match="labels|tokens"):
        fn(hidden, weight, labels[:2], IGNORE, "sum")


# --- GPU: real shapes, memory and time targets ----------------------------------------------------------

LLM_TVH = (16384, 151936, 1024)  # Qwen3-0.6B lm head, 16k tokens
PARITY_T = 1536


def _materialised(hidden, weight, labels, ignore_index=IGNORE, reduction="mean"):
    return F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=ignore_index, reduction=reduction)


def _measure(fn, args, iters=5):
    """(extra peak bytes over the inputs, median ms) of fwd + bwd of ``fn(*args)``."""
    return measure_fwd_bwd(lambda: fn(*args), args[0], args[1], iters)


@pytest.mark.gpu
def test_gpu_parity_at_llm_vocab(triton_kernels, kernel_check):
    fn = triton_kernels.load("linear_cross_entropy")
    hidden, weight, labels = _inputs(
        PARITY_T, LLM_TVH[1], LLM_TVH[2], torch.bfloat16, triton_kernels.device, ignore_every=5
    )
    for reduction in ("mean", "none"):
        up = _upstream(reduction, hidden.shape[0], hidden.device)
        loss, gh, gw = _run(fn, hidden, weight, labels, reduction, up)
        h32 = hidden.detach().float().requires_grad_()
        w32 = weight.detach().float().requires_grad_()
        r_loss, r_gh, r_gw = _run(_materialised, h32, w32, labels, reduction, up)
        kernel_check.assert_close(loss, r_loss, torch.bfloat16, f"loss[{reduction}]")
        kernel_check.assert_close(gh, r_gh, torch.bfloat16, f"grad_hidden[{reduction}]")
        kernel_check.assert_close(gw, r_gw, torch.bfloat16, f"grad_weight[{reduction}]")


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_memory_and_time_targets(reduction, triton_kernels):
    """Extra peak <= 1/8 and time <= 1.1x of torch's materialised-logits fwd+bwd (T 16384, H 1024, V 151936)."""
    fn = triton_kernels.load("linear_cross_entropy")
    hidden, weight, labels = _inputs(*LLM_TVH, torch.bfloat16, triton_kernels.device, ignore_every=7)
    if reduction == "none":
        ours_fn = lambda h, w, y: fn(h, w, y, IGNORE, "none").sum()
        torch_fn = lambda h, w, y: _materialised(h, w, y, IGNORE, "none").sum()
    else:
        ours_fn = lambda h, w, y: fn(h, w, y, IGNORE, reduction)
        torch_fn = lambda h, w, y: _materialised(h, w, y, IGNORE, reduction)
    torch_mem, torch_ms = _measure(torch_fn, (hidden, weight, labels))
    ours_mem, ours_ms = _measure(ours_fn, (hidden, weight, labels))
    print(
        f"\nlinear_cross_entropy[{reduction}] T,V,H={LLM_TVH} bf16: torch {torch_ms:.2f} ms "
        f"{torch_mem / 2**30:.2f} GiB extra; triton {ours_ms:.2f} ms {ours_mem / 2**30:.2f} GiB extra; "
        f"time ratio {ours_ms / torch_ms:.3f}, memory ratio {ours_mem / torch_mem:.3f}"
    )
    assert ours_mem <= torch_mem / 8, f"extra peak {ours_mem / 2**30:.2f} GiB > 1/8 of {torch_mem / 2**30:.2f} GiB"
    assert ours_ms <= 1.1 * torch_ms, f"{ours_ms:.2f} ms > 1.1 x {torch_ms:.2f} ms"


@pytest.mark.gpu
def test_gpu_several_chunks_accumulate_the_weight_gradient_in_fp32(triton_kernels, kernel_check, monkeypatch):
    """Three chunks at the LLM vocab: the [V, H] gradient is summed in fp32 across chunks (on CUDA with torch >= 2.8
    by the GEMM itself, addmm out_dtype=fp32: asserted), matching the fp32 materialised gradient."""
    fn = triton_kernels.load("linear_cross_entropy")
    tlp = importlib.import_module("polyrl.kernels.token_logprobs.triton")
    V, H = LLM_TVH[1], LLM_TVH[2]
    monkeypatch.setattr(tlp, "CHUNK_BYTES", 512 * V * 2)
    hidden, weight, labels = _inputs(PARITY_T, V, H, torch.bfloat16, triton_kernels.device, ignore_every=5)
    assert tlp.chunk_rows(PARITY_T, V, 2) == 512
    if triton_kernels.device.type == "cuda" and tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 8):
        assert tlp._fp32_out_addmm(hidden)
    up = _upstream("mean", PARITY_T, hidden.device)
    loss, gh, gw = _run(fn, hidden, weight, labels, "mean", up)
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    r_loss, r_gh, r_gw = _run(_materialised, h32, w32, labels, "mean", up)
    kernel_check.assert_close(loss, r_loss, torch.bfloat16, "loss")
    kernel_check.assert_close(gh, r_gh, torch.bfloat16, "grad_hidden")
    kernel_check.assert_close(gw, r_gw, torch.bfloat16, "grad_weight")
