"""When a sequence stops, checked after each sampled token (which is already appended).

Order, following vLLM: before ``min_tokens`` generated tokens only the length limits apply; then EOS
(unless ``ignore_eos``), ``stop_token_ids``, stop strings on the detokenised text (the text is cut
before the stop string, the token ids stay whole), ``max_tokens``, and the context length.

A stop string is searched only in the text the new token added plus ``len(stop) - 1`` characters
before it, so the check costs O(new text), not O(output). The detokenizer decodes through the tokenizer's
Rust backend directly where transformers' ``decode`` would return exactly what the backend does
(``_backend_decoder``): the wrapper's own Python was ~3 of ~4 us per decode, two decodes per token.
"""

from __future__ import annotations

from typing import Any

from polyrl.infer.detokenizer import IncrementalDetokenizer
from polyrl.infer.sequence import Sequence


def needs_detokenizer(seq: Sequence) -> bool:
    return bool(seq.params.stop) or seq.stream


def check_stop(
    seq: Sequence, token: int, eos_ids: frozenset[int], max_model_len: int, tokenizer: Any
) -> tuple[str, int | str | None] | None:
    """(finish_reason, stop_reason) when ``seq`` must stop after ``token``, else None.

    Feeds ``token`` to the sequence's detokenizer when it has one (except for a stopping EOS/stop
    token, whose text never belongs to the output)."""
    p = seq.params
    n_tokens = len(seq.tokens)
    n_gen = n_tokens - seq.num_prompt
    if n_gen >= p.min_tokens:
        if not p.ignore_eos and token in eos_ids:
            return "stop", None
        if p.stop_token_ids and token in p.stop_token_ids:
            return "stop", token
    if seq.detok is None and (p.stop or seq.stream):  # needs_detokenizer, inlined (per token)
        seq.detok = IncrementalDetokenizer(_backend_decoder(tokenizer), p.skip_special_tokens)
    if seq.detok is not None:
        new = seq.detok.add(token)
        if new and p.stop and n_gen >= p.min_tokens:
            hit = _find_stop(seq.detok.text, len(new), p.stop)
            if hit is not None:
                pos, s = hit
                seq.detok.text = seq.detok.text[:pos]
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


def _backend_decoder(tokenizer: Any) -> Any:
    """What the detokenizer calls ``decode(ids, skip_special_tokens=...)`` on: the ``tokenizers.Tokenizer`` behind a
    transformers fast tokenizer when transformers' ``decode`` is its own, unchanged one (``decode`` from
    ``tokenization_utils_base``, ``_decode`` from the fast-tokenizer module: the backend's text, then only the
    optional clean-up of spaces) and that clean-up is off; else the tokenizer itself. Once per sequence."""
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
