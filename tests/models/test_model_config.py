"""ModelConfig: both HF config dialects in, both out; per-family derived facts; clear errors."""

from __future__ import annotations

import pytest

from polyrl.errors import CheckpointError, ConfigError, UserError
from polyrl.models.config import FULL, SLIDING, ModelConfig
from polyrl.models.registry import supported_model_types


def test_parse_each_family(tiny_config):
    llama, mistral, qwen2, qwen3 = (tiny_config(f) for f in ("llama", "mistral", "qwen2", "qwen3"))
    assert (llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (2, 4, 2, 16)
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_theta == 500000.0
    assert not llama.attention_bias and not llama.o_bias and not llama.qk_norm
    assert mistral.sliding_window == 6 and [mistral.layer_window(i) for i in range(2)] == [6, 6]
    assert qwen2.attention_bias and not qwen2.o_bias and qwen2.layer_window(1) is None
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.tie_word_embeddings


def test_qwen_sliding_window_follows_max_window_layers(tiny_config):
    cfg = tiny_config("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1)
    assert cfg.layer_types == [FULL, SLIDING]
    assert [cfg.layer_window(i) for i in range(2)] == [None, 5]
    off = tiny_config("qwen2", use_sliding_window=False, sliding_window=5)
    assert off.sliding_window is None and off.layer_window(1) is None


def test_rope_dialects_parse_the_same(tiny_config):
    v4 = tiny_config("llama", rope_theta=1234.0, rope_scaling={"type": "linear", "factor": 2.0})
    v5 = tiny_config(
        "llama", rope_scaling=None, rope_parameters={"rope_theta": 1234.0, "rope_type": "linear", "factor": 2.0}
    )
    assert v4.rope_theta == v5.rope_theta == 1234.0
    assert v4.rope_scaling == v5.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_hf_dict_round_trip(tiny_config, family):
    cfg = tiny_config(family, use_sliding_window=True, sliding_window=5, max_window_layers=1, custom_key="kept")
    again = ModelConfig.from_hf_dict(cfg.to_hf_dict())
    assert again == cfg
    assert again.to_hf_dict()["custom_key"] == "kept"


def test_transformers_reads_our_config_dict(tiny_config):
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config("llama")
    hf = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    assert hf.num_hidden_layers == 2 and hf.head_dim == 16
    rope = getattr(hf, "rope_parameters", None) or {**(hf.rope_scaling or {}), "rope_theta": hf.rope_theta}
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0 and rope["factor"] == 8.0
    q = transformers.AutoConfig.for_model(
        **tiny_config("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1).to_hf_dict()
    )
    assert list(q.layer_types) == [FULL, SLIDING] and q.sliding_window == 5


def test_unsupported_model_type_lists_supported():
    with pytest.raises(UserError) as err:
        ModelConfig.from_hf_dict({"model_type": "gpt2", "hidden_size": 8})
    for name in supported_model_types():
        assert name in str(err.value)
    assert "gpt2" in str(err.value)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(num_key_value_heads=3), "multiple of"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
        (dict(mlp_bias=True), "mlp_bias"),
    ],
)
def test_bad_configs_say_what_to_fix(tiny_config, overrides, words):
    with pytest.raises(ConfigError, match=words):
        tiny_config("llama", **overrides)


def test_missing_key_is_a_checkpoint_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 8}')
    with pytest.raises(CheckpointError, match="vocab_size|num_attention_heads|num_hidden_layers"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path / "nope")
