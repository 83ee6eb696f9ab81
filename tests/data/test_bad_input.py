"""Issue 33: bad input stops with one line naming the file and row, or is skipped and counted; nothing is lost.

Non-UTF-8 bytes in a JSONL line (a byte-order mark is fine), and pre-tokenized ids outside the model's vocabulary.
"""

from __future__ import annotations

import codecs
import json

import pytest

from polyrl.data import DataConfig, build_sft, load_examples
from polyrl.data.dataset import vocab_limit
from polyrl.errors import DataError

GOOD = {"prompt": "What is 1 + 1?", "completion": "2"}


def _line(row: dict) -> bytes:
    return json.dumps(row).encode() + b"\n"


def test_non_utf8_jsonl_line_names_file_line_and_byte_offset(tmp_path):
    bad = b'{"prompt": "caf\xe9", "completion": "x"}\n'  # latin-1 e-acute
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(_line(GOOD) + bad + _line(GOOD))
    offset = len(_line(GOOD)) + bad.index(b"\xe9")
    with pytest.raises(DataError) as err:
        load_examples(DataConfig(path=str(path)))
    msg = str(err.value)
    assert f"{path}: line 2: not UTF-8 text (byte 0xe9 at byte offset {offset})" in msg
    assert "--skip-bad-rows" in msg and "\n" not in msg
    examples, stats = load_examples(DataConfig(path=str(path), skip_bad_rows=True))
    assert len(examples) == 2 and stats.rows == 3 and stats.bad_rows == 1
    assert stats.bad_examples[0].startswith(f"{path}: line 2: not UTF-8 text")


def test_binary_garbage_line_is_skipped_and_counted(tmp_path):
    path = tmp_path / "binary.jsonl"
    path.write_bytes(_line(GOOD) + bytes(range(128, 256)) + b"\n" + _line(GOOD))
    examples, stats = load_examples(DataConfig(path=str(path), skip_bad_rows=True))
    assert len(examples) == 2 and stats.bad_rows == 1


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(codecs.BOM_UTF8 + _line(GOOD) + _line(GOOD))
    examples, stats = load_examples(DataConfig(path=str(jsonl)))
    assert len(examples) == 2 and stats.bad_rows == 0
    js = tmp_path / "bom.json"
    js.write_bytes(codecs.BOM_UTF8 + json.dumps([GOOD]).encode())
    assert len(load_examples(DataConfig(path=str(js)))[0]) == 1


def test_non_utf8_json_file_names_file_and_byte_offset(tmp_path):
    path = tmp_path / "latin1.json"
    raw = b'[\n{"prompt": "caf\xe9", "completion": "x"}]'
    path.write_bytes(raw)
    with pytest.raises(DataError, match=rf"{path}: line 2: not UTF-8 text \(byte 0xe9 at byte offset 17\)"):
        load_examples(DataConfig(path=str(path)))


# ---- pre-tokenized ids against the vocabulary ------------------------------------------------------
def _tokens_file(tmp_path, ids_rows):
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in ids_rows))
    return path


def test_ids_past_the_tokenizer_vocabulary_name_file_and_row(tmp_path, tokenizer):
    n = len(tokenizer)
    path = _tokens_file(tmp_path, [[1, 2, 3], [1, n, 2], [4, 5, 6]])
    cfg = DataConfig(path=str(path), max_seq_len=64)
    with pytest.raises(DataError) as err:
        build_sft(cfg, tokenizer, micro_batch_tokens=128)
    msg = str(err.value)
    assert msg.startswith(f"{path}: line 2: input_ids[1]={n} is outside the vocabulary [0, {n})")
    assert "--skip-bad-rows" in msg
    data = build_sft(DataConfig(path=str(path), max_seq_len=64, skip_bad_rows=True), tokenizer, micro_batch_tokens=128)
    assert data.stats.bad_rows == 1 and data.stats.sequences == 2


def test_the_bound_is_the_models_vocab_size_when_the_folder_has_config_json(tmp_path, tokenizer, tiny_model_dir):
    from transformers import AutoTokenizer

    folder = tmp_path / "model"
    tokenizer.save_pretrained(folder)
    n = len(tokenizer)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": n + 16}))
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert vocab_limit(tok)[0] == n + 16
    path = _tokens_file(tmp_path, [[1, n + 15, 2], [1, n + 16, 2]])
    cfg = DataConfig(path=str(path), max_seq_len=64)
    with pytest.raises(DataError, match=rf"line 2: input_ids\[1\]={n + 16} is outside the vocabulary \[0, {n + 16}\)"):
        build_sft(cfg, tok, micro_batch_tokens=128)
    # an explicit vocab_size (the loaded model's) wins
    data = build_sft(cfg, tok, micro_batch_tokens=128, vocab_size=n + 17)
    assert data.stats.sequences == 2
