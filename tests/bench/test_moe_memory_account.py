"""scripts/moe_memory_account.py: the saved-tensor accounting sums what a hand-built graph saves (bytes, storages
counted once, parameters left out, ctx-held tensors found), releases it in backward and logs the gradients; sizes
scale per dimension; and one polyrl step of the small Qwen3-MoE saves only h (not act or y) for the experts."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn


def _load():
    if "moe_memory_account" in sys.modules:
        return sys.modules["moe_memory_account"]
    path = Path(__file__).resolve().parents[2] / "scripts" / "moe_memory_account.py"
    spec = importlib.util.spec_from_file_location("moe_memory_account", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod


class _Keep(torch.autograd.Function):
    """Saves a [5, 16] fp32 product through save_for_backward and keeps an int64 [7] on its ctx."""

    @staticmethod
    def forward(ctx, x):
        y = x * 2.0
        ctx.save_for_backward(y)
        ctx.held = torch.arange(7)
        return y.sum(1)

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g[:, None].expand_as(y) * 2.0


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(8, 16)

    def forward(self, x):
        h = self.mlp(x)  # saves x [5, 8] (the weight is a parameter: not counted)
        return _Keep.apply(h), h


def test_accounting_of_a_hand_built_graph():
    m = _load()
    net = _Net()
    identity = m.Scaler({n: n for n in range(1, 64)})
    rec = m.Recorder(net, identity)
    x = torch.randn(5, 8)
    with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
        out, h = net(x)
        h2 = h.view(16, 5)  # the same storage saved twice by two ops counts once
        loss = out.sum() + (h2 * h2).sum()
    rec.collect_ctx(loss, "(loss)")
    by_via = {}
    for r in rec.saved.values():
        by_via.setdefault(r.via, []).append((r.shape, r.nbytes, r.kind))
    saved = sorted(by_via["save_for_backward"])
    # the Linear (module "mlp": the router kind) saves x; _Keep (the root module) saves y; the mul saves h once
    assert saved == sorted([((5, 8), 160, "router"), ((5, 16), 320, "head/loss"), ((5, 16), 320, "head/loss")])
    assert by_via["ctx attribute"] == [((7,), 56, "head/loss")]
    forward_bytes = sum(e[4] for e in rec.events if e[0] == "forward")
    assert forward_bytes == 160 + 320 + 320 + 56
    rec.phase = "backward"
    loss.backward()
    rec.end_backward()
    rec.close()
    back = [e for e in rec.events if e[0] == "backward"]
    assert sum(e[4] for e in back if not e[1].startswith("grad")) == -(160 + 320 + 320 + 56)  # all released
    grads = {e[1]: e[4] for e in back if e[1].startswith("grad")}
    assert grads == {"grad mlp.weight": 16 * 8 * 4, "grad mlp.bias": 16 * 4}


def test_sizes_scale_per_dimension_and_collisions_are_refused():
    m = _load()
    sizes = m.size_map(m.SMALL, m.REAL)
    scale = m.Scaler(sizes)
    t, tk, h, i = 60, 480, 192, 72
    assert scale((tk, 2 * i), tk * 2 * i * 2) == pytest.approx(16384 * 8 * 1536 * 2)
    assert scale((t, h), t * h * 4) == pytest.approx(16384 * 2048 * 4)
    assert scale((1, 128), 512) == 512  # experts: the real count
    assert scale((7, 5), 70) == 70 and (7, 5) in scale.unscaled
    with pytest.raises(ValueError, match="collides"):
        m.size_map(dict(m.SMALL, H=20), m.REAL)  # H = S
    assert m.kind_of("model.layers.3.mlp.experts") == ("experts", 3)
    assert m.kind_of("model.layers.0.self_attn.q_norm") == ("attention", 0)
    assert m.kind_of("model.layers.1.post_attention_layernorm") == ("norms", 1)
    assert m.kind_of("model.norm") == ("head/loss", None)


def _interpreting() -> bool:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(tl.standard.sum, InterpretedFunction)


def test_polyrl_step_keeps_only_h_for_the_experts():
    m = _load()  # sets TRITON_INTERPRET before triton is imported, when nothing imported it yet
    if not _interpreting():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 in this process; run with it set")
    small = dict(m.SMALL)
    scale = m.Scaler({n: n for n in range(1, 2000)})  # small = real: bytes are the small model's own
    tokens = torch.randint(0, small["V"], (small["B"], small["S"]), generator=torch.Generator().manual_seed(0))
    rec = m.polyrl_step(m.small_config(1, small), tokens, scale)
    t, tk, hid, inter = small["B"] * small["S"], small["B"] * small["S"] * small["k"], small["H"], small["I"]
    experts = [r for r in rec.saved.values() if r.kind == "experts" and r.via == "save_for_backward"]
    assert sorted((r.shape, r.nbytes) for r in experts) == [
        ((t, small["k"]), tk * 2),
        ((tk, 2 * inter), tk * 2 * inter * 2),
    ]
    shapes = {r.shape for r in rec.saved.values()}
    assert (tk, hid) not in shapes and (tk, inter) not in shapes  # neither y nor act
    grads = [e for e in rec.events if e[1].startswith("grad ")]
    assert sum(e[4] for e in grads) == sum(p.numel() * 2 for p in rec.model.parameters())  # bf16 grads, all of them
