"""Agent test fixtures: the tiny preset (ChatML tokenizer) as a rollout engine, and an env file factory."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from polyrl.infer import LLM, RolloutConfig

    return LLM.from_pretrained(
        str(tiny_model_dir), RolloutConfig(num_blocks=512, max_model_len=1024, max_num_seqs=64), dtype="float32"
    )
