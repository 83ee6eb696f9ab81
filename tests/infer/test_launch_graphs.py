"""The decode launch graph's body (``DecodeGraphs._launch``: k steps of forward + draw + on-device advance over the
static buffers, padded rows included) run eagerly on the CPU: a stand-in graph set that replays by calling the
body must give the synchronous engine's tokens and log-probs, seeded and greedy, with stops and finished rows."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from polyrl.infer import LLM, RolloutConfig, SamplingParams, cuda_graphs
from polyrl.models.decoder import build_model, init_weights

from .conftest import tiny_config


class EagerGraphs(cuda_graphs.DecodeGraphs):
    """``DecodeGraphs`` whose "replay" runs the captured body eagerly (the CPU has no graphs)."""

    launches = 0
    steps = 0

    def run(self, arrays, fed=None):
        bs = int(arrays["context_lens"].size)
        b = self.bucket(bs)
        self._fill(arrays, b, fed)
        return self._forward(b)[:bs]

    def decode_buffers(self, bs):
        from polyrl.infer.cuda_graphs import DecodeBuffers

        b = self.bucket(bs)
        return DecodeBuffers(self.input_ids[:bs], self.positions[:bs], self.slot_mapping[:bs], self.context_lens[:bs],
                             self.block_tables[:bs], lambda: self._forward(b)[:bs])  # fmt: skip

    def run_launch(self, arrays, fed, rows, steps):
        bs = int(arrays["context_lens"].size)
        b = self.bucket(bs)
        self._fill(arrays, b, fed, rows)
        tokens, logprobs = self._launch(b, steps)
        EagerGraphs.launches += 1
        EagerGraphs.steps += steps
        return tokens[:, :bs].clone(), logprobs[:, :bs].clone()


@pytest.fixture
def eager_graph_api(monkeypatch):
    stub_streams = types.SimpleNamespace(graph_pool_handle=lambda: None)
    monkeypatch.setattr(cuda_graphs.device, "graph_api", lambda: (object, None))
    monkeypatch.setattr(cuda_graphs.device, "stream_api", lambda: stub_streams)
    EagerGraphs.launches = EagerGraphs.steps = 0


def _engine(model, ahead: bool) -> LLM:
    # bucket sizes 1, 2, 4, 8, 16: batches of 5..13 rows are padded (padded rows must stay inert)
    cfg = RolloutConfig(block_size=4, num_blocks=400, max_num_seqs=16, overlap_decode=ahead, cuda_graphs=False)
    llm = LLM(model, None, cfg)
    if ahead:
        llm.runner.use_graphs = True
        llm.runner.graphs = EagerGraphs(model, llm.kv, cfg, llm.runner.max_blocks_per_seq)
    return llm


def test_launch_graph_body_equals_the_synchronous_engine(eager_graph_api):
    model = init_weights(build_model(tiny_config(), seed=0), seed=0, std=0.3).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 90, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (13,), generator=g)]
    params = [
        SamplingParams(temperature=0.0 if i % 4 == 0 else 0.9, seed=None if i % 4 == 0 else 100 + i,
                       max_tokens=3 + (i * 5) % 17, stop_token_ids=[7])
        for i in range(13)
    ]  # fmt: skip
    sync = _engine(model, ahead=False).generate(prompts, params)
    fused = _engine(model, ahead=True).generate(prompts, params)
    assert EagerGraphs.launches > 0 and EagerGraphs.steps > EagerGraphs.launches  # several steps per launch
    for a, b in zip(sync, fused):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].logprobs, b.outputs[0].logprobs, rtol=1e-5, atol=1e-5)


def test_truncated_rows_take_the_step_path(eager_graph_api):
    """top-k rows need the host sampler's masks: no launch graph for those batches, same tokens."""
    model = init_weights(build_model(tiny_config(), seed=1), seed=1, std=0.3).eval()
    params = SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=9, ignore_eos=True)
    sync = _engine(model, ahead=False).generate([[5, 6, 7], [8, 9]], params)
    fused = _engine(model, ahead=True).generate([[5, 6, 7], [8, 9]], params)
    assert EagerGraphs.launches == 0
    assert [o.outputs[0].token_ids for o in sync] == [o.outputs[0].token_ids for o in fused]
