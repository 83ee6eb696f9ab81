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
        ("builtin:arithmetic?n=abc", "n='abc' must be an integer, e.g. n=8"),
        # every typed parameter is checked here, not by a bare ValueError mid-generation
        ("builtin:arithmetic?max=abc", "max='abc' must be an integer, e.g. max=20"),
        ("builtin:arithmetic?neg=maybe", "neg='maybe' must be an integer"),
        ("builtin:reverse?max_len=x", "max_len='x' must be an integer"),
        ("builtin:markov?mean_len=x", "mean_len='x' must be a number"),
        ("builtin:arithmetic?n=1.5", "n='1.5' must be an integer"),
        ("builtin:arithmatic", r"unknown builtin dataset 'arithmatic' \(did you mean arithmetic\?\)"),
        ("builtin:arithmetic?mx=3", r"no parameter\(s\) \['mx'\] \(did you mean max\?\)"),
        ("builtin:arithmetic?n=3&n=4", "parameter 'n' is given twice"),
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


def test_markov_text_is_one_fixed_language_with_a_known_entropy_floor():
    """builtin:markov: the same chain in every split and seed, NLL per word at the Zipf entropy, disjoint splits."""
    import math

    from polyrl.data.builtin import markov

    spec = "builtin:markov?vocab=32&order=2&branch=4&mean_len=20"
    params = {"vocab": "32", "order": "2", "branch": "4", "mean_len": "20"}
    train, test = generate(spec + "&n=400"), generate(spec + "&n=300@test")
    assert train == generate(spec + "&n=400") and train != generate(spec + "&n=400&seed=1")
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in test})
    probs = [1 / r for r in range(1, 5)]
    h_word = -sum(p / sum(probs) * math.log(p / sum(probs)) for p in probs)
    assert markov.word_entropy(params) == pytest.approx(h_word, rel=1e-12)
    words = completions = 0
    nll = 0.0
    for r in train + test:
        prompt = r["prompt"].removeprefix("Continue the text: ").split()
        body = r["completion"][:-1].split()
        assert r["completion"].endswith(".") and len(prompt) == 8 and 1 <= len(body) <= 256
        assert set(prompt + body) <= set(markov.WORDS[:32]) and check(r["completion"], r)
        nll += markov.completion_nll(r, params)
        words, completions = words + len(body), completions + 1
    stop = 1 / 20
    expected = words * h_word + (words - completions) * -math.log1p(-stop) + completions * -math.log(stop)
    assert nll == pytest.approx(expected, rel=0.03)  # the sampled words' NLL averages the chain's entropy
    assert 15 < words / completions < 25  # geometric lengths, mean 20
    # the chain: each context has `branch` successors (the same ones in both splits), most likely one ~48%
    k, seen = 2, {}
    for r in train + test:
        w = r["prompt"].removeprefix("Continue the text: ").split() + r["completion"][:-1].split()
        for i in range(k, len(w)):
            seen.setdefault(tuple(w[i - k : i]), []).append(w[i])
    assert max(len(set(v)) for v in seen.values()) == 4
    busy = max(seen.values(), key=len)
    top = max(set(busy), key=busy.count)
    assert busy.count(top) / len(busy) == pytest.approx(probs[0] / sum(probs), abs=0.12)
    # text that is not from this chain (an impossible word, a missing stop) has no finite NLL
    row = dict(train[0])
    assert markov.completion_nll({**row, "completion": row["completion"][:-1]}, params) == math.inf
    impossible = [w for w in markov.WORDS[:32] if markov.completion_nll({**row, "completion": w + "."}, params) > 1e9]
    assert len(impossible) == 32 - 4 and not check("the end", row) and not check("zebra.", row)
    with pytest.raises(ConfigError, match="branch=40 must be <= vocab=32"):
        generate("builtin:markov?vocab=32&branch=40")
    with pytest.raises(ConfigError, match="prompt_words=1 must be >= order=2"):
        DataConfig(path="builtin:markov?order=2&prompt_words=1")
    with pytest.raises(ConfigError, match="no parameter"):
        DataConfig(path="builtin:markov?max=3")


def test_markov_rows_train_as_sft(tokenizer):
    rows = generate("builtin:markov?n=6&mean_len=5")
    data = build_sft(DataConfig(path="builtin:markov?n=6&mean_len=5"), tokenizer)
    assert data.stats.sequences == 6 and data.stats.target_tokens >= sum(len(r["completion"].split()) for r in rows)
