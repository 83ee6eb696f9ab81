"""``infer.stopping.check_stop`` with the detokenizer's piece shortcut and the stop screen gives, token by token, what
the plain rules give: a reference written here (two decodes through transformers' ``decode`` per token, stop strings
searched over the whole text) is run beside it on the same token streams, and every step's result and text must be
equal. Cases: stop strings across tokens, inside one token, before and after ``min_tokens``, with multi-byte
characters split over byte tokens, several at once, EOS and stop ids, ``skip_special_tokens`` either way, a tokenizer
without the shortcut; then random streams and stop sets. Also: the shortcut is taken (no decode call for whole
tokens) and is refused where it would not be exact. A tiny locally trained byte-level BPE, CPU, a few seconds."""

from __future__ import annotations

import random

import pytest

from polyrl.infer.detokenizer import Detokenizers, IncrementalDetokenizer, TokenPieces, token_pieces
from polyrl.infer.sampling_params import SamplingParams
from polyrl.infer.sequence import Sequence
from polyrl.infer.stopping import StopScreen, check_stop

MAX_MODEL_LEN = 10_000


@pytest.fixture(scope="module")
def tok():
    from polyrl.models.tokenizer import build_tokenizer

    t = build_tokenizer(640, trained_vocab=600)
    t.add_tokens(["<tool>", "→ok"])  # added (not special) tokens: their text is their content, through the decoder
    return t


class _RefDetok:
    """The detokenizer's rule, plainly: per token, decode the window with and without it (transformers' decode)."""

    def __init__(self, tok, skip: bool) -> None:
        self.tok, self.skip, self.ids, self.text, self.p, self.r = tok, skip, [], "", 0, 0

    def add(self, t: int) -> str:
        self.ids.append(t)
        prefix = self.tok.decode(self.ids[self.p : self.r], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self.p :], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.p, self.r = self.r, len(self.ids)
            self.text += new
            return new
        return ""


def _reference(tok, prompt_len: int, stream: list[int], p: SamplingParams, eos: frozenset[int]) -> list[tuple]:
    """Per fed token: (result, text). Order: min_tokens gates EOS, stop ids and stop strings; a stop string counts when
    an occurrence ends inside the text the token added (the earliest such occurrence, the first listed stop on a
    tie); then max_tokens, then the context length."""
    detok = _RefDetok(tok, p.skip_special_tokens) if p.stop else None
    out = []
    for i, t in enumerate(stream):
        n_gen = i + 1
        res = None
        if n_gen >= p.min_tokens and not p.ignore_eos and t in eos:
            res = ("stop", None)
        elif n_gen >= p.min_tokens and t in p.stop_token_ids:
            res = ("stop", t)
        else:
            if detok is not None:
                before = len(detok.text)
                new = detok.add(t)
                if new and n_gen >= p.min_tokens:
                    found = [
                        (pos, k, s)
                        for k, s in enumerate(p.stop)
                        for pos in range(len(detok.text) - len(s) + 1)
                        if detok.text.startswith(s, pos) and pos + len(s) > before
                    ]
                    if found:
                        pos, _, s = min(found)
                        detok.text = detok.text[:pos]
                        res = ("stop", s)
            if res is None and p.max_tokens is not None and n_gen >= p.max_tokens:
                res = ("length", None)
            if res is None and prompt_len + n_gen >= MAX_MODEL_LEN:
                res = ("length", None)
        out.append((res, detok.text if detok is not None else None))
        if res is not None:
            break
    return out


def _engine(tok, prompt: list[int], stream: list[int], p: SamplingParams, eos: frozenset[int], detoks=None):
    """The same through ``check_stop``, as the engine feeds it (the token appended first)."""
    detoks = detoks or Detokenizers(tok)
    seq = Sequence(0, "r", 0, prompt, p)
    out = []
    for t in stream:
        seq.tokens.append(t)
        res = check_stop(seq, t, eos, MAX_MODEL_LEN, detoks)
        out.append((res, seq.detok.text if seq.detok is not None else None))
        if res is not None:
            break
    return out


def _same(tok, stream, detoks=None, eos=None, **kw):
    eos = frozenset({tok.eos_token_id}) if eos is None else eos
    p = SamplingParams(temperature=0, **{"max_tokens": None, **kw})
    prompt = tok.encode("the river mill")
    want = _reference(tok, len(prompt), stream, p, eos)
    got = _engine(tok, prompt, stream, p, eos, detoks)
    assert got == want
    return want


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_stop_string_across_tokens_and_inside_one(tok):
    ids = _ids(tok, "The answer is 42. Thanks!")
    assert tok.decode(ids[1:2]) == " answer"  # a whole word in one token: "nsw" lies inside it
    steps = _same(tok, ids, stop=["r is 4"])
    assert steps[-1] == (("stop", "r is 4"), "The answe") and len(steps) == 5  # completed by "4", the 5th token
    steps = _same(tok, ids, stop=["nsw"])
    assert steps[-1] == (("stop", "nsw"), "The a") and len(steps) == 2
    steps = _same(tok, ids, stop=["The answer is 42. Thanks!"])  # the whole output
    assert steps[-1] == (("stop", "The answer is 42. Thanks!"), "")
    steps = _same(tok, ids, stop=["<never-stop>"])
    assert steps[-1] == (None, "The answer is 42. Thanks!")


def test_several_stop_strings_the_earliest_wins(tok):
    ids = _ids(tok, "what is the sum of two and three")
    steps = _same(tok, ids, stop=["three", "sum", "is the"])
    assert steps[-1] == (("stop", "is the"), "what ")
    steps = _same(tok, ids, stop=["he s", "the s"])  # both completed by " s": the earlier start wins
    assert steps[-1] == (("stop", "the s"), "what is ") and len(steps) == 5
    assert _same(tok, ids, stop=["the", "th"])[-1][0] == ("stop", "the")  # the same start: the first listed
    assert _same(tok, ids, stop=["th", "the"])[-1][0] == ("stop", "th")
    assert _same(tok, ids, stop=["three", "um of t"])[-1] == (("stop", "um of t"), "what is the s")


def test_min_tokens_skips_an_early_stop_string(tok):
    ids = _ids(tok, "the cat and the dog and the bird")
    assert tok.decode(ids[:2]) == "the"  # "t", "he"
    first = _same(tok, ids, stop=["the"])
    assert first[-1] == (("stop", "the"), "") and len(first) == 2
    later = _same(tok, ids, stop=["the"], min_tokens=3)
    assert later[-1] == (("stop", "the"), "the cat and ") and len(later) == 6
    # a stop string completed before min_tokens is not found later, though it stays in the text
    ids = _ids(tok, "the cat sat")
    assert _same(tok, ids, stop=["the cat"], min_tokens=3)[-1] == (("stop", "the cat"), "")  # at the 3rd token
    assert _same(tok, ids, stop=["the cat"], min_tokens=4)[-1] == (None, "the cat sat")


def test_multi_byte_characters_over_byte_tokens(tok):
    ids = _ids(tok, "naïve café — 日本語 ok")
    pieces = [tok.decode([t]) for t in ids]
    assert any("\ufffd" in x for x in pieces)  # characters split over byte tokens: held back until complete
    for stop in (["ï"], ["本語"], ["é —"], ["語 o"], ["日"], ["ok"], ["\ufffd"], ["<never-stop>"]):
        _same(tok, ids, stop=stop)
    assert _same(tok, ids, stop=["本語"])[-1] == (("stop", "本語"), "naïve café — 日")
    # a byte fragment that never completes: its \ufffd is emitted once valid text follows
    broken = ids[:2] + [ids[2]] + _ids(tok, "xyz") + ids[-1:]
    steps = _same(tok, broken, stop=["\ufffdx"])
    assert steps[-1][0] == ("stop", "\ufffdx")


def test_eos_stop_ids_lengths_and_special_tokens(tok):
    ids = _ids(tok, "one two three four five")
    eos = tok.eos_token_id
    with_eos = ids[:3] + [eos] + ids[3:]
    assert _same(tok, with_eos, stop=["zzz"])[-1] == (("stop", None), tok.decode(ids[:3]))
    assert _same(tok, with_eos, stop=["zzz"], ignore_eos=True, skip_special_tokens=False)[-1][0] is None
    steps = _same(tok, with_eos, stop=["<|im_end|> f"], ignore_eos=True, skip_special_tokens=False)
    assert steps[-1][0] == ("stop", "<|im_end|> f")
    _same(tok, with_eos, stop=["e f"], ignore_eos=True, skip_special_tokens=True)  # the special token adds no text
    assert _same(tok, with_eos, stop=["four"], stop_token_ids=[ids[2]])[-1][0] == ("stop", ids[2])
    steps = _same(tok, with_eos, stop=["four"], stop_token_ids=[ids[2]], min_tokens=4)  # then EOS, at the 4th
    assert steps[-1] == (("stop", None), "one two three")
    steps = _same(tok, with_eos, stop=["four"], stop_token_ids=[ids[2]], min_tokens=4, ignore_eos=True)
    assert steps[-1] == (("stop", "four"), "one two three ")
    assert _same(tok, ids, stop=["zzz"], max_tokens=2)[-1] == (("length", None), tok.decode(ids[:2]))
    tool = _ids(tok, "a <tool> →ok b")
    assert _same(tok, tool, stop=["l> →"])[-1][0] == ("stop", "l> →")
    assert _same(tok, tool, stop=["ok b"])[-1][0] == ("stop", "ok b")


@pytest.mark.parametrize("skip", [True, False])
def test_random_streams_and_stop_sets_match_the_reference(tok, skip):
    rng = random.Random(7 if skip else 8)
    detoks = Detokenizers(tok)  # shared, as one engine shares it: its tables fill across cases
    vocab = len(tok)
    texts = ["naïve café — 日本語 ok", "What is 12 + 7? The answer is 19.", "a <tool> →ok b", "x<filler_3>y"]
    stopped = 0
    for case in range(150):
        if case % 3 == 0:  # any ids: byte fragments, merges, fillers, special and added tokens
            stream = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        else:
            stream = _ids(tok, rng.choice(texts)) + [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
        full = tok.decode(stream, skip_special_tokens=skip)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if full and rng.random() < 0.8:  # usually a piece of the text, so that it stops
                a = rng.randrange(len(full))
                stops.append(full[a : a + rng.randint(1, 6)])
            else:
                stops.append(rng.choice(["<never-stop>", "\ufffd", ">", "<", "zz"]))
        kw = dict(stop=stops, skip_special_tokens=skip, min_tokens=rng.choice([0, 0, 2, 5]))
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [rng.randrange(vocab)]
        steps = _same(tok, stream, detoks, ignore_eos=rng.random() < 0.5, **kw)
        stopped += steps[-1][0] is not None and isinstance(steps[-1][0][1], str)
    assert stopped > 50  # most cases end on a stop string


def test_whole_tokens_take_no_decode_call(tok, monkeypatch):
    calls = []
    decode = IncrementalDetokenizer._decode
    monkeypatch.setattr(IncrementalDetokenizer, "_decode", lambda self, ids: calls.append(ids) or decode(self, ids))
    d = Detokenizers(tok).new(True)
    assert isinstance(d.pieces, TokenPieces)
    ids = _ids(tok, "What is 12 + 7? The answer is 19.")
    assert "".join(d.add(t) for t in ids) == d.text == tok.decode(ids)
    assert calls == []  # every token's text came from the piece table
    split = _ids(tok, "日本")
    assert [d.add(t) for t in split] == ["", "", "日", "", "", "本"]  # byte tokens: the two decodes, held back
    assert len(calls) == 2 * len(split) and d.text == tok.decode(ids + split)
    assert d.window == split[3:] and d.held == 0  # the plain rule's window: from the first byte of "本"


def test_the_shortcut_is_refused_where_it_would_not_be_exact(tok):
    from tokenizers import Tokenizer, decoders, models

    wl = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    assert token_pieces(wl, True) is None  # no decoder: tokens are joined with spaces
    wl.decoder = decoders.WordPiece()
    assert token_pieces(wl, True) is None
    assert token_pieces(tok, True) is None  # transformers' decode, not the backend
    wrapped = Detokenizers(tok)
    tok.clean_up_tokenization_spaces = True  # transformers changes the backend's text: no backend, no shortcut
    try:
        d = wrapped.new(True)
        assert d.tokenizer is tok and not isinstance(d.pieces, TokenPieces)
        ids = _ids(tok, "What is 12 + 7? The answer is 19 .")
        assert "".join(d.add(t) for t in ids) == d.text
        _same(tok, ids, stop=["19 ."])
    finally:
        tok.clean_up_tokenization_spaces = False


def test_stop_screen_answers_what_a_search_would_find():
    screen = StopScreen(("<never-stop>", "ab"))
    assert screen["<filler_12>"] is False  # starts with "<", which only the whole stop string does
    assert screen[">x"] is True and screen["p>"] is True and screen["b"] is True  # a stop's tail, its head before
    assert screen["xaby"] is True and screen["xa"] is False and screen[""] is False
    assert set(screen) == {"<filler_12>", ">x", "p>", "b", "xaby", "xa", ""}  # remembered


def test_stop_screen_of_a_long_stop_string_is_small_and_still_exact():
    # Every proper suffix was kept: len^2 / 2 characters, 5 GB for a 100,000-character stop string (a served request
    # that sent one had the server OOM-killed). Now 64 per stop string, and the answers are the same.
    import random

    rng = random.Random(0)
    stop = "".join(rng.choice("ab") for _ in range(5_000))
    screen = StopScreen((stop, "xyz"))
    assert sum(len(s) for s in screen.suffixes) < 5_000
    tails = [stop[-k:] + "q" for k in (1, 64, 65, 300)]  # a proper suffix of the stop string, then other text
    for new in [*tails, "q" + stop[:70], "xy", "zq", "q" * 200, stop[5:80] + "q"]:
        want = any(new.startswith(s[j:]) for s in screen.stops for j in range(1, len(s))) or any(
            s in new for s in screen.stops
        )
        assert screen[new] is want, new[:20]
    assert all(screen[t] for t in tails) and not screen["q" * 200]
