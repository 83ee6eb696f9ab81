"""Builtin ``arithmetic``: "What is 37 + 48?" -> "85", small integers so a tiny model learns it on CPU.

Parameters: ``max`` (largest operand, default 20), ``min`` (smallest operand, default 0; ``min=32&max=99&ops=*``
gives products that all have four digits), ``max_b`` (largest second operand, default ``max``; a small
``max_b`` with a large ``max`` gives "What is 57 + 2?" problems whose held-out instances are new numbers), ``ops``
(subset of "+-*", default "+-"), ``neg`` (1 allows negative results of subtraction, default 0), ``noise`` (the
fraction of rows whose demonstrated ``completion`` is off by one, ``answer + 1``, while ``answer`` stays right:
flawed demonstrations that SFT imitates and RL with the exact-match reward corrects; the test split is never noisy;
default 0).
Not a maths benchmark: no word problems, no reasoning chains.
"""

from __future__ import annotations

import random

from polyrl.data.builtin.check import check_number
from polyrl.errors import ConfigError

DEFAULTS = {"max": 20, "min": 0, "max_b": None, "ops": "+-", "neg": 0, "noise": 0.0}


def validate(params: dict) -> None:
    if int(params["max"]) < 1:
        raise ConfigError(f"builtin:arithmetic max={params['max']} must be >= 1; use e.g. max=20")
    lo = int(params["min"])
    if not 0 <= lo <= int(params["max"]):
        raise ConfigError(f"builtin:arithmetic min={lo} must be between 0 and max={params['max']}; use e.g. min=10")
    if params.get("max_b") is not None and int(params["max_b"]) < lo:
        raise ConfigError(f"builtin:arithmetic max_b={params['max_b']} must be >= min={lo}; use e.g. max_b=2")
    if not 0.0 <= float(params["noise"]) < 1.0:
        raise ConfigError(
            f"builtin:arithmetic noise={params['noise']} must be a fraction in [0, 1); use e.g. noise=0.6"
        )
    ops = str(params["ops"])
    if not ops or set(ops) - set("+-*"):
        raise ConfigError(f"builtin:arithmetic ops={ops!r} must be made of '+', '-', '*'; use e.g. ops=+-")


def generate(rng: random.Random, params: dict) -> dict:
    hi = int(params["max"])
    op = rng.choice(str(params["ops"]))
    hi_b = hi if params.get("max_b") is None else int(params["max_b"])
    lo = int(params["min"])
    a, b = rng.randint(lo, hi), rng.randint(lo, hi_b)
    if op == "-" and not int(params["neg"]) and b > a:
        a, b = b, a
    value = a + b if op == "+" else a - b if op == "-" else a * b
    row = {"prompt": f"What is {a} {op} {b}?", "answer": str(value)}
    noise = float(params["noise"])
    if noise > 0 and rng.random() < noise:  # no draw without noise: noise-free specs give the rows they always gave
        row["completion"] = str(value + 1)
    return row


def wrong_answer(rng: random.Random, example: dict) -> str:
    value = int(example["answer"])
    return str(value + rng.choice([-3, -2, -1, 1, 2, 3, 10]))


check = check_number
