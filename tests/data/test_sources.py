"""Sources (JSONL, JSON, Parquet, datasets saved dirs) and bad-row errors / skip counting through the pipeline."""

from __future__ import annotations

import json
import sys

import pytest

from polyrl.data import DataConfig, build_sft, load_examples, load_prompts
from polyrl.data.sources import iter_rows
from polyrl.errors import ConfigError, DataError

ROWS = [
    {"prompt": "What is 1 + 1?", "completion": "2"},
    {"instruction": "Reverse the string:", "input": "ab", "output": "ba"},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
]


def test_jsonl_json_list_and_data_key_give_the_same_rows(tmp_path, write_jsonl):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "b.json").write_text(json.dumps(ROWS))
    (tmp_path / "c.json").write_text(json.dumps({"data": ROWS}))
    for p in (a, tmp_path / "b.json", tmp_path / "c.json"):
        rows = list(iter_rows(str(p)))
        assert [r.data for r in rows] == ROWS and [r.row for r in rows] == [1, 2, 3]


def test_bad_jsonl_row_names_file_line_and_problem(tmp_path, write_jsonl):
    path = write_jsonl(
        tmp_path / "d.jsonl", [ROWS[0], "", '{"prompt": "x", "completion"', ROWS[1], {"foo": 1}, "[1, 2]"]
    )
    with pytest.raises(DataError) as err:
        load_examples(DataConfig(path=str(path)))
    msg = str(err.value)
    assert f"{path}: line 3: invalid JSON" in msg and "--skip-bad-rows" in msg
    examples, stats = load_examples(DataConfig(path=str(path), skip_bad_rows=True))
    assert len(examples) == 2 and stats.rows == 5 and stats.bad_rows == 3
    assert stats.bad_examples[1].startswith(f"{path}: line 5: cannot tell the format")
    assert stats.bad_examples[2] == f"{path}: line 6: expected a JSON object, got list"


def test_a_row_of_the_wrong_shape_names_its_keys(tmp_path, write_jsonl):
    """GSM8K-style question/answer rows for SFT or DPO: the error names the row's columns and what SFT wants."""
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "1 + 1?", "answer": "2"}])
    with pytest.raises(DataError) as err:
        load_examples(DataConfig(path=str(path)), "sft")
    msg = str(err.value)
    assert f"{path}: line 1: a prompt row with a reference answer is an RL row" in msg, msg
    assert "name the target column completion or response" in msg and "(the row's keys: question, answer)" in msg
    with pytest.raises(DataError, match=r"'chosen' and 'rejected' \(the row's keys: question, answer\)"):
        load_examples(DataConfig(path=str(path)), "dpo")


def test_bad_row_in_json_list_is_numbered_by_item(tmp_path):
    (tmp_path / "e.json").write_text(json.dumps([ROWS[0], {"messages": [{"role": "user", "content": "q"}]}]))
    with pytest.raises(DataError, match=r"e\.json: item 2: conversation has no assistant message"):
        load_examples(DataConfig(path=str(tmp_path / "e.json")))


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"What is {i} + 1?", "completion": str(i + 1)} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    examples, stats = load_examples(DataConfig(path=str(tmp_path / "p.parquet")))
    assert stats.rows == 4 and examples[3][1].messages[-1]["content"] == "4"
    assert examples[3][0] == f"{tmp_path / 'p.parquet'}: row 4"


def test_datasets_saved_dir_dataset_and_datasetdict_splits(tmp_path):
    import datasets

    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(3)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "single"))
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:1])})
    dd.save_to_disk(str(tmp_path / "multi"))
    assert [r.data for r in iter_rows(str(tmp_path / "single"))] == rows
    assert len(list(iter_rows(str(tmp_path / "multi")))) == 3
    assert [r.data for r in iter_rows(f"{tmp_path / 'multi'}@test")] == rows[:1]
    assert len(list(iter_rows(str(tmp_path / "multi"), split="test"))) == 1
    with pytest.raises(DataError, match="split 'valid' not found; available splits: train, test"):
        list(iter_rows(f"{tmp_path / 'multi'}@valid"))


def test_missing_datasets_package_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(DataError, match=r"needs the Hugging Face `datasets` package.*pip install"):
        list(iter_rows(str(tmp_path / "saved")))
    with pytest.raises(DataError, match="some/dataset"):
        list(iter_rows("some/dataset:cfg@train"))


def test_missing_file_is_a_config_error_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        DataConfig(path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="does not exist"):
        list(iter_rows(str(tmp_path / "nope.jsonl")))


def test_truncation_right_and_drop_are_counted(tmp_path, write_jsonl, tokenizer):
    long = {"prompt": "What is 12 + 7? " * 10, "completion": "19"}
    path = write_jsonl(tmp_path / "t.jsonl", [ROWS[0], long])
    right = build_sft(DataConfig(path=str(path), max_seq_len=24), tokenizer)
    # The long row's start is all prompt: cut there it has no target left, so it is dropped as too long (it was
    # counted as truncated and "without target tokens", and an all-dropped file blamed loss_on, not the length).
    assert right.stats.dropped_too_long == 1 and right.stats.truncated == 0 and right.stats.dropped_no_target == 0
    assert len(right.units) == 1
    with pytest.raises(DataError, match=r"1 longer than 24 tokens: dropped, or nothing left to train on once cut.*"
                       r"raise data.max_seq_len"):  # fmt: skip
        build_sft(DataConfig(path=write_jsonl(tmp_path / "long.jsonl", [long]), max_seq_len=24), tokenizer)
    drop = build_sft(DataConfig(path=str(path), max_seq_len=24, truncation="drop"), tokenizer)
    assert drop.stats.dropped_too_long == 1 and drop.stats.truncated == 0 and len(drop.units) == 1
    kept = build_sft(DataConfig(path=str(path), max_seq_len=24, loss_on="all"), tokenizer)
    assert len(kept.units) == 2 and len(kept.units[1][0]) == 24 and kept.units[1][0].truncated
    # A sequence longer than the packing budget follows the same policy.
    budget = build_sft(DataConfig(path=str(path), max_seq_len=512, loss_on="all"), tokenizer, micro_batch_tokens=24)
    assert max(len(u[0]) for u in budget.units) == 24 and budget.stats.truncated == 1


def test_holdout_split_is_disjoint_and_seeded(tmp_path, write_jsonl):
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(40)]
    path = write_jsonl(tmp_path / "h.jsonl", rows)
    cfg = DataConfig(path=str(path), holdout=0.25, seed=3)
    train = {w for w, _ in load_examples(cfg, part="train")[0]}
    test = {w for w, _ in load_examples(cfg, part="test")[0]}
    assert len(test) == 10 and len(train) == 30 and not train & test
    assert test == {w for w, _ in load_examples(cfg, part="test")[0]}
    other = {w for w, _ in load_examples(DataConfig(path=str(path), holdout=0.25, seed=4), part="test")[0]}
    assert other != test


def test_system_prompt_and_rl_prompts(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "s.jsonl", ROWS)
    prompts, _ = load_prompts(DataConfig(path=str(path), system_prompt="Be brief."))
    assert [p.answer for p in prompts] == ["2", "ba", "hello"]
    assert all(p.messages[0] == {"role": "system", "content": "Be brief."} for p in prompts)


def test_import_is_cheap():
    import subprocess

    heavy = "('transformers', 'datasets', 'pyarrow', 'triton')"
    code = f"import sys, polyrl.data; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
