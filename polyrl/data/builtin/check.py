"""Answer extraction and exact-match checking for tasks with exact answers.

``extract_answer`` finds the model's final answer in a completion: the last ``\\boxed{...}``, else the last
``Answer: X`` line, else the whole text. Checkers compare it with the reference as a number or as a
string. This is matching, not grading: no partial credit, no symbolic maths.
"""

from __future__ import annotations

import re

_ANSWER_RE = re.compile(r"answer\s*(?:is)?\s*[:=]\s*(.+)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, with nested braces balanced; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_answer(text: str) -> str:
    """The final answer in ``text``: last \\boxed{...}, else the last 'Answer: X', else the stripped text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    matches = _ANSWER_RE.findall(text)
    if matches:
        return matches[-1].strip().splitlines()[0].strip() if matches[-1].strip() else ""
    return text.strip()


def _clean(s: str) -> str:
    s = s.strip()
    if s.endswith(".") and not s.endswith(".."):
        s = s[:-1].rstrip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"`":
        s = s[1:-1]
    return s


def check_number(text: str, answer: str) -> bool:
    """True when the last number in the extracted answer equals ``answer`` numerically."""
    numbers = _NUMBER_RE.findall(extract_answer(text).replace(",", ""))
    if not numbers:
        return False
    try:
        return float(numbers[-1]) == float(answer)
    except ValueError:
        return False


def check_string(text: str, answer: str) -> bool:
    """True when the extracted answer equals ``answer`` exactly, ignoring outer whitespace, quotes and a final '.'."""
    return _clean(extract_answer(text)) == _clean(answer)
