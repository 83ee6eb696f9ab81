"""MasterAdamW: equal to torch AdamW on fp32, fp32 masters over bf16 weights, identity kept, state round trip."""

from __future__ import annotations

import torch
from torch import nn

from polyrl.train import MasterAdamW, OptimConfig


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(11, 8), nn.LayerNorm(8), nn.Linear(8, 5))


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (13,), generator=g)
    target = torch.randint(0, 5, (13,), generator=g)
    return nn.functional.cross_entropy(model(ids).float(), target)


def test_fp32_equals_torch_adamw_bitwise():
    cfg = OptimConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=None)
    ours_model, ref_model = _model(), _model()
    ours = MasterAdamW(ours_model.named_parameters(), cfg)
    assert not ours.has_masters  # fp32 params are their own masters
    decay = [p for p in ref_model.parameters() if p.ndim >= 2]
    no_decay = [p for p in ref_model.parameters() if p.ndim < 2]
    ref = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=True,
    )
    for step in range(5):
        lr = 1e-2 * (1.0 - 0.1 * step)
        _loss(ours_model, step).backward()
        ours.step(lr)
        ours.zero_grad()
        for group in ref.param_groups:
            group["lr"] = lr
        _loss(ref_model, step).backward()
        ref.step()
        ref.zero_grad()
    for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name
    # LayerNorm weight/bias (1-D) were not decayed; the linear weight was: groups as documented.
    sizes = sorted(len(g["params"]) for g in ours.inner.param_groups)
    assert sizes == [2, 3] and {g["weight_decay"] for g in ours.inner.param_groups} == {0.0, 0.1}


def test_bf16_masters_track_fp32_adamw_and_keep_identity():
    cfg = OptimConfig(lr=1e-2, weight_decay=0.0, grad_clip=None)
    model = _model()
    fp32_start = {n: p.detach().clone() for n, p in model.named_parameters()}
    params_before = {n: id(p) for n, p in model.named_parameters()}
    opt = MasterAdamW(model.named_parameters(), cfg, compute_dtype=torch.bfloat16)
    assert opt.has_masters and all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in opt.masters)
    # masters start from the original fp32 values, not the bf16-rounded ones
    for name, m in zip(opt.names, opt.masters):
        assert torch.equal(m, fp32_start[name])
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}

    ref_params = [nn.Parameter(fp32_start[n].clone()) for n in opt.names]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, betas=cfg.betas, eps=cfg.eps, weight_decay=0.0, foreach=True)
    for step in range(3):
        _loss(model, step).backward()
        assert all(p.grad is None for p in model.parameters())  # grads moved into fp32 masters
        grads = [m.grad.clone() for m in opt.masters]
        assert all(g.dtype == torch.float32 for g in grads)
        opt.step(1e-2)
        opt.zero_grad()
        for rp, g in zip(ref_params, grads):
            rp.grad = g
        ref.step()
    for name, m, rp, p in zip(opt.names, opt.masters, ref_params, model.parameters()):
        assert torch.equal(m, rp.detach()), name  # same fp32 update given the same fp32 grads
        assert torch.equal(p.detach(), m.to(torch.bfloat16)), name  # compute weights = rounded masters
    assert {n: id(p) for n, p in model.named_parameters()} == params_before
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs  # updated in place


def test_grads_accumulate_in_fp32_over_backwards():
    model = _model()
    opt = MasterAdamW(model.named_parameters(), OptimConfig(), compute_dtype=torch.bfloat16)
    _loss(model, 0).backward()
    once = [g.clone() for g in opt.grads()]
    _loss(model, 0).backward()
    assert all(torch.equal(g2, 2 * g1) for g1, g2 in zip(once, opt.grads()))
    assert opt.grad_norm().item() > 0


def test_state_dict_round_trip_continues_identically():
    cfg = OptimConfig(lr=1e-2, weight_decay=0.05)
    a = _model()
    opt_a = MasterAdamW(a.named_parameters(), cfg, compute_dtype=torch.bfloat16)
    for s in range(2):
        _loss(a, s).backward()
        opt_a.step(1e-2)
        opt_a.zero_grad()
    state = {k: v.clone() for k, v in opt_a.state_dict().items()}
    assert any(k.startswith("master/") for k in state) and any(k.startswith("exp_avg_sq/") for k in state)

    b = _model(seed=1)  # different weights: everything must come from the state
    opt_b = MasterAdamW(b.named_parameters(), cfg, compute_dtype=torch.bfloat16)
    opt_b.load_state_dict(state)
    for s in (2, 3):
        for model, opt in ((a, opt_a), (b, opt_b)):
            _loss(model, s).backward()
            opt.step(1e-2)
            opt.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
