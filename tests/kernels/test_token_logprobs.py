"""token_logprobs: the reference against log_softmax on materialised logits, the Triton kernel against the
reference (log-probs, entropy, and gradients of both in hidden and weight; interpreter on CPU, compiled on
a GPU), the no-grad rollout path, and on the GPU the memory and time targets at 16k x 1024 x 151936 bf16."""

from __future__ import annotations

import importlib

import pytest
import torch
from _gpu_measure import measure_fwd_bwd

from polyrl.kernels.token_logprobs.reference import token_logprobs as tlp_reference


def _inputs(T, V, H, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (1.5 / H**0.5)
    tokens = torch.randint(0, V, (T,), generator=g)
    to = dict(device=device, dtype=dtype)
    return hidden.to(**to).requires_grad_(), weight.to(**to).requires_grad_(), tokens.to(device)


def _upstream(T, device, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, generator=g).to(device), torch.randn(T, generator=g).to(device)


def _objective(lp, ent, up_lp, up_ent):
    """A scalar that uses both outputs with per-token weights, as a policy loss with an entropy bonus does."""
    total = (lp * up_lp).sum() if up_lp is not None else 0.0
    return total + ((ent * up_ent).sum() if up_ent is not None else 0.0)


def _check(fn, kernel_check, hidden, weight, tokens, temperature, dtype, use_lp=True, use_ent=True):
    up_lp, up_ent = _upstream(hidden.shape[0], hidden.device)
    up_lp, up_ent = (up_lp if use_lp else None), (up_ent if use_ent else None)
    lp, ent = fn(hidden, weight, tokens, temperature, True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    gh, gw = torch.autograd.grad(_objective(lp, ent, up_lp, up_ent), (hidden, weight))
    h = hidden.detach().cpu().double().requires_grad_()
    w = weight.detach().cpu().double().requires_grad_()
    r_lp, r_ent = tlp_reference(h, w, tokens.cpu(), temperature, True)
    up = [u.cpu().double() if u is not None else None for u in (up_lp, up_ent)]
    r_gh, r_gw = torch.autograd.grad(_objective(r_lp, r_ent, *up), (h, w))
    kernel_check.assert_close(lp, r_lp, dtype, "logprobs")
    kernel_check.assert_close(ent, r_ent, dtype, "entropy")
    kernel_check.assert_close(gh, r_gh, dtype, "grad_hidden")
    kernel_check.assert_close(gw, r_gw, dtype, "grad_weight")


# --- reference is the spec --------------------------------------------------------------------------------


def test_reference_matches_materialised_log_softmax(monkeypatch):
    ref_mod = importlib.import_module("polyrl.kernels.token_logprobs.reference")
    monkeypatch.setattr(ref_mod, "CHUNK_TOKENS", 4)
    hidden, weight, tokens = _inputs(11, 40, 8, torch.float64, "cpu")
    lp, ent = ref_mod.token_logprobs(hidden, weight, tokens, 0.6, True)
    logits = (hidden @ weight.t()) / 0.6
    probs = torch.softmax(logits, -1)
    expected_lp = logits[torch.arange(11), tokens] - torch.logsumexp(logits, -1)
    expected_ent = -(probs * torch.log(probs)).sum(-1)
    torch.testing.assert_close(lp, expected_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, expected_ent, rtol=1e-12, atol=1e-12)
    up_lp, up_ent = _upstream(11, "cpu")
    g = torch.autograd.grad(_objective(lp, ent, up_lp.double(), up_ent.double()), (hidden, weight))
    g_exp = torch.autograd.grad(
        _objective(expected_lp, expected_ent, up_lp.double(), up_ent.double()), (hidden, weight)
    )
    for a, b in zip(g, g_exp):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert ref_mod.token_logprobs(hidden, weight, tokens, 0.6).shape == (11,)


# --- the Triton kernel against the reference ------------------------------------------------------------


@pytest.mark.parametrize("T,V,temperature", [(1, 1000, 1.0), (7, 1025, 0.7), (127, 1000, 1.3), (127, 1025, 1.0)])
def test_triton_fp32_logprobs_entropy_and_grads(T, V, temperature, triton_kernels, kernel_check):
    fn = triton_kernels.load("token_logprobs")
    hidden, weight, tokens = _inputs(T, V, 16, torch.float32, triton_kernels.device)
    _check(fn, kernel_check, hidden, weight, tokens, temperature, torch.float32)


@pytest.mark.parametrize("use_lp,use_ent", [(True, False), (False, True)])
def test_triton_gradient_of_one_output_only(use_lp, use_ent, triton_kernels, kernel_check):
    """Only the policy term or only the entropy bonus reaches backward (the other grad is None)."""
    fn = triton_kernels.load("token_logprobs")
    hidden, weight, tokens = _inputs(7, 1025, 16, torch.float32, triton_kernels.device)
    _check(fn, kernel_check, hidden, weight, tokens, 0.8, torch.float32, use_lp=use_lp, use_ent=use_ent)


def test_triton_without_entropy_matches_reference(triton_kernels, kernel_check):
    fn = triton_kernels.load("token_logprobs")
    hidden, weight, tokens = _inputs(7, 1000, 16, torch.float32, triton_kernels.device)
    lp = fn(hidden, weight, tokens, 1.0, False)
    assert isinstance(lp, torch.Tensor) and lp.shape == (7,)
    up, _ = _upstream(7, hidden.device)
    gh, gw = torch.autograd.grad((lp * up).sum(), (hidden, weight))
    h = hidden.detach().double().cpu().requires_grad_()
    w = weight.detach().double().cpu().requires_grad_()
    r_lp = tlp_reference(h, w, tokens.cpu(), 1.0, False)
    r_gh, r_gw = torch.autograd.grad((r_lp * up.cpu().double()).sum(), (h, w))
    kernel_check.assert_close(lp, r_lp, torch.float32, "logprobs")
    kernel_check.assert_close(gh, r_gh, torch.float32, "grad_hidden")
    kernel_check.assert_close(gw, r_gw, torch.float32, "grad_weight")


def test_triton_several_chunks_and_vocab_blocks(triton_kernels, kernel_check, monkeypatch):
    """3-row chunks (3 + 3 + 1) and 256-wide vocab blocks over V = 1025 (4 full blocks + 1 column)."""
    fn = triton_kernels.load("token_logprobs")
    tlp = importlib.import_module("polyrl.kernels.token_logprobs.triton")
    T, V = 7, 1025
    monkeypatch.setattr(tlp, "CHUNK_BYTES", 3 * V * 4)
    monkeypatch.setattr(tlp, "MAX_BLOCK_V", 256)
    assert tlp.chunk_rows(T, V, 4) == 3 and tlp.block_config(V)[0] == 256
    hidden, weight, tokens = _inputs(T, V, 16, torch.float32, triton_kernels.device)
    _check(fn, kernel_check, hidden, weight, tokens, 0.7, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_low_precision_matches_reference(dtype, triton_kernels, kernel_check):
    fn = triton_kernels.load("token_logprobs")
    hidden, weight, tokens = _inputs(7, 1025, 32, dtype, triton_kernels.device)
    _check(fn, kernel_check, hidden, weight, tokens, 0.9, dtype)
    gh, gw = torch.autograd.grad(fn(hidden, weight, tokens).sum(), (hidden, weight))
    assert gh.dtype == dtype and gw.dtype == dtype


def test_triton_no_grad_path_is_the_same_numbers_without_a_graph(triton_kernels):
    fn = triton_kernels.load("token_logprobs")
    hidden, weight, tokens = _inputs(7, 1025, 16, torch.float32, triton_kernels.device)
    lp, ent = fn(hidden, weight, tokens, 0.7, True)
    with torch.no_grad():
        lp_ng, ent_ng = fn(hidden, weight, tokens, 0.7, True)
    frozen = fn(hidden.detach(), weight.detach(), tokens, 0.7, False)  # grad mode on, nothing requires grad
    assert lp_ng.grad_fn is None and ent_ng.grad_fn is None and frozen.grad_fn is None
    assert lp.grad_fn is not None
    torch.testing.assert_close(lp_ng, lp.detach(), rtol=0, atol=0)
    torch.testing.assert_close(ent_ng, ent.detach(), rtol=0, atol=0)
    torch.testing.assert_close(frozen, lp.detach(), rtol=0, atol=0)


def test_triton_one_input_needs_grad(triton_kernels):
    fn = triton_kernels.load("token_logprobs")
    hidden, weight, tokens = _inputs(7, 1000, 16, torch.float32, triton_kernels.device)
    full = torch.autograd.grad(fn(hidden, weight, tokens, 1.0).sum(), (hidden, weight))
    (gh,) = torch.autograd.grad(fn(hidden, weight.detach(), tokens, 1.0).sum(), (hidden,))
    (gw,) = torch.autograd.grad(fn(hidden.detach(), weight, tokens, 1.0).sum(), (weight,))
    torch.testing.assert_close(gh, full[0], rtol=0, atol=0)
    torch.testing.assert_close(gw, full[1], rtol=0, atol=0)


def test_triton_logprobs_are_normalised(triton_kernels):
    """Scoring every vocab id of one row: the probabilities sum to 1 and the entropy is -sum p log p."""
    fn = triton_kernels.load("token_logprobs")
    V = 131
    hidden, weight, _ = _inputs(1, V, 16, torch.float32, triton_kernels.device)
    with torch.no_grad():
        lp, ent = fn(hidden.expand(V, -1), weight, torch.arange(V, device=hidden.device), 0.5, True)
    assert abs(lp.exp().sum().item() - 1.0) < 1e-5
    assert abs(-(lp.exp() * lp).sum().item() - ent[0].item()) < 1e-4
    assert torch.all(ent == ent[0])


def test_triton_out_of_range_token_gives_nan_and_empty_batch(triton_kernels):
    fn = triton_kernels.load("token_logprobs")
    hidden, weight, tokens = _inputs(5, 1000, 16, torch.float32, triton_kernels.device)
    tokens[1] = -1
    lp, ent = fn(hidden.detach(), weight.detach(), tokens, 1.0, True)
    assert torch.isnan(lp[1]) and torch.isfinite(lp[[0, 2, 3, 4]]).all() and torch.isfinite(ent).all()
    h0, w0, t0 = _inputs(0, 1000, 16, torch.float32, triton_kernels.device)
    lp0, ent0 = fn(h0, w0, t0, 1.0, True)
    assert lp0.shape == (0,) and ent0.shape == (0,)
    _, gw = torch.autograd.grad((lp0.sum() + ent0.sum()), (h0, w0))
    assert gw.abs().max().item() == 0.0
    with pytest.raises(ValueError, match="temperature"):
        fn(hidden, weight, tokens, 0.0, False)


# --- GPU: real shapes, memory and time targets ----------------------------------------------------------

LLM_TVH = (16384, 151936, 1024)  # Qwen3-0.6B lm head, 16k tokens
PARITY_T = 1536


def _materialised(hidden, weight, tokens, temperature):
    logp = torch.log_softmax((hidden @ weight.t()).float() / temperature, -1)
    lp = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def _measure(loss_fn, hidden, weight, iters=5):
    """(extra peak bytes over the inputs, median ms) of fwd + bwd; grads of hidden and weight included."""
    return measure_fwd_bwd(loss_fn, hidden, weight, iters)


@pytest.mark.gpu
def test_gpu_parity_at_llm_vocab(triton_kernels, kernel_check):
    fn = triton_kernels.load("token_logprobs")
    hidden, weight, tokens = _inputs(PARITY_T, LLM_TVH[1], LLM_TVH[2], torch.bfloat16, triton_kernels.device)
    up_lp, up_ent = _upstream(PARITY_T, hidden.device)
    lp, ent = fn(hidden, weight, tokens, 0.8, True)
    gh, gw = torch.autograd.grad(_objective(lp, ent, up_lp, up_ent), (hidden, weight))
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    r_lp, r_ent = _materialised(h32, w32, tokens, 0.8)
    r_gh, r_gw = torch.autograd.grad(_objective(r_lp, r_ent, up_lp, up_ent), (h32, w32))
    for name, a, b in (
        ("logprobs", lp, r_lp),
        ("entropy", ent, r_ent),
        ("grad_hidden", gh, r_gh),
        ("grad_weight", gw, r_gw),
    ):
        kernel_check.assert_close(a, b, torch.bfloat16, name)


@pytest.mark.gpu
@pytest.mark.parametrize("with_entropy", [False, True])
def test_gpu_memory_and_time_targets(with_entropy, triton_kernels):
    """Extra peak <= 1/8 and time <= 1.1x of the materialised-logits fwd+bwd (T 16384, H 1024, V 151936)."""
    fn = triton_kernels.load("token_logprobs")
    hidden, weight, tokens = _inputs(*LLM_TVH, torch.bfloat16, triton_kernels.device)
    up_lp, up_ent = _upstream(LLM_TVH[0], hidden.device)
    up_ent = up_ent if with_entropy else None

    def ours():
        lp, ent = fn(hidden, weight, tokens, 1.0, True) if with_entropy else (fn(hidden, weight, tokens, 1.0), None)
        return _objective(lp, ent, up_lp, up_ent)

    def materialised():
        lp, ent = _materialised(hidden, weight, tokens, 1.0)
        return _objective(lp, ent if with_entropy else None, up_lp, up_ent)

    torch_mem, torch_ms = _measure(materialised, hidden, weight)
    ours_mem, ours_ms = _measure(ours, hidden, weight)
    print(
        f"\ntoken_logprobs[entropy={with_entropy}] T,V,H={LLM_TVH} bf16: torch {torch_ms:.2f} ms "
        f"{torch_mem / 2**30:.2f} GiB extra; triton {ours_ms:.2f} ms {ours_mem / 2**30:.2f} GiB extra; "
        f"time ratio {ours_ms / torch_ms:.3f}, memory ratio {ours_mem / torch_mem:.3f}"
    )
    assert ours_mem <= torch_mem / 8, f"extra peak {ours_mem / 2**30:.2f} GiB > 1/8 of {torch_mem / 2**30:.2f} GiB"
    assert ours_ms <= 1.1 * torch_ms, f"{ours_ms:.2f} ms > 1.1 x {torch_ms:.2f} ms"


@pytest.mark.gpu
def test_gpu_no_grad_rollout_path_allocates_no_grad_buffers(triton_kernels):
    """Inference log-probs: extra memory is one logits chunk plus [T] outputs, nothing [V, H]-sized."""
    from polyrl.platform import device

    fn = triton_kernels.load("token_logprobs")
    tlp = importlib.import_module("polyrl.kernels.token_logprobs.triton")
    hidden, weight, tokens = _inputs(*LLM_TVH, torch.bfloat16, triton_kernels.device)
    with torch.no_grad():
        fn(hidden, weight, tokens, 1.0, True)
        device.synchronize()
        base = device.memory_allocated()
        device.reset_peak_memory_stats()
        fn(hidden, weight, tokens, 1.0, True)
        device.synchronize()
    extra = device.max_memory_allocated() - base
    assert extra <= tlp.CHUNK_BYTES * 1.15 + 3 * LLM_TVH[0] * 4, f"no-grad extra peak {extra / 2**20:.0f} MiB"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernel_as_prompt_logprobs_and_scoring_use_it(dtype, triton_kernels, monkeypatch):
    """``infer.prompt_logprobs.logit_row_stats`` (the row kernel over logits the engine computed, no fp32 copy) in
    the top-k and scoring paths: the same ids, ranks and greedy flags as their fp32 reference path, log-probs within
    an fp32 ulp of the log-sum-exp (interpreter on CPU, compiled on a GPU)."""
    triton_kernels.load("token_logprobs")  # the interpreter-mode module, re-imported fresh
    from polyrl.infer import prompt_logprobs as pl
    from polyrl.infer import scoring

    dev = triton_kernels.device
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1000, 32, generator=g) * 0.3).to(dev, dtype)
    h = torch.randn(37, 32, generator=g).to(dev, dtype)
    t = torch.randint(0, 1000, (37,), generator=g).to(dev)
    t[:5] = torch.nn.functional.linear(h[:5], w).float().argmax(-1)  # rows whose token is the argmax: rank 1
    for k in (1, 3):
        monkeypatch.setattr(pl, "uses_row_kernel", lambda h: False)
        ref = pl.top_logprobs(h, w, k, t)
        monkeypatch.setattr(pl, "uses_row_kernel", lambda h: True)
        got = pl.top_logprobs(h, w, k, t)
        assert torch.equal(ref[1], got[1]) and torch.equal(ref[2], got[2]) and got[2][:5].tolist() == [1] * 5
        assert (ref[0] - got[0]).abs().max().item() <= 1e-5 and (ref[3] - got[3]).abs().max().item() <= 1e-5
    monkeypatch.setattr(scoring, "uses_row_kernel", lambda h: False)
    ref = scoring._score_rows(h, w, t)
    monkeypatch.setattr(scoring, "uses_row_kernel", lambda h: True)
    got = scoring._score_rows(h, w, t)
    assert torch.equal(ref[1], got[1]) and torch.equal(ref[2], got[2]) and got[1][:5].all()
    assert (ref[0] - got[0]).abs().max().item() <= 1e-5 and (ref[3] - got[3]).abs().max().item() <= 1e-5
