"""Issue 29: every reward source trains from the CLI on the tiny model (a few GRPO / PPO steps): ``--reward-model``
(a sequence-classification folder), ``--reward judge:URL`` and a ``[reward.judge]`` table against a real HTTP judge,
``--reward code_exec`` on rows with tests (sandboxed, in reward workers), and the config errors before any load."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from polyrl.algorithms.reward_sources.model import load_reward_model, save_reward_model
from polyrl.cli.main import main
from polyrl.models.checkpoint import load_tokenizer

DATA = "builtin:arithmetic?max=9&n=16"
SMALL = ["--prompts-per-step", "2", "--n", "4", "--max-new-tokens", "6", "--micro-batch-tokens", "256"]
SMALL += ["--report-to", "none", "--log-every", "100", "--lr", "1e-3"]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _summary(out):
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir, tmp_path_factory):
    """A sequence-classification folder: the tiny decoder with a seeded score head."""
    folder = tmp_path_factory.mktemp("rm") / "rm"
    save_reward_model(load_reward_model(tiny_model_dir, seed=3), folder, load_tokenizer(tiny_model_dir))
    return folder


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_reward_model_trains_grpo_and_ppo(algo, tiny_model_dir, reward_model_dir, tmp_path):
    out = tmp_path / algo
    argv = ["train", "--algo", algo, "--model", str(tiny_model_dir), "--data", DATA, "--out", str(out)]
    argv += ["--max-steps", "2", "--reward-model", str(reward_model_dir), "--reward-workers", "0", *SMALL]
    assert main(argv) == 0
    recs = _metrics(out)
    assert len(recs) == 2 and all("reward/model" in r for r in recs)
    assert all(r["reward"] == pytest.approx(r["reward/model"]) and r["reward_std"] > 0 for r in recs)
    assert _summary(out)["reward_failures"] == {"error": 0, "timeout": 0, "non_number": 0, "crash": 0}
    saved = json.loads((out / "run_config.json").read_text())
    assert saved["reward"]["model"] == str(reward_model_dir) and saved[algo]["reward"] == "model"


class LengthJudge:
    """A real OpenAI-compatible judge: the score is the completion's length in characters, capped at 10."""

    def __init__(self) -> None:
        self.calls = 0
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge.calls += 1
                completion = body["messages"][-1]["content"].split("<<", 1)[1].rsplit(">>", 1)[0]
                reply = f"Score: {min(10, len(completion))}"
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def length_judge():
    j = LengthJudge()
    yield j
    j.close()


def test_judge_from_a_toml_table_and_from_the_flag(tiny_model_dir, tmp_path, length_judge):
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'algo = "grpo"\n[grpo]\nreward = "judge"\n[reward.judge]\nurl = "{length_judge.url}"\nmodel = "j"\n'
        'template = "Rate <<{completion}>>"\nconcurrency = 4\n'
    )
    base = ["train", "--model", str(tiny_model_dir), "--data", DATA, "--max-steps", "1", *SMALL]
    assert main([*base, "--config", str(toml), "--out", str(tmp_path / "a")]) == 0
    rec = _metrics(tmp_path / "a")[0]
    assert rec["reward_failures"] == 0 and 0 < rec["reward"] <= 1 and rec["reward"] == rec["reward/judge"]
    assert length_judge.calls == 8
    # the same run from flags: --reward judge:URL with the template through --set (an inline TOML table)
    judge_table = '{model = "j", template = "Rate <<{completion}>>"}'
    argv = [
        *base,
        "--algo",
        "grpo",
        "--reward",
        f"0.5*judge:{length_judge.url}",
        "--set",
        f"reward.judge={judge_table}",
    ]
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert _metrics(tmp_path / "b")[0]["reward"] == pytest.approx(0.5 * rec["reward"])  # same seed, same samples


def test_judge_down_counts_failures_and_the_run_finishes(tiny_model_dir, tmp_path):
    argv = ["train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(tmp_path / "o")]
    argv += ["--max-steps", "1", "--reward", "judge:http://127.0.0.1:9", *SMALL]
    argv += ["--set", 'reward.judge={model = "j", retries = 0, timeout = 2.0}']
    assert main(argv) == 0
    rec = _metrics(tmp_path / "o")[0]
    assert rec["reward_failures_error"] == 8 and rec["reward"] == 0.0


def test_code_exec_trains_on_rows_with_tests(tiny_model_dir, tmp_path):
    data = tmp_path / "code.jsonl"
    rows = [
        {"prompt": f"Write add{k}(a, b) returning a + b + {k}.", "tests": [f"assert add{k}(1, 2) == {3 + k}"]}
        for k in range(4)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o"
    argv = ["train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out)]
    argv += ["--max-steps", "1", "--reward", "code_exec", "--reward-workers", "2", *SMALL]
    argv += ["--set", "grpo.samples_per_prompt=2", "--set", "reward.code_exec={timeout = 3.0}"]
    assert main(argv) == 0
    rec = _metrics(out)[0]
    # the tiny random model writes no working code: every sample fails its test, and none of that is a failure
    assert rec["reward"] == 0.0 and rec["reward_failures"] == 0 and "reward/code_error" in rec


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--reward", "judge"], "the reward 'judge' needs a URL"),
        (["--set", "reward.model='x'"], "reward.model is set but the reward spec 'exact_match' does not use it"),
        (["--reward", "code_exec", "--reward-timeout", "3"], "must stay below the reward timeout"),
        (["--set", "reward.judge={temperature = 0.0, colour = 1}"], "unknown reward.judge setting(s) ['colour']"),
    ],
)
def test_reward_config_errors_exit_2(extra, message, tiny_model_dir, tmp_path, capsys):
    argv = ["train", "--algo", "grpo", "--model", str(tiny_model_dir), "--data", DATA, "--out", str(tmp_path / "o")]
    assert main([*argv, *extra]) == 2
    assert message in capsys.readouterr().err
