"""Reward sums: the spec parser (``reward_sources.parse_spec`` / ``check_spec``) and the scoring of sums that mix
builtins, functions of the user's files and the reward model (``open_rewards``)."""

from __future__ import annotations

import pytest

from polyrl.algorithms.reward_sources import RewardConfig, check_spec, open_rewards, parse_spec
from polyrl.algorithms.reward_sources.model import load_reward_model, save_reward_model
from polyrl.algorithms.rewards import resolve
from polyrl.errors import ConfigError
from polyrl.models.checkpoint import load_tokenizer

EX = {"prompt": "2+2?", "messages": [{"role": "user", "content": "2+2?"}], "answer": "4", "metadata": {}}


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sum_rm") / "rm"
    save_reward_model(load_reward_model(tiny_model_dir, seed=3), folder, load_tokenizer(tiny_model_dir))
    return folder


def test_a_function_summed_with_the_reward_model(reward_model_dir):
    # the function term's pool was once checked alone against [reward], whose model it does not name: refused
    cfg = RewardConfig(model=str(reward_model_dir))
    with open_rewards("model", cfg, workers=0, device="cpu") as alone:
        model_only = alone.score(["4", "5"], [EX, EX]).rewards
    with open_rewards("exact_match+0.5*model", cfg, workers=0, device="cpu") as scorer:
        res = scorer.score(["4", "5"], [EX, EX])
    assert res.num_failures == 0
    assert res.rewards == pytest.approx([1.0 + 0.5 * model_only[0], 0.5 * model_only[1]])


# ---- the parser ---------------------------------------------------------------------------------------------------
USER = """
import time

def fmt(completion, example):
    return float(completion.startswith("4"))

def score(completion, example):
    return {"reward": len(completion) / 10, "chars": float(len(completion))}

def picky(completion, example):
    if completion == "boom":
        raise KeyError("no_such_field")
    return 0.5

def slow(completion, example):
    if completion == "hang":
        time.sleep(60)
    return 1.0

def one_arg(completion):
    return 1.0
"""


@pytest.fixture()
def user_dir(tmp_path, monkeypatch):
    """A folder with reward files whose names hold dots and dashes; the working directory for relative paths."""
    (tmp_path / "my-rewards.v2.py").write_text(USER)
    (tmp_path / "sub.dir").mkdir()
    (tmp_path / "sub.dir" / "other-file.py").write_text(USER)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _terms(spec):
    return [(t.kind, t.weight, t.arg, t.name) for t in parse_spec(spec)]


def test_sums_with_functions_of_your_own_parse(user_dir):
    assert _terms("exact_match+0.5*my-rewards.v2.py:fmt") == [
        ("functions", 1.0, "exact_match", None),
        ("user", 0.5, "my-rewards.v2.py:fmt", "fmt"),
    ]
    # several files, spaces around + and *, an exponent's sign, a dotted module, a POSIX path with dots and dashes
    assert _terms(f" 0.7 * my-rewards.v2.py:fmt + 3e-1*{user_dir}/sub.dir/other-file.py:score+1e+1*pkg.mod:fn ") == [
        ("user", 0.7, "my-rewards.v2.py:fmt", "fmt"),
        ("user", 0.3, f"{user_dir}/sub.dir/other-file.py:score", "score"),
        ("user", 10.0, "pkg.mod:fn", "fn"),
    ]
    # two functions of one name, or one named like a builtin, are logged under their specs as written
    assert [t.name for t in parse_spec("my-rewards.v2.py:score+sub.dir/other-file.py:score")] == [
        "my-rewards.v2.py:score",
        "sub.dir/other-file.py:score",
    ]
    assert parse_spec("exact_match+x.py:exact_match")[1].name == "x.py:exact_match"
    # builtins gathered first (weights kept), judge and model as before
    assert _terms("0.5*my-rewards.v2.py:fmt+exact_match+0.2*think_format+judge:http://h:1/v1") == [
        ("functions", 1.0, "exact_match+0.2*think_format", None),
        ("user", 0.5, "my-rewards.v2.py:fmt", "fmt"),
        ("judge", 1.0, "http://h:1/v1", None),
    ]
    # a lone function (any path, + and * included, when the file exists) is one plain pool; a weighted one is a sum
    (user_dir / "a+b*c.py").write_text(USER)
    assert _terms("a+b*c.py:fmt") == [("functions", 1.0, "a+b*c.py:fmt", None)]
    assert _terms("my-rewards.v2.py:fmt") == [("functions", 1.0, "my-rewards.v2.py:fmt", None)]
    assert _terms("2*my-rewards.v2.py:fmt") == [("user", 2.0, "my-rewards.v2.py:fmt", "fmt")]
    (user_dir / "model").write_text("")  # a file named like a source does not turn model:PATH into a file reward
    assert _terms("model:rm-dir") == [("model", 1.0, "rm-dir", None)]


def test_a_function_written_first_in_a_sum_is_a_sum(user_dir):
    # "file.py:fn+exact_match" was taken as one file reward whose function is "fn+exact_match" (the file exists):
    # refused with "has no function 'fmt+exact_match'", while "exact_match+file.py:fn" was a sum
    assert _terms("my-rewards.v2.py:fmt+exact_match") == [
        ("functions", 1.0, "exact_match", None),
        ("user", 1.0, "my-rewards.v2.py:fmt", "fmt"),
    ]
    assert _terms("my-rewards.v2.py:fmt+0.5*judge:http://h:1/v1") == [
        ("user", 1.0, "my-rewards.v2.py:fmt", "fmt"),
        ("judge", 0.5, "http://h:1/v1", None),
    ]
    check_spec("my-rewards.v2.py:fmt+0.2*think_format", RewardConfig())
    with open_rewards("my-rewards.v2.py:fmt+exact_match", workers=0) as scorer:
        assert scorer.score(["4", "5"], [EX, EX]).rewards == [2.0, 0.0]
    # a pool given such a sum says where sums with functions are scored (not that the file lacks a function)
    with pytest.raises(ConfigError, match="sums a function of your own"):
        resolve("my-rewards.v2.py:fmt+exact_match")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("exact_match+0.5*nope.py:fn", "reward file 'nope.py' does not exist (looked for {cwd}/nope.py)"),
        ("exact_match+0.5*my-rewards.v2.py:fmtt", "has no function 'fmtt' (did you mean fmt?); it defines fmt, one_"),
        ("exact_match+0.5*my-rewards.v2.py:one_arg", "one_arg(completion) cannot be called as one_arg(completion, exa"),
        ("exact_match+0.5*my-rewards.v2.py", "term 'my-rewards.v2.py' of 'exact_match+0.5*my-rewards.v2.py' names"),
        ("exact_mach+0.5*my-rewards.v2.py:fmt", "unknown reward 'exact_mach' in 'exact_mach+0.5*my-rewards.v2.py:fmt'"),
        # a + inside a path splits it: the first piece is read as a builtin, and the message lists the forms
        ("exact_match+a+b.py:fmt", "unknown reward 'a' in 'exact_match+a+b.py:fmt'; a term of a sum is a builtin ("),
        ("exact_match+x*my-rewards.v2.py:fmt", "the weight 'x' is not a number; write it as 0.2*my-rewards.v2.py:fmt"),
        ("exact_match+inf*my-rewards.v2.py:fmt", "the weight must be a finite number"),
        ("exact_match+0.5*my-rewards.v2.py:fmt+", "has an empty term; write it as exact_match+0.2*think_format"),
        ("exact_match+0.5*", "has an empty term"),
        ("my-rewards.v2.py:fmt+0.5*my-rewards.v2.py:fmt", "names 'my-rewards.v2.py:fmt' twice; keep one term and we"),
    ],
)
def test_bad_sums_fail_the_config_check_naming_the_term(spec, message, user_dir):
    with pytest.raises(ConfigError) as err:
        check_spec(spec, RewardConfig())
    assert message.format(cwd=user_dir.resolve()) in str(err.value)


# ---- scoring ------------------------------------------------------------------------------------------------------
def test_builtins_and_files_summed_with_each_term_logged(user_dir):
    texts = ["4", "45 apples", "5"]
    spec = "exact_match+0.5*my-rewards.v2.py:fmt+0.25*sub.dir/other-file.py:score"
    with open_rewards(spec, workers=1, timeout=30) as scorer:
        res = scorer.score(texts, [EX] * 3)
    em, fmt, score = [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.1, 0.9, 0.1]
    assert res.num_failures == 0
    assert res.rewards == pytest.approx([e + 0.5 * f + 0.25 * s for e, f, s in zip(em, fmt, score)])
    m = res.metrics()
    assert m["reward/exact_match"] == pytest.approx(1 / 3) and m["reward/fmt"] == pytest.approx(2 / 3)
    assert m["reward/score"] == pytest.approx(1.1 / 3) and m["reward/chars"] == pytest.approx(11 / 3)  # its dict key
    # a sum of builtins alone (one plain pool) logs its terms too
    with open_rewards("exact_match+0.5*think_format", workers=0) as scorer:
        m = scorer.score(["4", "<think>a</think><answer>5</answer>"], [EX, EX]).metrics()
    assert m["reward/exact_match"] == 0.5 and m["reward/think_format"] == 0.5


def test_a_failing_term_fails_its_samples_and_is_counted_by_name(user_dir):
    spec = "exact_match+0.5*my-rewards.v2.py:picky+my-rewards.v2.py:slow"
    with open_rewards(spec, workers=1, timeout=2, failure_reward=-1.0) as scorer:
        res = scorer.score(["4", "boom", "hang"], [EX] * 3)
        totals = dict(scorer.totals)
    assert res.rewards == [1.0 + 0.5 * 0.5 + 1.0, -1.0, -1.0]  # never a partial sum
    assert res.failures == {"error": 1, "timeout": 1, "non_number": 0, "crash": 0} and totals == res.failures
    assert res.failed == {1, 2}
    assert "error: my-rewards.v2.py:picky: KeyError: 'no_such_field' (my-rewards.v2.py:12 in picky)" in res.messages
    assert "timeout: my-rewards.v2.py:slow: no answer within 2s; worker killed" in res.messages
    m = res.metrics()  # each term's mean over the completions it scored
    assert m["reward/picky"] == 0.5 and m["reward/slow"] == 1.0 and m["reward/exact_match"] == pytest.approx(1 / 3)


def test_the_sandbox_timeout_check_applies_to_the_code_exec_builtin_only(user_dir):
    """reward.code_exec.timeout (5 s) must stay a second below the reward timeout only where the builtin runs: a file
    or function whose name merely contains "code_exec" is a user's function, free to run under a 3 s timeout."""
    (user_dir / "my_code_exec.py").write_text("def code_exec_like(completion, example):\n    return 1.0\n")
    cfg = RewardConfig()
    for spec in ("my_code_exec.py:code_exec_like", "exact_match+0.5*my_code_exec.py:code_exec_like"):
        check_spec(spec, cfg, reward_timeout=3.0)
    for spec in ("code_exec", "exact_match+0.5*code_exec", "my_code_exec.py:code_exec_like+code_exec"):
        with pytest.raises(ConfigError, match="must stay below the reward timeout"):
            check_spec(spec, cfg, reward_timeout=3.0)
