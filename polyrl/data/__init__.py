"""polyrl.data: dataset sources and formats, chat-template tokenisation with loss masks, packing, builtin tasks.

Typical use (SFT)::
    cfg = DataConfig(path="builtin:arithmetic?max=20", max_seq_len=512)
    data = build_sft(cfg, tokenizer, micro_batch_tokens=4096)  # DataError names file/row/problem; stats
    it = data.iterator()                      # resumable: it.state_dict() / it.load_state_dict(...)
    batch = next(it)                          # PackedBatch (see docs/dev/contracts.md)

This package imports torch but never transformers or datasets at import time; the tokenizer is passed in.
"""

from polyrl.data.batch import IGNORE_INDEX, PackedBatch, pack_sequences, shifted_labels
from polyrl.data.builtin import check, extract_answer
from polyrl.data.chat import ChatTokenizer
from polyrl.data.config import DataConfig
from polyrl.data.dataset import DataStats, TokenizedData, build_preference, build_sft, load_examples, load_prompts
from polyrl.data.examples import ChatExample, PreferenceExample, PromptExample, TokenizedSeq, TokensExample
from polyrl.data.sampler import PackedBatchIterator

__all__ = [
    "IGNORE_INDEX",
    "ChatExample",
    "ChatTokenizer",
    "DataConfig",
    "DataStats",
    "PackedBatch",
    "PackedBatchIterator",
    "PreferenceExample",
    "PromptExample",
    "TokenizedData",
    "TokenizedSeq",
    "TokensExample",
    "build_preference",
    "build_sft",
    "check",
    "extract_answer",
    "load_examples",
    "load_prompts",
    "pack_sequences",
    "shifted_labels",
]
