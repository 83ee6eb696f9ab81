"""The decode launch graph's body (``DecodeGraphs._launch``: k steps of forward + draw + on-device advance over the
static buffers, padded rows included) run eagerly on the CPU: a stand-in graph set that replays by calling the
body must give the synchronous engine's tokens and log-probs, seeded and greedy, with stops and finished rows."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from polyrl.errors import ConfigError
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


class _CpuStream:
    """A stand-in stream that records which streams it was made to wait for (CPU work runs in program order)."""

    current = None

    def __init__(self) -> None:
        self.waited: list[_CpuStream] = []

    def wait_stream(self, other: _CpuStream) -> None:
        self.waited.append(other)


class _StreamScope:
    def __init__(self, s: _CpuStream) -> None:
        self.s, self.prev = s, None

    def __enter__(self):
        self.prev, _CpuStream.current = _CpuStream.current, self.s
        return self.s

    def __exit__(self, *exc) -> None:
        _CpuStream.current = self.prev


@pytest.fixture
def eager_graph_api(monkeypatch):
    _CpuStream.current = _CpuStream()
    stub_streams = types.SimpleNamespace(
        graph_pool_handle=lambda: None,
        Stream=_CpuStream,
        current_stream=lambda: _CpuStream.current,
        stream=_StreamScope,
    )
    monkeypatch.setattr(cuda_graphs.device, "graph_api", lambda: (object, None))
    monkeypatch.setattr(cuda_graphs.device, "stream_api", lambda: stub_streams)
    EagerGraphs.launches = EagerGraphs.steps = 0


def _engine(model, ahead: bool, decode_streams: int = 1) -> LLM:
    # bucket sizes 1, 2, 4, 8, 16: batches of 5..13 rows are padded (padded rows must stay inert)
    cfg = RolloutConfig(block_size=4, num_blocks=400, max_num_seqs=16, overlap_decode=ahead, cuda_graphs=False,
                        decode_streams=decode_streams)  # fmt: skip
    llm = LLM(model, None, cfg)
    if ahead:
        llm.runner.use_graphs = True
        llm.runner.graphs = EagerGraphs(model, llm.kv, cfg, llm.runner.max_blocks_per_seq)
    return llm


@pytest.mark.parametrize("decode_streams", [1, 3], ids=["one-chain", "row-groups"])
def test_launch_graph_body_equals_the_synchronous_engine(eager_graph_api, monkeypatch, decode_streams):
    """With ``decode_streams`` 3 (MIN_GROUP_ROWS lowered to 2 rows) a bucket of 16 runs as two chains, rows [0, 8) and
    [8, 16), each over its own slice of the buffers (padded rows in the second): every row's tokens and log-probs must
    still be the synchronous engine's."""
    monkeypatch.setattr(cuda_graphs, "MIN_GROUP_ROWS", 2)
    model = init_weights(build_model(tiny_config(), seed=0), seed=0, std=0.3).eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 90, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (13,), generator=g)]
    params = [
        SamplingParams(temperature=0.0 if i % 4 == 0 else 0.9, seed=None if i % 4 == 0 else 100 + i,
                       max_tokens=3 + (i * 5) % 17, stop_token_ids=[7])
        for i in range(13)
    ]  # fmt: skip
    sync = _engine(model, ahead=False).generate(prompts, params)
    fused_engine = _engine(model, ahead=True, decode_streams=decode_streams)
    fused = fused_engine.generate(prompts, params)
    assert EagerGraphs.launches > 0 and EagerGraphs.steps > EagerGraphs.launches  # several steps per launch
    graphs = fused_engine.runner.graphs
    if decode_streams > 1:
        assert graphs.row_groups(16) == [(0, 8), (8, 8)]  # ceil(16 / 3) = 6 rows, rounded up to 8
        assert graphs.row_groups(40) == [(0, 16), (16, 16), (32, 8)]  # ceil(40 / 3) = 14 -> 16, the rest last
        assert graphs.row_groups(4) == [(0, 4)]  # groups are multiples of 8 rows
        assert len(graphs.side_streams) == 1  # the first group runs on the launching stream
        assert graphs.side_streams[0].waited  # forked from the launching stream
    else:
        assert graphs.row_groups(16) == [(0, 16)] and not graphs.side_streams
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


def test_decode_streams_is_validated():
    assert RolloutConfig().decode_streams == 1
    assert RolloutConfig(decode_streams=2).decode_streams == 2
    for bad in (0, 9, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="decode_streams must be"):
            RolloutConfig(decode_streams=bad)
