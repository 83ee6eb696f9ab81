"""Incremental detokenisation: the text of a growing list of token ids, one token at a time.

Decoding the whole output every step costs O(n) per token; instead each step decodes a short window
``ids[prefix_offset:]`` and emits what it adds over ``ids[prefix_offset:read_offset]``. A window that ends
in an incomplete UTF-8 sequence (``\\ufffd``) emits nothing until the next token completes it. The
window starts at the first output token (not in the prompt), so the concatenated text equals
``tokenizer.decode(output_ids)`` for byte-level BPE tokenizers (Qwen, Llama 3, Mistral v3+).

Used only when a request needs text while it runs (stop strings, streaming); otherwise the engine
decodes once at the end.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += new
            return new
        return ""
