"""DecoderLM against transformers, fp32: every family, packed batches, sliding windows, checkpointing."""

from __future__ import annotations

import pytest
import torch
from model_helpers import hf_logits, hf_twin, logits, packed

from polyrl.models.attention_metadata import AttnMetadata
from polyrl.models.decoder import build_model

pytest.importorskip("transformers")

LENS = [5, 13, 1, 9]

CASES = {
    "llama-llama3-rope": ("llama", {}),
    "llama-linear-rope-bias": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True)),
    "mistral-sliding": ("mistral", {}),
    "qwen2-bias-tied": ("qwen2", {}),
    "qwen2-sliding-upper-layer": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3-qknorm-tied": ("qwen3", {}),
    "qwen3-untied-bias": ("qwen3", dict(tie_word_embeddings=False, attention_bias=True)),
}


def _pair(tiny_config, family, overrides):
    cfg = tiny_config(family, **overrides)
    hf = hf_twin(cfg, seed=1)
    ours = build_model(cfg, init=False)
    ours.load_state_dict(hf.state_dict(), strict=not cfg.tie_word_embeddings)
    return cfg, hf, ours.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tiny_config, case):
    family, overrides = CASES[case]
    cfg, hf, ours = _pair(tiny_config, family, overrides)
    ids, pos, meta = packed(LENS, cfg.vocab_size)
    ref = hf_logits(hf, ids, LENS)
    got = logits(ours, ids, pos, meta)
    assert got.dtype == torch.float32 and got.shape == (sum(LENS), cfg.vocab_size)
    assert ref.abs().max() > 0.1  # the test has signal
    assert (got - ref).abs().max().item() <= 1e-4


def test_packed_batch_equals_one_by_one(tiny_model):
    model = tiny_model("qwen3", seed=3).eval()
    ids, pos, meta = packed(LENS, model.config.vocab_size, seed=2)
    together = logits(model, ids, pos, meta)
    start = 0
    for n in LENS:
        alone = logits(model, ids[start : start + n], pos[start : start + n], AttnMetadata.from_seqlens([n]))
        torch.testing.assert_close(together[start : start + n], alone, rtol=0, atol=1e-5)
        start += n


def test_sliding_window_changes_long_sequences_only(tiny_config):
    windowed = build_model(tiny_config("mistral", sliding_window=4), seed=0).eval()
    full = build_model(tiny_config("mistral", sliding_window=None), seed=0).eval()
    ids, pos, meta = packed([12], windowed.config.vocab_size)
    a, b = logits(windowed, ids, pos, meta), logits(full, ids, pos, meta)
    torch.testing.assert_close(a[:4], b[:4], rtol=0, atol=0)  # within the window: identical
    assert (a[4:] - b[4:]).abs().max() > 1e-3


def test_gradient_checkpointing_same_loss_and_grads(tiny_model):
    model = tiny_model("qwen3", seed=4).train()
    ids, pos, meta = packed([7, 11], model.config.vocab_size, seed=5)

    def loss_and_grads():
        model.zero_grad()
        loss = model.compute_logits(model(ids, pos, meta)).logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss0, g0 = loss_and_grads()
    model.gradient_checkpointing = True
    loss1, g1 = loss_and_grads()
    assert loss0.item() == pytest.approx(loss1.item(), abs=0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-6, msg=name)
    assert g0["model.layers.0.self_attn.q_norm.weight"].abs().sum() > 0


@pytest.mark.parametrize("checkpoint_layers", [None, 0, 1, 99])
def test_gradient_checkpointing_keeps_one_stream_tensor_per_layer(tiny_model, monkeypatch, checkpoint_layers):
    """Each checkpointed layer gets the summed stream and no residual: it keeps one [T, H] tensor alive per layer
    (as HF's checkpointing does), not the (h, residual) pair, which doubled activation memory. ``checkpoint_layers``
    N checkpoints the first N layers only (None or more than there are: all), with the same loss and gradients."""
    import polyrl.models.decoder as decoder

    model = tiny_model("qwen3", seed=4).train()
    ids, pos, meta = packed([7, 11], model.config.vocab_size, seed=5)
    model(ids, pos, meta).sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing = True
    model.checkpoint_layers = checkpoint_layers
    seen = []
    real = decoder.checkpoint

    def spy(fn, *args, **kwargs):
        seen.append((fn, [a for a in args[:2] if isinstance(a, torch.Tensor)]))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(decoder, "checkpoint", spy)
    model(ids, pos, meta).sum().backward()
    n_layers = model.config.num_layers
    assert n_layers == 2
    expected = n_layers if checkpoint_layers is None else min(checkpoint_layers, n_layers)
    assert [fn for fn, _ in seen] == list(model.model.layers)[:expected]
    assert all(len(t) == 1 and t[0].shape == (18, model.config.hidden_size) for _, t in seen)
    for name, grad in plain.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=0, atol=1e-6, msg=name)


def test_parameter_names_counts_and_flops(tiny_model, tiny_config):
    tied, untied = tiny_model("qwen3"), tiny_model("llama")
    names = dict(tied.named_parameters())
    assert "model.layers.1.self_attn.k_norm.weight" in names and "lm_head.weight" not in names
    assert tied.lm_head_weight is tied.model.embed_tokens.weight
    assert "lm_head.weight" in dict(untied.named_parameters())
    c = tied.config
    h, i, v, q, kv = (
        c.hidden_size,
        c.intermediate_size,
        c.vocab_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
    )
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * c.head_dim
    n = v * h + c.num_layers * per_layer + h
    assert tied.num_parameters() == n
    assert untied.num_parameters() == v * h * 2 + c.num_layers * (per_layer - 2 * c.head_dim) + h
    assert tied.flops_per_token(100) == 6 * n + 6 * c.num_layers * 100 * c.num_heads * c.head_dim
