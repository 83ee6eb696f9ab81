"""argparse types for the validation levels' numeric options: a value that cannot mean anything (``--sft-steps -3``,
``--rl-prompts 0``, ``--sft-lr nan``) is refused when the command line is parsed, before any level runs, instead of
failing a level (a failed level reads as a platform problem in the report), falling back to the default (``0`` was
taken as "unset") or running on most of the task (a negative count sliced the prompt list from its end)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(low: int, why: str = "") -> Callable[[str], int]:
    """An integer >= ``low``; ``why`` says where the bound comes from."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}{why}, got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value
