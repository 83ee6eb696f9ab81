"""data.fixed_shapes: micro-batches padded to the token budget, a sequence capacity and one max_seqlen, so the shapes
repeat (a CUDA-graphed training step replays them) while the loss, its gradients and the counted tokens stay those
of the unpadded batch."""

from __future__ import annotations

import pytest
import torch

from polyrl.data import PackedBatchIterator, TokenizedSeq
from polyrl.data.batch import IGNORE_INDEX, PAD_CHUNK, pack_sequences


def seqs(lengths, seed=0, vocab=64):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(2, vocab, (n,), generator=g).tolist()
        out.append(TokenizedSeq(ids, [0] * (n // 3) + [1] * (n - n // 3)))  # a prompt part without loss
    return out


def test_padding_layout_and_what_is_unchanged():
    real = seqs([7, 20, 3])
    plain = pack_sequences(real)
    padded = pack_sequences(real, pad_to=300, num_sequences=8, max_seqlen=150)
    assert padded.input_ids.shape == (300,) and padded.cu_seqlens.shape == (9,) and padded.max_seqlen == 150
    # the real tokens first, unchanged; then 270 padding tokens in sequences of at most PAD_CHUNK; then empties
    assert torch.equal(padded.input_ids[:30], plain.input_ids) and torch.equal(padded.labels[:30], plain.labels)
    assert torch.equal(padded.cu_seqlens[:4], plain.cu_seqlens)
    assert padded.cu_seqlens.tolist()[3:] == [30, 30 + PAD_CHUNK, 30 + 2 * PAD_CHUNK, 300, 300, 300]
    assert (padded.labels[30:] == IGNORE_INDEX).all() and padded.position_ids[30 : 30 + PAD_CHUNK].tolist() == list(
        range(PAD_CHUNK)
    )
    assert padded.num_target_tokens == plain.num_target_tokens
    assert (padded.padding_tokens, padded.padding_sequences) == (270, 5)
    assert padded.to("cpu").padding_sequences == 5


def test_bad_fixed_shapes_say_what_does_not_fit():
    real = seqs([40, 40])
    with pytest.raises(ValueError, match="80 tokens do not fit a fixed-shape batch of 64"):
        pack_sequences(real, pad_to=64)
    with pytest.raises(ValueError, match=r"3 sequences \(2 \+ padding\) exceed the fixed capacity 2"):
        pack_sequences(real, pad_to=100, num_sequences=2)
    with pytest.raises(ValueError, match="max_seqlen 30 is shorter"):
        pack_sequences(real, pad_to=100, num_sequences=4, max_seqlen=30)


def test_iterator_batches_share_one_shape_and_hold_the_same_sequences():
    units = [(s,) for s in seqs([5 + (i * 37) % 90 for i in range(60)], seed=3)]
    plain = PackedBatchIterator(units, 256, max_epochs=2)
    fixed = PackedBatchIterator(units, 256, max_epochs=2, fixed_shapes=True)
    shapes = set()
    n = 0
    for a, b in zip(plain, fixed):
        k = a.input_ids.numel()
        assert torch.equal(b.input_ids[:k], a.input_ids) and torch.equal(b.labels[:k], a.labels)
        assert b.num_target_tokens == a.num_target_tokens and b.padding_tokens == 256 - k
        shapes.add((tuple(b.input_ids.shape), tuple(b.cu_seqlens.shape), b.max_seqlen))
        n += 1
    assert n == 2 * plain.batches_per_epoch > 4
    cap = fixed.sequence_capacity(0)
    assert shapes <= {((256,), (fixed.sequence_capacity(e) + 1,), PAD_CHUNK) for e in (0, 1)} and cap % 16 == 0
    # the bound is the longest sequence (here 94) or a padding sequence (PAD_CHUNK), whichever is longer
    assert fixed.max_seqlen == max(94, PAD_CHUNK) and cap >= 256 // PAD_CHUNK
