"""On an accelerator: CUDA-graph decode equals eager decode, and the engine agrees with a full forward."""

from __future__ import annotations

import pytest
import torch

from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.models.decoder import build_model, init_weights

from .conftest import tiny_config

pytestmark = pytest.mark.gpu


def _model(dtype):
    from polyrl.platform import device

    # head_dim 16: the smallest the Triton paged-attention kernel takes (others decode eagerly, see the test below)
    cfg = tiny_config(max_position_embeddings=512, head_dim=16)
    model = build_model(cfg, dtype=dtype, device=device.torch_device(), seed=0)
    return init_weights(model, seed=0, std=0.2).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_equals_eager(dtype):
    from polyrl.platform import device

    if not device.supports_graphs():
        pytest.skip("this accelerator has no CUDA graphs")
    model = _model(dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 96, (int(n),), generator=g).tolist() for n in torch.randint(1, 100, (37,), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = LLM(model, None, RolloutConfig(block_size=16, num_blocks=512, cuda_graphs=graphs, max_num_seqs=64))
        outs[graphs] = llm.generate(prompts, params)
        assert llm.runner.use_graphs == graphs
        if graphs:
            assert llm.runner.graphs is not None and len(llm.runner.graphs.graphs) >= 1
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(outs[False], outs[True]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        diff = (torch.tensor(a.outputs[0].logprobs) - torch.tensor(b.outputs[0].logprobs)).abs().max().item()
        assert diff <= tol, diff


def test_head_dims_the_graph_kernel_lacks_decode_eagerly():
    """head_dim 8 runs the reference paged attention, which syncs the host: no capture is attempted."""
    from polyrl.platform import device

    model = build_model(tiny_config(head_dim=8), device=device.torch_device(), seed=0).eval()
    llm = LLM(model, None, RolloutConfig(num_blocks=64, max_num_seqs=4))
    assert not llm.runner.use_graphs
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_failing_graph_capture_falls_back_to_eager_decoding(monkeypatch):
    """A model that syncs the host inside the captured region: the engine warns, decodes eagerly, and its
    output equals a plain eager engine's; random ops on the device still work afterwards."""
    from polyrl.platform import device

    if not device.supports_graphs():
        pytest.skip("this accelerator has no CUDA graphs")
    model = _model(torch.float32)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eager = LLM(model, None, RolloutConfig(num_blocks=64, max_num_seqs=4, cuda_graphs=False)).generate(prompts, params)
    plain = model.compute_logits
    # .item(): a host sync
    monkeypatch.setattr(model, "compute_logits", lambda h, upcast=True: plain(h, upcast) + 0 * h.sum().item())
    llm = LLM(model, None, RolloutConfig(num_blocks=64, max_num_seqs=4, cuda_graphs=True))
    with pytest.warns(RuntimeWarning, match="decoding without CUDA graphs"):
        outs = llm.generate(prompts, params)
    assert not llm.runner.use_graphs and llm.runner.graphs is None
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]
    assert torch.randn(16, device=device.torch_device()).isfinite().all()


@pytest.mark.parametrize("graphs", [False, True])
def test_one_step_ahead_decoding_equals_synchronous_on_the_device(graphs):
    """bf16, seeded sampling with stops: generate() with steps launched ahead gives the synchronous engine's tokens."""
    from polyrl.platform import device

    if graphs and not device.supports_graphs():
        pytest.skip("this accelerator has no CUDA graphs")
    model = _model(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 96, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (48,), generator=g)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=8 + i % 29, stop_token_ids=[3, 4]) for i in range(48)]
    outs = {}
    for ahead in (False, True):
        cfg = RolloutConfig(block_size=16, num_blocks=512, cuda_graphs=graphs, max_num_seqs=64, overlap_decode=ahead)
        llm = LLM(model, None, cfg)
        outs[ahead] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.stats()
        assert (stats["num_steps_ahead"] > 0) == ahead
        if ahead:
            assert stats["num_steps_ahead"] > stats["num_launches_ahead"]  # several decode steps per launch
            if graphs:  # seeded rows without truncation: whole launches replayed as one graph, sampling inside
                assert llm.runner.graphs.launch_graphs
    assert outs[True] == outs[False]


def test_capture_graphs_ahead_of_time_covers_every_bucket_up_to_the_batch():
    from polyrl.platform import device

    if not device.supports_graphs():
        pytest.skip("this accelerator has no CUDA graphs")
    llm = LLM(_model(torch.bfloat16), None, RolloutConfig(num_blocks=256, max_num_seqs=64))
    assert llm.capture_graphs(40) > 0
    assert sorted(llm.runner.graphs.graphs) == [1, 2, 4, 8, 16, 32, 64]
    assert sorted(llm.runner.graphs.launch_graphs) == [(b, 4) for b in (1, 2, 4, 8, 16, 32, 64)]
    out = llm.generate([[5, 6, 7]] * 3, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert llm.stats()["graph_capture_s"] == pytest.approx(llm.runner.graphs.capture_s)  # nothing captured again
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)


@pytest.mark.parametrize("batch", [1, 24])
def test_greedy_equals_transformers_on_the_device(batch):
    """fp32 on the device, with the decode path as the benches run it (CUDA graphs, launch graphs, the fused q/k
    norms + RoPE, grouped skinny projections at batch 1): greedy tokens equal transformers' generate."""
    from polyrl.platform import device

    from .conftest import hf_twin
    from .test_engine import prompts

    dev = device.torch_device()
    model = _model(torch.float32)
    assert model.options.fused_qk_norm_rope and model.options.group_projections  # the defaults this test is about
    hf = hf_twin(model).to(dev)
    ps = prompts(batch, seed=3, lo=2, hi=40)
    new = 24
    llm = LLM(model, None, RolloutConfig(block_size=16, num_blocks=256, max_num_seqs=32))
    outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    for p, o in zip(ps, outs):
        ids = torch.tensor([p], device=dev)
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
        assert o.outputs[0].token_ids == want, (p, o.outputs[0].token_ids, want)
    if device.supports_graphs():  # the launches were replayed as graphs, greedy draws inside
        assert llm.runner.graphs.launch_graphs
