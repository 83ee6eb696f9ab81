"""DataConfig validation: messages say what to change; round trip through a dict (TOML table)."""

from __future__ import annotations

import pytest

from polyrl.data import DataConfig, build_sft
from polyrl.data.config import max_sequence_len
from polyrl.errors import ConfigError


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"format": "csv"}, "data.format='csv': use auto or one of"),
        ({"truncation": "left"}, "use 'right' or 'drop'"),
        ({"loss_on": "user"}, "data.loss_on='user'"),
        ({"packing": "bfd"}, "data.packing='bfd'"),
        ({"max_seq_len": 1}, "max_seq_len=1"),
        ({"limit": 0}, "data.limit=0"),
        ({"holdout": 1.0}, "data.holdout=1.0"),
    ],
)
def test_invalid_values_say_what_to_change(kwargs, problem):
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(")):
        DataConfig(path="builtin:arithmetic", **kwargs)


def test_dict_round_trip_and_unknown_keys():
    cfg = DataConfig(path="builtin:copy?n=4", max_seq_len=128, skip_bad_rows=True)
    assert DataConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match=r"unknown data setting\(s\) \['max_len'\]"):
        DataConfig.from_dict({"path": "builtin:copy", "max_len": 3})
    assert max_sequence_len(DataConfig(max_seq_len=4096), 1024) == 1024


def test_micro_batch_budget_is_checked_by_the_builder(tokenizer):
    """The packing budget belongs to the run (``engine.micro_batch_tokens``); the builders check what they get."""
    with pytest.raises(ConfigError, match="micro_batch_tokens=0"):
        build_sft(DataConfig(path="builtin:arithmetic"), tokenizer, micro_batch_tokens=0)


def test_empty_path_and_template_file(tmp_path, tokenizer, plain_tokenizer):
    with pytest.raises(ConfigError, match="--data"):
        build_sft(DataConfig(), tokenizer)
    (tmp_path / "t.jinja").write_text(tokenizer.chat_template)
    cfg = DataConfig(path="builtin:copy?n=3", chat_template=str(tmp_path / "t.jinja"))
    a, b = build_sft(cfg, plain_tokenizer), build_sft(DataConfig(path="builtin:copy?n=3"), tokenizer)
    assert [u[0].input_ids for u in a.units] == [u[0].input_ids for u in b.units]
    with pytest.raises(ConfigError, match="neither a Jinja template nor a file"):
        build_sft(DataConfig(path="builtin:copy?n=3", chat_template="missing.jinja"), tokenizer)
