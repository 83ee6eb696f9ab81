"""Builtin string tasks with exact answers: ``reverse``, ``count`` and ``copy``.

- reverse: "Reverse the string: abc" -> "cba"      (params: min_len=3, max_len=6)
- count:   "How many times does the letter 'a' appear in 'abaca'?" -> "3"   (min_len=4, max_len=8)
- copy:    "Repeat exactly: qzt" -> "qzt"          (min_len=3, max_len=6)
Strings are random lowercase letters (count uses "abcde" so letters repeat); no word lists are shipped.
"""

from __future__ import annotations

import random
import string

from polyrl.data.builtin.check import check_number, check_string
from polyrl.errors import ConfigError

LEN_DEFAULTS = {"min_len": 3, "max_len": 6}


def validate_lengths(name: str, params: dict) -> None:
    lo, hi = int(params["min_len"]), int(params["max_len"])
    if lo < 1 or hi < lo:
        raise ConfigError(f"builtin:{name} needs 1 <= min_len <= max_len, got min_len={lo} max_len={hi}")


def _word(rng: random.Random, params: dict, alphabet: str = string.ascii_lowercase) -> str:
    n = rng.randint(int(params["min_len"]), int(params["max_len"]))
    return "".join(rng.choice(alphabet) for _ in range(n))


def _mutate(rng: random.Random, s: str) -> str:
    i = rng.randrange(len(s))
    c = rng.choice([c for c in string.ascii_lowercase if c != s[i]])
    return s[:i] + c + s[i + 1 :]


class Reverse:
    defaults = dict(LEN_DEFAULTS)
    check = staticmethod(check_string)

    @staticmethod
    def validate(params: dict) -> None:
        validate_lengths("reverse", params)

    @staticmethod
    def generate(rng: random.Random, params: dict) -> dict:
        w = _word(rng, params)
        return {"prompt": f"Reverse the string: {w}", "answer": w[::-1]}

    @staticmethod
    def wrong_answer(rng: random.Random, example: dict) -> str:
        return _mutate(rng, example["answer"])


class Count:
    defaults = {"min_len": 4, "max_len": 8}
    check = staticmethod(check_number)

    @staticmethod
    def validate(params: dict) -> None:
        validate_lengths("count", params)

    @staticmethod
    def generate(rng: random.Random, params: dict) -> dict:
        w = _word(rng, params, alphabet="abcde")
        letter = rng.choice("abcde")
        return {"prompt": f"How many times does the letter '{letter}' appear in '{w}'?", "answer": str(w.count(letter))}

    @staticmethod
    def wrong_answer(rng: random.Random, example: dict) -> str:
        value = int(example["answer"])
        return str(value + 1 if value == 0 or rng.random() < 0.5 else value - 1)


class Copy:
    defaults = dict(LEN_DEFAULTS)
    check = staticmethod(check_string)

    @staticmethod
    def validate(params: dict) -> None:
        validate_lengths("copy", params)

    @staticmethod
    def generate(rng: random.Random, params: dict) -> dict:
        w = _word(rng, params)
        return {"prompt": f"Repeat exactly: {w}", "answer": w}

    @staticmethod
    def wrong_answer(rng: random.Random, example: dict) -> str:
        return _mutate(rng, example["answer"])
