"""``device.graph_capture``: a capture that fails leaves the process usable (found on the H200: one failed
capture left the CUDA RNG in capture mode, and every later random op in the process failed)."""

from __future__ import annotations

import pytest
import torch

from polyrl.platform import device


def _graphs():
    api = device.graph_api()
    if api is None:
        pytest.skip("CUDA graphs are not available on this device")
    return api


@pytest.mark.gpu
def test_failed_capture_raises_its_own_error_and_leaves_rng_streams_and_graphs_working():
    graph_cls, capture = _graphs()
    dev = device.torch_device()
    x = torch.ones(4, device=dev)
    stream_before = torch.cuda.current_stream()
    with pytest.raises(Exception, match="capturing|capture"):
        with capture(graph_cls()):
            x.sum().item()  # a host sync: forbidden inside a capture
    assert torch.cuda.current_stream() == stream_before  # not left on the capture's side stream
    assert torch.randn(1000, device=dev).abs().sum().item() > 0  # the RNG is out of capture mode
    # A random op inside a later capture replays with fresh noise, as after any clean capture.
    out = torch.empty(1000, device=dev)
    graph = graph_cls()
    with capture(graph):
        out.copy_(torch.rand(1000, device=dev))
    graph.replay()
    first = out.clone()
    graph.replay()
    device.synchronize()
    assert not torch.equal(first, out) and 0 <= out.min().item() and out.max().item() < 1


@pytest.mark.gpu
def test_python_error_inside_capture_is_reraised_unchanged():
    graph_cls, capture = _graphs()
    with pytest.raises(KeyError, match="boom"):
        with capture(graph_cls()):
            raise KeyError("boom")
    assert torch.randn(8, device=device.torch_device()).isfinite().all()
