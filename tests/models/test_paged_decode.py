"""The paged-KV path (write_kv_cache + paged_attention) gives the varlen path's logits: prefill, a mixed
chunked-prefill/decode step, then decode steps, with non-contiguous block tables."""

from __future__ import annotations

import pytest
import torch
from model_helpers import logits

from polyrl.models.attention_metadata import AttnMetadata

BLOCK_SIZE = 4
BLOCK_TABLES = torch.tensor([[5, 2, 9, 0], [1, 7, 3, 11]], dtype=torch.int32)
# new tokens per sequence at each step: prefill, mixed chunk + decode, three decode steps
STEPS = [[6, 3], [3, 1], [1, 1], [1, 1], [1, 1]]


def _caches(cfg, num_blocks: int = 12):
    shape = (num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]


def _step_inputs(tokens, done, new, caches):
    """ids/positions/metadata for ``new[b]`` tokens of each sequence after ``done[b]`` cached ones."""
    ids, pos, slots = [], [], []
    for b, (d, n) in enumerate(zip(done, new)):
        p = torch.arange(d, d + n)
        ids.append(tokens[b][d : d + n])
        pos.append(p)
        slots.append(BLOCK_TABLES[b, p // BLOCK_SIZE].long() * BLOCK_SIZE + p % BLOCK_SIZE)
    meta = AttnMetadata.from_seqlens(new)
    meta.kv_caches = caches
    meta.slot_mapping = torch.cat(slots)
    meta.block_tables = BLOCK_TABLES
    meta.context_lens = torch.tensor([d + n for d, n in zip(done, new)], dtype=torch.int32)
    return torch.cat(ids), torch.cat(pos), meta


@pytest.mark.parametrize("family, overrides", [("qwen3", {}), ("mistral", dict(sliding_window=5))])
def test_paged_steps_match_varlen(tiny_model, family, overrides):
    model = tiny_model(family, seed=7, **overrides).eval()
    total = [sum(s[b] for s in STEPS) for b in range(2)]
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in total]
    full = [logits(model, t, torch.arange(len(t)), AttnMetadata.from_seqlens([len(t)])) for t in tokens]

    caches = _caches(model.config)
    done = [0, 0]
    for new in STEPS:
        ids, pos, meta = _step_inputs(tokens, done, new, caches)
        got = logits(model, ids, pos, meta)
        want = torch.cat([full[b][done[b] : done[b] + new[b]] for b in range(2)])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        done = [d + n for d, n in zip(done, new)]
    # The cache holds exactly the model's k for every position (layer 0, sequence 1, last token).
    k0 = caches[0][0]
    last = done[1] - 1
    assert k0[BLOCK_TABLES[1, last // BLOCK_SIZE], last % BLOCK_SIZE].abs().sum() > 0
    assert int((k0.abs().sum(dim=(2, 3)) > 0).sum()) == sum(done)  # one written slot per token, nothing else


def test_negative_slots_are_not_written(tiny_model):
    """Padding tokens (slot -1, as CUDA-graph decode batches use) leave the cache untouched."""
    model = tiny_model("qwen3", seed=1).eval()
    caches = _caches(model.config)
    ids = torch.tensor([3, 4])
    meta = AttnMetadata.from_seqlens([1, 1])
    meta.kv_caches, meta.block_tables = caches, BLOCK_TABLES
    meta.slot_mapping = torch.tensor([BLOCK_TABLES[0, 0].item() * BLOCK_SIZE, -1])
    meta.context_lens = torch.tensor([1, 1], dtype=torch.int32)
    logits(model, ids, torch.zeros(2, dtype=torch.long), meta)
    written = (caches[0][0].abs().sum(dim=(2, 3)) > 0).nonzero().tolist()
    assert written == [[int(BLOCK_TABLES[0, 0]), 0]]
