"""Incremental detokenisation: the text of a growing list of token ids, one token at a time.

Decoding the whole output every step costs O(n) per token; instead each step decodes a short window
``ids[prefix_offset:]`` and emits what it adds over ``ids[prefix_offset:read_offset]``. A window that ends
in an incomplete UTF-8 sequence (``\\ufffd``) emits nothing until the next token completes it. The
window starts at the first output token (not in the prompt), so the concatenated text equals
``tokenizer.decode(output_ids)`` for byte-level BPE tokenizers (Qwen, Llama 3, Mistral v3+).

Most tokens need no decode call at all (``TokenPieces``): a byte-level BPE backend decodes ids by joining each
id's bytes (which do not depend on its neighbours) and reading them as UTF-8 with ``\\ufffd`` for what is not
valid. When nothing is held back (``read_offset == len(ids)``) and the new id's own text (``decode([id])``, made once
per id) is non-empty and holds no ``\\ufffd`` (its bytes are complete, valid UTF-8), the window's text is exactly the
previous window's text followed by that piece: UTF-8 read that way is the concatenation of its parts when the part
appended is valid (a valid part starts with no continuation byte, so whatever precedes it decodes the same). The
detokenizer then emits the piece and moves its offsets as the two decodes would have, without them. Any other case
(a held-back tail, a byte fragment, a skipped special token, a decoder that is not byte-level: Metaspace, WordPiece,
transformers' own ``decode``) takes the two decodes. Only the window's ids are kept (one token after a piece), and the
text as a list of pieces, joined when read: a token taken by its piece touches no list but that one.

``Detokenizers`` makes each sequence's detokenizer for one tokenizer and holds what they share: the decoder to call
(``backend_decoder``: the Rust backend where transformers' ``decode`` would return exactly its text) and the piece
tables (at most one string per vocabulary id and ``skip_special_tokens`` value). Used only when a request needs
text while it runs (stop strings, streaming); otherwise the engine decodes once at the end.
"""

from __future__ import annotations

from typing import Any


class TokenPieces(dict):
    """Token id -> its text when appending it to any window whose tail is not held back adds exactly that text, else
    ``""``; filled on first sight of each id (one ``decode([id])``). Only for a byte-level decoder
    (``token_pieces``)."""

    def __init__(self, backend: Any, skip_special_tokens: bool) -> None:
        super().__init__()
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens

    def __missing__(self, token_id: int) -> str:
        piece = self.backend.decode([token_id], skip_special_tokens=self.skip_special_tokens)
        if "\ufffd" in piece:  # a byte fragment (or a literal U+FFFD: not told apart, so not taken)
            piece = ""
        self[token_id] = piece
        return piece


def token_pieces(decoder: Any, skip_special_tokens: bool) -> TokenPieces | None:
    """The piece table of ``decoder`` when it is a ``tokenizers.Tokenizer`` whose decoder is byte-level (ids decode to
    their joined bytes read as UTF-8), else None (no shortcut: each token takes the two decodes)."""
    try:
        # lazy: only a tokenizers backend can have a byte-level decoder
        from tokenizers import Tokenizer, decoders
    except ModuleNotFoundError:  # pragma: no cover - tokenizers comes with transformers
        return None
    if not isinstance(decoder, Tokenizer) or not isinstance(decoder.decoder, decoders.ByteLevel):
        return None
    return TokenPieces(decoder, skip_special_tokens)


class _NoPieces(dict):
    """The piece table of a decoder without the shortcut: every id takes the two decodes."""

    def __missing__(self, token_id: int) -> str:
        return ""


_NO_PIECES = _NoPieces()


class IncrementalDetokenizer:
    """The text of the ids added so far. Only the decode window is kept (``window``: the ids from ``prefix_offset``
    on, of which the last ``held`` were not emitted yet); after a token taken by its piece the window is that one
    token (``_win`` None, the id in ``_last``), as the two decodes would have left it, and nothing else is stored."""

    __slots__ = ("tokenizer", "skip_special_tokens", "pieces", "_win", "_last", "held", "_parts")

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, pieces: TokenPieces | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.pieces: dict[int, str] = _NO_PIECES if pieces is None else pieces
        self._win: list[int] | None = []
        self._last = -1
        self.held = 0
        self._parts: list[str] = []  # the text, joined when read (appending is O(1), not O(text))

    @property
    def window(self) -> list[int]:
        return list(self._win) if self._win is not None else [self._last]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completes (possibly empty)."""
        if not self.held:
            new = self.pieces[token_id]
            if new:  # what the two decodes below would emit; the window becomes this token
                self._last = token_id
                self._win = None
                self._parts.append(new)
                return new
        win = self._win if self._win is not None else [self._last]
        read = len(win) - self.held
        win.append(token_id)
        prefix = self._decode(win[:read])
        full = self._decode(win)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self._win = win[read:]  # the next window starts where this one's unread part did
            self.held = 0
            self._parts.append(new)
            return new
        self._win = win
        self.held += 1
        return ""

    @property
    def text(self) -> str:
        """The text so far (a stop string and what follows it cut off by the stop check)."""
        parts = self._parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    @text.setter
    def text(self, value: str) -> None:
        self._parts = [value]


class Detokenizers:
    """Each sequence's ``IncrementalDetokenizer`` for one tokenizer (``new``), sharing the decoder to call and, per
    ``skip_special_tokens``, the piece table. Nothing is computed until the first ``new``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decoder: Any = None
        self._pieces: dict[bool, TokenPieces | None] = {}

    def new(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        if self._decoder is None:
            self._decoder = backend_decoder(self.tokenizer)
        skip = bool(skip_special_tokens)
        if skip not in self._pieces:
            self._pieces[skip] = token_pieces(self._decoder, skip)
        return IncrementalDetokenizer(self._decoder, skip, self._pieces[skip])


def backend_decoder(tokenizer: Any) -> Any:
    """What the detokenizer calls ``decode(ids, skip_special_tokens=...)`` on: the ``tokenizers.Tokenizer`` behind a
    transformers fast tokenizer when transformers' ``decode`` is its own, unchanged one (``decode`` from
    ``tokenization_utils_base``, ``_decode`` from the fast-tokenizer module: the backend's text, then only the
    optional clean-up of spaces) and that clean-up is off; else the tokenizer itself. Calling the backend skips the
    wrapper's own Python (~3 of ~4 us per decode)."""
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    ok = (
        backend is not None
        and callable(getattr(backend, "decode", None))
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        and getattr(getattr(cls, "decode", None), "__module__", "") == "transformers.tokenization_utils_base"
        and getattr(getattr(cls, "_decode", None), "__module__", "")
        in ("transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast")
    )
    return backend if ok else tokenizer
