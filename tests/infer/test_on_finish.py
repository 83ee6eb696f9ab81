"""``LLM.generate(..., on_finish=fn)``: each sequence is handed over once, as soon as the engine step that finished
it is done, with the same output ``generate`` returns at the end; the outputs themselves do not change."""

from __future__ import annotations

import pytest
import torch

from polyrl.infer import LLM, RolloutConfig, SamplingParams

from .conftest import EOS


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 96, (int(k),), generator=g).tolist() for k in torch.randint(1, 30, (n,), generator=g)]


def _params(n: int) -> list[SamplingParams]:
    # short and long requests, n > 1, a stop set: some sequences finish long before the others
    return [
        SamplingParams(temperature=1.0, seed=k, max_tokens=3 if k % 3 == 0 else 24, n=1 + k % 2,
                       stop_token_ids=[EOS, 9] if k % 4 == 1 else [])
        for k in range(n)
    ]  # fmt: skip


def _key(c) -> tuple:
    return (list(c.token_ids), [round(x, 6) for x in c.logprobs], c.finish_reason, c.stop_reason, c.text)


@pytest.mark.parametrize(
    "overlap,decode_steps,blocks", [(False, 1, 256), (True, 1, 256), (True, 4, 256), (True, 4, 24)]
)
def test_on_finish_once_per_sequence_early_and_same_outputs(tiny_model, overlap, decode_steps, blocks):
    prompts, params = _prompts(8), _params(8)
    cfg = RolloutConfig(
        num_blocks=blocks, block_size=4, max_num_seqs=8, overlap_decode=overlap, decode_steps=decode_steps
    )
    plain = LLM(tiny_model, None, cfg).generate(prompts, params)
    llm = LLM(tiny_model, None, cfg)
    seen: dict[tuple[int, int], tuple] = {}
    at_step: dict[tuple[int, int], int] = {}

    def hook(k: int, j: int, c) -> None:
        assert (k, j) not in seen, f"sequence {(k, j)} reported twice"
        seen[(k, j)] = _key(c)
        at_step[(k, j)] = llm.num_steps

    outs = llm.generate(prompts, params, on_finish=hook)
    want = {(k, c.index): _key(c) for k, o in enumerate(outs) for c in o.outputs}
    assert seen == want  # every sequence once, with its final output
    assert [[_key(c) for c in o.outputs] for o in outs] == [[_key(c) for c in o.outputs] for o in plain]
    assert all(c.new_token_ids == c.token_ids for o in outs for c in o.outputs)  # emitted counters untouched
    short = [at_step[(k, 0)] for k in range(0, 8, 3)]  # max_tokens=3: reported long before the batch ends
    # (with the small cache, request 6 is admitted only after preemptions free blocks: around mid-run)
    assert max(short) < 0.6 * llm.num_steps, (short, llm.num_steps)
    assert not llm.has_unfinished_requests()
    if blocks == 24:  # the small cache preempts: a recomputed sequence is still reported once
        assert llm.stats()["num_preemptions"] > 0


def test_on_finish_error_ends_generate(tiny_model):
    llm = LLM(tiny_model, None, RolloutConfig(num_blocks=64, block_size=4, max_num_seqs=4))

    def hook(k: int, j: int, c) -> None:
        raise RuntimeError(f"hook failed at {k}")

    with pytest.raises(RuntimeError, match="hook failed"):
        llm.generate(_prompts(3), SamplingParams(temperature=0.0, max_tokens=4), on_finish=hook)
    llm.abort_all()
    out = llm.generate(_prompts(2), SamplingParams(temperature=0.0, max_tokens=4))  # the engine still works
    assert len(out) == 2 and all(o.finished and 1 <= len(o.outputs[0].token_ids) <= 4 for o in out)
    assert llm._finished is None


def test_on_finish_text_with_a_tokenizer_and_stop_strings():
    """Decoded text (plain and stop-string-cut) handed over equals the returned text, n > 1 included."""
    from polyrl.models.decoder import build_model, init_weights
    from polyrl.models.tokenizer import build_tokenizer

    from .conftest import tiny_config

    tok = build_tokenizer(320, trained_vocab=300)
    model = build_model(tiny_config(vocab_size=320, eos_token_id=tok.eos_token_id), seed=1)
    init_weights(model, seed=1, std=0.2)
    llm = LLM(model.eval(), tok, RolloutConfig(block_size=4, num_blocks=256, max_num_batched_tokens=32))
    params = [
        SamplingParams(temperature=1.0, seed=3, max_tokens=4 + 10 * k, n=2, stop=["e"] if k == 1 else None)
        for k in range(3)
    ]
    seen = {}
    outs = llm.generate(
        ["hello there", "a b c", "zz"], params, on_finish=lambda k, j, c: seen.setdefault((k, j), c.text)
    )
    want = {(k, c.index): c.text for k, o in enumerate(outs) for c in o.outputs}
    assert seen == want and any(want.values())
