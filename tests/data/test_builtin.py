"""Builtin tasks: deterministic generation, disjoint held-out split, parameters, preference rows, checkers."""

from __future__ import annotations

import pytest

from polyrl.data import DataConfig, build_sft, check, extract_answer, load_prompts
from polyrl.data.builtin import generate, names
from polyrl.errors import ConfigError


def test_names_include_preference_variants():
    assert {"arithmetic", "reverse", "count", "copy", "arithmetic-pref", "reverse-pref"} <= set(names())


@pytest.mark.parametrize("name", ["arithmetic", "reverse", "count", "copy"])
def test_deterministic_by_seed_and_answers_are_right(name):
    a = generate(f"builtin:{name}?n=50&seed=1")
    assert a == generate(f"builtin:{name}?n=50&seed=1")
    assert a != generate(f"builtin:{name}?n=50&seed=2")
    assert all(r["completion"] == r["answer"] and r["task"] == name for r in a)
    assert all(check(r["answer"], r) for r in a)


def test_arithmetic_answers_and_difficulty():
    rows = generate("builtin:arithmetic?n=300&max=9")
    for r in rows:
        a, op, b = r["prompt"].removeprefix("What is ").removesuffix("?").split()
        assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9 and op in "+-"
        assert int(r["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    assert {r["prompt"].split()[3] for r in rows} == {"+", "-"}
    mul = generate("builtin:arithmetic?n=20&ops=*&max=5")
    assert all(" * " in r["prompt"] for r in mul)


def test_arithmetic_max_b_bounds_the_second_operand_and_keeps_splits_disjoint():
    """The demo's task: "What is 57 + 2?" with unseen numbers in the test split."""
    spec = "builtin:arithmetic?max=99&max_b=2&ops=+&test=0.2"
    train, test = generate(spec), generate(spec + "@test")
    for r in train + test:
        a, _, b = r["prompt"].removeprefix("What is ").removesuffix("?").split()
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 2 and int(r["answer"]) == int(a) + int(b)
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in test})
    assert 40 <= len(test) <= 80  # 20% of the 300 distinct problems
    with pytest.raises(ConfigError, match="max_b"):
        generate("builtin:arithmetic?max_b=-1")


def test_arithmetic_min_bounds_both_operands():
    """The agent demo's task: products of two operands in 32..99, all with four digits."""
    rows = generate("builtin:arithmetic?min=32&max=99&ops=*&n=300")
    operands = [[int(x) for x in r["prompt"].removeprefix("What is ").removesuffix("?").split(" * ")] for r in rows]
    assert all(32 <= a <= 99 and 32 <= b <= 99 and int(r["answer"]) == a * b for (a, b), r in zip(operands, rows))
    assert {len(r["answer"]) for r in rows} == {4}
    assert min(min(p) for p in operands) < 40 and max(max(p) for p in operands) > 90  # the whole range is drawn
    for spec, message in (("min=-1", "min=-1 must be between 0 and max=20"), ("min=30", "min=30"),
                          ("min=5&max_b=2", "max_b=2 must be >= min=5")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            generate(f"builtin:arithmetic?{spec}")


def test_string_tasks_answers():
    for r in generate("builtin:reverse?n=20"):
        assert r["answer"] == r["prompt"].removeprefix("Reverse the string: ")[::-1]
    for r in generate("builtin:count?n=20"):
        letter, word = r["prompt"].split("'")[1], r["prompt"].split("'")[3]
        assert int(r["answer"]) == word.count(letter)
    for r in generate("builtin:copy?n=20&min_len=2&max_len=2"):
        assert r["answer"] == r["prompt"].removeprefix("Repeat exactly: ") and len(r["answer"]) == 2


def test_train_and_test_splits_are_disjoint():
    train = {r["prompt"] for r in generate("builtin:arithmetic?n=2000&max=20")}
    test = {r["prompt"] for r in generate("builtin:arithmetic?max=20@test")}
    assert len(test) == 67 and not train & test  # every distinct held-out problem of max=20
    assert generate("builtin:arithmetic?n=5", split="eval") == generate("builtin:arithmetic?n=5@test")


def test_preference_rows_have_a_wrong_rejected_answer():
    for name in ("arithmetic", "reverse", "count", "copy"):
        rows = generate(f"builtin:{name}-pref?n=30")
        assert all(r["chosen"] == r["answer"] != r["rejected"] for r in rows)
        assert all(check(r["chosen"], r) and not check(r["rejected"], r) for r in rows)


@pytest.mark.parametrize(
    "text, ok",
    [
        ("85", True),
        ("The answer is 85.", True),
        ("37 + 48 = 85", True),
        ("Answer: 85", True),
        ("I think \\boxed{85} is right", True),
        ("\\boxed{84} ... Answer: 85", False),  # \boxed wins over 'Answer:'
        ("84", False),
        ("", False),
        ("eighty-five", False),
    ],
)
def test_number_checker_forms(text, ok):
    assert check(text, {"answer": "85", "task": "arithmetic"}) is ok


def test_string_checker_and_extraction():
    ex = {"answer": "olleh", "task": "reverse"}
    assert check("olleh", ex) and check(" 'olleh'. ", ex) and check("Answer: olleh", ex)
    assert check("\\boxed{olleh}", ex) and not check("hello", ex) and not check("Olleh", ex)
    assert extract_answer("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert check("anything", {"answer": "anything"})  # no task: string match
    with pytest.raises(ConfigError, match="answer"):
        check("x", {"prompt": "q"})


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("builtin:nope", "unknown builtin dataset 'nope'"),
        ("builtin:arithmetic?max=0", "max=0 must be >= 1"),
        ("builtin:arithmetic?ops=/", "ops='/'"),
        ("builtin:arithmetic?depth=3", "no parameter"),
        ("builtin:arithmetic?n=abc", "bad parameter value"),
        ("builtin:reverse?min_len=5&max_len=2", "min_len <= max_len"),
        ("builtin:arithmetic?test=1.5", "fraction"),
    ],
)
def test_bad_builtin_specs_fail_at_config_time(spec, problem):
    with pytest.raises(ConfigError, match=problem):
        DataConfig(path=spec)


def test_small_problem_space_test_split_is_distinct_or_reported():
    default = generate("builtin:arithmetic?max=20@test")
    assert len(default) == len({r["prompt"] for r in default}) and 40 < len(default) < 200
    with pytest.raises(ConfigError, match="too small"):
        generate("builtin:arithmetic?max=1&ops=+&n=50@test")


def test_rl_prompt_view_keeps_answer_and_task_for_rewards(tokenizer):
    prompts, stats = load_prompts(DataConfig(path="builtin:count?n=10@test"))
    assert len(prompts) == 10 and stats.rows == 10
    assert all(p.task == "count" and check(p.answer, p) for p in prompts)
    assert prompts[0].messages == [{"role": "user", "content": prompts[0].messages[0]["content"]}]
    data = build_sft(DataConfig(path="builtin:reverse?n=8"), tokenizer)
    assert data.stats.sequences == 8
