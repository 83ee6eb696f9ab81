"""The rollout engine's routing record (``RolloutConfig.record_routing``, MoE): the experts each MoE layer chose for
every token a sequence fed equal those of a training forward over the same tokens - prefix-cache hits, chunked
prefill, preemption and one-step-ahead decoding included - and the last token's row is missing (-1). Off, or on a
dense model, nothing is recorded. On a GPU the same through CUDA step and launch graphs."""

from __future__ import annotations

import pytest
import torch

from polyrl.algorithms.rl_batch import Sample, pack_samples
from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.models import build_model, preset_config
from polyrl.models.moe import Routing
from polyrl.train.losses import attention_metadata

from .conftest import tiny_config


def _moe(dev: str | torch.device = "cpu"):
    return build_model(preset_config("tiny-moe"), device=dev, seed=3).eval()


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(k),), generator=g).tolist() for k in torch.randint(3, 23, (n,), generator=g)]


def _trainer_routing(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """int64 ``[tokens, L, k]``: what a training forward over the packed sample chooses."""
    b = pack_samples([Sample(prompt, completion, [0.0] * len(completion), "length", "")])[0].to(
        model.lm_head_weight.device
    )
    routing = Routing(keep_logits=False)
    with torch.no_grad():
        model(b.input_ids, b.position_ids, attention_metadata(b), routing=routing)
    return torch.stack([routing.topk_ids[i] for i in sorted(routing.topk_ids)], dim=1).cpu()


def _check(model, outs) -> int:
    """Every completion's record against the training forward; returns the rows compared."""
    rows = 0
    for o in outs:
        for c in o.outputs:
            rec = c.routed_experts
            n = len(o.prompt_token_ids) + len(c.token_ids)
            assert rec.device.type == "cpu" and rec.dtype == torch.int8 and rec.shape == (n, 2, 2)
            assert (rec[-1] == -1).all()  # the last token was never fed
            want = _trainer_routing(model, o.prompt_token_ids, c.token_ids)
            assert torch.equal(rec[:-1].long(), want[:-1])
            rows += n - 1
    return rows


@pytest.mark.parametrize("overlap", [False, True])
def test_recorded_experts_equal_a_training_forward(overlap):
    """n = 3 samples per prompt (the later ones take the prompt's full blocks from the prefix cache), a token budget
    that chunks the longer prompts, a cache small enough to preempt; with ``overlap`` the CPU runs the one-step-ahead
    multi-step path (4 decode steps per launch)."""
    model = _moe()
    cfg = RolloutConfig(
        num_blocks=16, block_size=4, max_num_seqs=12, max_num_batched_tokens=16, record_routing=True,
        overlap_decode=overlap, decode_steps=4,
    )  # fmt: skip
    llm = LLM(model, None, cfg)
    assert llm.kv.routing.shape == (16 * 4 + 1, 2, 2)
    outs = llm.generate(_prompts(5, 2048), SamplingParams(n=3, max_tokens=9, seed=7, ignore_eos=True))
    assert _check(model, outs) == sum(len(o.prompt_token_ids) + 9 - 1 for o in outs for _ in o.outputs)
    stats = llm.stats()
    assert stats["prefix_cache_hit_rate"] > 0.1
    assert stats["num_preemptions"] > 0
    assert (stats["num_launches_ahead"] > 0) == overlap


def test_no_record_when_off_or_dense():
    model = _moe()
    llm = LLM(model, None, RolloutConfig(num_blocks=16, block_size=4))
    assert llm.kv.routing is None
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True, seed=0))
    assert out[0].outputs[0].routed_experts is None
    dense = build_model(tiny_config(), seed=0).eval()
    llm = LLM(dense, None, RolloutConfig(num_blocks=16, block_size=4, record_routing=True))
    assert llm.kv.routing is None
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, seed=0))[0].outputs[0].routed_experts is None


def test_release_frees_the_table_and_reallocate_records_again():
    model = _moe()
    llm = LLM(model, None, RolloutConfig(num_blocks=16, block_size=4, record_routing=True))
    llm.release()
    assert llm.kv.routing is None
    llm.reallocate()
    outs = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True, seed=0))
    assert _check(model, outs) == 8


@pytest.mark.gpu
@pytest.mark.parametrize("launch_graphs", [False, True])
def test_cuda_graph_recording_equals_eager_and_the_trainer(launch_graphs):
    """Decode through CUDA step graphs (and, with ``launch_graphs``, 4-step launch graphs) records what the eager
    engine records on the same greedy tokens, and what a training forward chooses."""
    from polyrl.platform import device

    if not device.supports_graphs():
        pytest.skip("this accelerator has no CUDA graphs")
    model = _moe(device.torch_device())
    prompts = _prompts(24, 2048, seed=1)
    params = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        cfg = RolloutConfig(
            block_size=16, num_blocks=256, max_num_seqs=64, cuda_graphs=graphs, record_routing=True,
            overlap_decode=True, decode_steps=4, launch_graphs=launch_graphs,
        )  # fmt: skip
        llm = LLM(model, None, cfg)
        outs[graphs] = llm.generate(prompts, params)
        assert llm.runner.use_graphs == graphs
        if graphs:
            assert llm.runner.graphs.graphs
            assert bool(llm.runner.graphs.launch_graphs) == launch_graphs
    same = agree_eager = agree_trainer = rows = 0
    for a, b in zip(outs[False], outs[True]):
        for ca, cb in zip(a.outputs, b.outputs):
            assert (
                cb.routed_experts.shape == (len(b.prompt_token_ids) + 20, 2, 2) and (cb.routed_experts[-1] == -1).all()
            )
            if ca.token_ids != cb.token_ids:  # a greedy near tie decided otherwise: nothing to compare row by row
                continue
            same += 1
            want = _trainer_routing(model, b.prompt_token_ids, cb.token_ids)[:-1]
            got = cb.routed_experts[:-1].long()
            agree_eager += int((got == ca.routed_experts[:-1].long()).all(dim=-1).sum())
            agree_trainer += int((got == want).all(dim=-1).sum())
            rows += want.shape[0] * want.shape[1]
    # other batch shapes (a graph pads to its bucket) and the trainer's varlen attention round differently from the
    # eager paged decode: a near tie in a router's top-k may flip, rarely
    assert same >= 0.9 * 48, same
    assert agree_eager / rows > 0.999, (agree_eager, rows)
    assert agree_trainer / rows > 0.995, (agree_trainer, rows)
