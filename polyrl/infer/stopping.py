"""When a sequence stops, checked after each sampled token (which is already appended).

Order, following vLLM: before ``min_tokens`` generated tokens only the length limits apply; then EOS
(unless ``ignore_eos``), ``stop_token_ids``, stop strings on the detokenised text (the text is cut
before the stop string, the token ids stay whole), ``max_tokens``, and the context length.

A stop string is searched only in the text the new token added plus ``len(stop) - 1`` characters
before it, so the check costs O(new text), not O(output). Host cost per token (``check_stop`` runs once per accepted
token: ``scripts/stop_check_host_profile.py`` measures it) is kept small two ways, neither changing a result:

- the detokenizer takes most tokens without a decode call (``detokenizer.TokenPieces``: a byte-level BPE token's
  own text, made once per id), and decodes through the tokenizer's Rust backend otherwise
  (``detokenizer.backend_decoder``);
- a new text is searched only when a stop string could end inside it (``StopScreen``, memoised per text and stop
  set): one of them lies inside it, or it starts with a proper suffix of one (whose rest would come before it).
  Any occurrence the search could find ends inside the new text, so it is one of those two cases.
"""

from __future__ import annotations

from typing import Any

from polyrl.infer.sequence import Sequence

_SCREEN_TEXTS = 1 << 14  # texts a StopScreen remembers (past that it still answers, without storing)
_SCREEN_SETS = 32  # stop sets remembered (the cache is emptied past that)
_SUFFIX_CHARS = 64  # a StopScreen keeps the stop strings' proper suffixes up to this long


def needs_detokenizer(seq: Sequence) -> bool:
    return bool(seq.params.stop) or seq.stream


def check_stop(
    seq: Sequence, token: int, eos_ids: frozenset[int], max_model_len: int, detokenizers: Any
) -> tuple[str, int | str | None] | None:
    """(finish_reason, stop_reason) when ``seq`` must stop after ``token``, else None.

    Feeds ``token`` to the sequence's detokenizer when it has one (made by ``detokenizers``, an
    ``infer.detokenizer.Detokenizers``, on the first token), except for a stopping EOS/stop token, whose text never
    belongs to the output."""
    p = seq.params
    n_tokens = len(seq.tokens)
    n_gen = n_tokens - seq.num_prompt
    if n_gen >= p.min_tokens:
        if token in eos_ids and not p.ignore_eos:
            return "stop", None
        if p.stop_token_ids and token in p.stop_token_ids:
            return "stop", token
    detok = seq.detok
    if detok is None and (p.stop or seq.stream):  # needs_detokenizer, inlined (per token)
        detok = seq.detok = detokenizers.new(p.skip_special_tokens)
        if p.stop:
            seq.stop_screen = stop_screen(p.stop)
    if detok is not None:
        new = detok.add(token)
        screen = seq.stop_screen  # None without stop strings
        if new and screen is not None and screen[new] and n_gen >= p.min_tokens:
            hit = _find_stop(detok.text, len(new), p.stop)
            if hit is not None:
                pos, s = hit
                detok.text = detok.text[:pos]
                return "stop", s
    if p.max_tokens is not None and n_gen >= p.max_tokens:
        return "length", None
    if n_tokens >= max_model_len:
        return "length", None
    return None


def _find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the newly added text."""
    best: tuple[int, str] | None = None
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        pos = text.find(s, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


class StopScreen(dict):
    """New text -> whether one of ``stops`` could end inside it (True: ``_find_stop`` must look; False: it would
    find nothing, whatever text comes before), answered once per distinct text."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        super().__init__()
        self.stops = stops
        # The proper suffixes up to _SUFFIX_CHARS long, made once: all of them would be len(s)^2 / 2 characters
        # (a 100,000-character stop string: 5 GB). Longer ones can only start a longer new text (``_long_tail``).
        self.suffixes = tuple(s[j:] for s in stops for j in range(max(1, len(s) - _SUFFIX_CHARS), len(s)))
        self.long = tuple(s for s in stops if len(s) > _SUFFIX_CHARS + 1)

    def __missing__(self, new: str) -> bool:
        hit = (
            new.startswith(self.suffixes)
            or any(s in new for s in self.stops)
            or bool(self.long and self._long_tail(new))
        )
        if len(self) < _SCREEN_TEXTS:
            self[new] = hit
        return hit

    def _long_tail(self, new: str) -> bool:
        """Whether ``new`` starts with a proper suffix of a stop string longer than ``_SUFFIX_CHARS``."""
        if len(new) <= _SUFFIX_CHARS:
            return False
        return any(
            s.endswith(new[:k]) for s in self.long for k in range(_SUFFIX_CHARS + 1, min(len(s) - 1, len(new)) + 1)
        )


_screens: dict[tuple[str, ...], StopScreen] = {}


def stop_screen(stops: list[str]) -> StopScreen:
    """The shared ``StopScreen`` of a stop set (once per sequence)."""
    key = tuple(stops)
    screen = _screens.get(key)
    if screen is None:
        if len(_screens) >= _SCREEN_SETS:
            _screens.clear()
        screen = _screens[key] = StopScreen(key)
    return screen
