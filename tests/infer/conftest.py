"""Tiny fp32 decoders shared by the engine tests, and the matching transformers model (same weights)."""

from __future__ import annotations

import pytest
import torch

from polyrl.models.config import ModelConfig
from polyrl.models.decoder import build_model

VOCAB = 96
EOS = 1


def tiny_config(model_type: str = "qwen3", **over) -> ModelConfig:
    kw = dict(
        model_type=model_type,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        eos_token_id=EOS,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    kw.update(over)
    return ModelConfig(**kw)


def hf_twin(model):
    """The transformers model with ``model``'s weights (fp32, eager attention)."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**model.config.to_hf_dict())
    cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected, unexpected
    assert all("rotary" in m for m in missing) or not missing, missing
    return hf.eval()


@pytest.fixture(scope="session")
def tiny_model():
    torch.manual_seed(0)
    # A larger init std makes the distribution peaked enough that greedy choices are not near-ties.
    model = build_model(tiny_config(), dtype=torch.float32, seed=0)
    from polyrl.models.decoder import init_weights

    init_weights(model, seed=0, std=0.2)
    return model.eval()


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    return hf_twin(tiny_model)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls run faster on one thread, and the CI machine's cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
