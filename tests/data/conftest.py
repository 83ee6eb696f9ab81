"""Fixtures for the data tests: a tiny byte-level BPE tokenizer with a ChatML-like chat template.

Built here (not downloaded) so the tests run offline in well under a second; the vocabulary is trained on a few
sentences, and byte-level pre-tokenisation means any text still encodes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "What is 12 + 7? The answer is 19.",
    "Reverse the string: hello -> olleh",
    "user assistant system You are a helpful assistant.",
    "How many times does the letter 'a' appear in 'banana'? 3",
    "Repeat exactly: abc. Sure, here it is.",
]


def make_tokenizer(chat_template: str | None = CHATML):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=chat_template
    )


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def plain_tokenizer():
    return make_tokenizer(chat_template=None)


def _write_jsonl(path: Path, rows: list) -> Path:
    """Write rows (dicts as JSON, strings verbatim so tests can plant broken lines) one per line."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def write_jsonl():
    return _write_jsonl
