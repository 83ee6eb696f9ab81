"""``LLM.abort_all``: a generate that fails half-way leaves no request behind, so the KV cache can be released and
the engine serves the next batch (what the colocated RL loop relies on after an exception)."""

from __future__ import annotations

import pytest

from polyrl.infer import LLM, RolloutConfig, SamplingParams
from polyrl.models.decoder import build_model

from .conftest import tiny_config


def test_abort_all_after_a_failed_generate_frees_the_engine():
    llm = LLM(build_model(tiny_config(), seed=0), None, RolloutConfig(num_blocks=64, max_num_seqs=4))
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=1)
    calls = {"n": 0}
    step = llm.step

    def failing_step(ahead=False):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device error")
        return step(ahead)

    llm.step = failing_step
    with pytest.raises(RuntimeError, match="device error"):
        llm.generate([[2, 3, 4], [5, 6]], params)
    assert llm.has_unfinished_requests()
    llm.abort_all()
    assert not llm.has_unfinished_requests() and llm.scheduler.num_running == 0
    llm.release()  # raises while requests are in flight
    llm.reallocate()
    llm.step = step
    out = llm.generate([[2, 3, 4]], params)
    assert len(out[0].outputs[0].token_ids) == 8
