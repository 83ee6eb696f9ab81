"""The run viewer, end to end in a real headless browser: a tiny GRPO run (and an agentic one) saves its sampled
rollouts in ``rollouts.jsonl``, ``polyrl view`` renders the page, Debian's chromium runs its script, and the dumped
DOM shows the curves drawn and the sample or episode named in the URL hash opened. No chromium is a failure that says
how to install it, never a skip: the page is only tested where a browser runs it."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import threading
import urllib.error
import urllib.request
from html.parser import HTMLParser

import pytest

from polyrl.cli.main import main
from polyrl.run.rollout_log import RolloutLog, chosen, read_rows, spread
from polyrl.run.viewer import render, serve
from polyrl.trainer import fit

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL = (
    "the run viewer is tested in a headless chromium and none was found: install it (Debian/Ubuntu: "
    "`apt-get install -y chromium`; `make test` does this where apt-get is available) or point POLYRL_CHROMIUM at one"
)


def _chromium() -> str:
    found = os.environ.get("POLYRL_CHROMIUM") or next((p for p in map(shutil.which, BROWSERS) if p), None)
    if not found:
        pytest.fail(INSTALL, pytrace=False)
    return found


def _browse(tmp_path, page, fragment: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        _chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=2000", *extra,
        f"{page.resolve().as_uri()}#{fragment}",
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)


class DOM(HTMLParser):
    """Elements' attributes in order, and the text inside each element with an id."""

    def __init__(self, markup: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: dict[str, str] = {}
        self._open: list[tuple[str, str | None]] = []
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        self.elements.append((tag, a))
        if tag not in ("br", "meta", "line", "circle", "rect", "path", "input", "link", "img"):
            self._open.append((tag, a.get("id")))
            if a.get("id"):
                self.text.setdefault(a["id"], "")

    def handle_endtag(self, tag):
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data):
        for _, ident in self._open:
            if ident:
                self.text[ident] += data

    def find(self, tag: str, **attrs: str) -> list[dict[str, str]]:
        return [a for t, a in self.elements if t == tag and all(a.get(k) == v for k, v in attrs.items())]


def _grpo(model_dir, out, **kw):
    return fit(
        "grpo", model_dir, "builtin:arithmetic?max=9&n=16", out, seed=0,
        train={"max_steps": 2, "log_every": 100, "save_final_model": False},
        checkpoint={"every_n_steps": 1, "keep_last_k": 0, "save_final": False},
        grpo={"samples_per_prompt": 2, "prompts_per_step": 2, "max_new_tokens": 6, "reward_workers": 0,
              "old_logprobs": "recompute", "rollouts_to_save": 3},
        **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def grpo_run(tiny_model_dir, tmp_path_factory):
    _chromium()  # no browser: fail before training
    out = tmp_path_factory.mktemp("viewer") / "grpo"
    _grpo(tiny_model_dir, out)
    return out


def test_rollout_sample_is_bounded_seeded_and_resume_safe(tmp_path):
    assert chosen(0, 3, 16, 4) == chosen(0, 3, 16, 4) and len(chosen(0, 3, 16, 4)) == 4
    assert chosen(0, 3, 16, 4) != chosen(0, 4, 16, 4) or chosen(0, 3, 16, 4) != chosen(0, 5, 16, 4)
    assert chosen(0, 0, 2, 8) == [0, 1] and chosen(0, 0, 5, 0) == []
    assert spread([-1.0, -2.0], [0, 1, 0, 1], 4) == [None, -1.0, None, -2.0]
    log = RolloutLog(tmp_path)
    log.write([{"step": s, "sample": i, "completion": f"{s}.{i}"} for s in (1, 2, 3) for i in (0, 1)])
    log.close()
    with (tmp_path / "rollouts.jsonl").open("a") as fh:
        fh.write('{"step": 3, "sample": 0, "compl')  # a line torn by a crash
    RolloutLog(tmp_path, start_step=2).close()  # resuming after step 2: step 3 will be written again
    kept = [(r["step"], r["sample"]) for r in read_rows(tmp_path / "rollouts.jsonl")]
    assert kept == [(1, 0), (1, 1), (2, 0), (2, 1)]


def test_viewer_draws_curves_and_opens_a_sample_in_chromium(grpo_run, tiny_model_dir, tmp_path):
    _chromium()  # before any run: no browser fails at once
    rows = read_rows(grpo_run / "rollouts.jsonl")
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]  # 3 of the 4 samples of each step
    r = next(r for r in rows if r["step"] == 2)
    assert r["kind"] == "completion" and r["prompt"].count("What is") == 1 and r["finish_reason"] in ("stop", "length")
    assert len(r["tokens"]) == len(r["logprobs"]) == len(r["trainer_logprobs"]) > 0  # recompute: trainer measured
    assert max(abs(a - b) for a, b in zip(r["logprobs"], r["trainer_logprobs"])) < 1e-3

    # exact resume: from the step-1 checkpoint into the same directory, step 2's rows are dropped and rewritten alike
    _grpo(tiny_model_dir, grpo_run, resume=str(grpo_run / "checkpoints" / "step-00000001"))
    lines = (grpo_run / "rollouts.jsonl").read_text().splitlines()
    assert len(lines) == 6 and read_rows(grpo_run / "rollouts.jsonl") == rows

    page = tmp_path / "view.html"
    assert main(["view", str(grpo_run), "--out", str(page)]) == 0
    markup = page.read_text()
    assert "<script src" not in markup and "http://" not in markup.replace("http://www.w3.org/2000/svg", "")

    done = _browse(tmp_path, page, f"step=2&sample={r['sample']}", "--dump-dom")
    dom = DOM(done.stdout)
    assert dom.find("main", id="viewer", **{"data-ready": "1"}), "the page's script did not finish"
    drawn = {a["data-series"]: a for a in dom.find("path") if "data-series" in a}
    for key in ("loss", "reward", "mismatch_mean", "rollout_tokens_per_s", "entropy"):
        assert key in drawn and drawn[key]["data-points"] == "2" and drawn[key]["d"].startswith("M"), key
    charts = {a["data-chart"] for a in dom.find("div") if "data-chart" in a}
    assert charts >= {"loss", "reward", "throughput (tokens/s)"}
    listed = [a for a in dom.find("tr") if "data-sample" in a]
    assert len(listed) == 3 and [a["class"] for a in listed].count("row open") == 1  # step 2's samples, one open
    view = dom.find("div", id="sample-view")[0]
    assert view["data-step"] == "2" and view["data-sample"] == str(r["sample"])  # opened from the URL hash
    assert dom.text["completion"] == r["completion"] and dom.text["prompt"] == r["prompt"]
    assert dom.text["tokens"] == "".join(r["tokens"])
    assert len([a for a in dom.find("span") if "data-diff" in a]) == len(r["tokens"])  # mismatch colouring

    shot = tmp_path / "viewer.png"
    _browse(tmp_path, page, f"step=2&sample={r['sample']}", f"--screenshot={shot}", "--window-size=1200,900")
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1200, 900)
    assert len(png) > 20_000  # charts and text, not a blank page


def test_viewer_opens_an_agent_episode_in_chromium(tiny_model_dir, tmp_path):
    _chromium()
    out = tmp_path / "agent"
    fit(
        "grpo", tiny_model_dir, "builtin:arithmetic?max=9&n=16", out, seed=0,
        train={"max_steps": 1, "log_every": 100, "save_final_model": False},
        grpo={"max_new_tokens": 5, "samples_per_prompt": 2, "prompts_per_step": 2, "rollouts_to_save": 2},
        agent={"env": "guessing", "env_workers": 0, "max_turns": 2, "max_episode_tokens": 200},
    )  # fmt: skip
    rows = read_rows(out / "rollouts.jsonl")
    assert len(rows) == 2
    e = rows[0]
    assert e["kind"] == "episode" and e["status"] in ("done", "max_turns", "max_tokens")
    assert len(e["mask"]) == len(e["tokens"]) == len(e["logprobs"]) and 0 < sum(e["mask"]) < len(e["mask"])
    assert [m["role"] for m in e["messages"]].count("assistant") >= 1 and e["metrics"]["turns"] >= 1
    page = tmp_path / "agent.html"
    page.write_text(render(out))
    dom = DOM(_browse(tmp_path, page, f"step=1&sample={e['sample']}", "--dump-dom").stdout)
    assert dom.find("div", id="sample-view")[0]["data-sample"] == str(e["sample"])
    shown = dom.find("div", **{"class": "msg assistant"})
    assert len(shown) == [m["role"] for m in e["messages"]].count("assistant")
    assert dom.text["completion"] == e["completion"]
    assert len([a for a in dom.find("span") if a.get("class") == "ctx"]) == len(e["mask"]) - sum(e["mask"])


def test_serve_answers_the_page_on_localhost(grpo_run):
    started = threading.Event()
    box = {}

    def ready(server):
        box["server"] = server
        started.set()

    t = threading.Thread(target=serve, args=(grpo_run, 0), kwargs={"ready": ready}, daemon=True)
    t.start()
    assert started.wait(30)
    server = box["server"]
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        with urllib.request.urlopen(url + "/", timeout=10) as resp:
            body = resp.read().decode()
        assert resp.status == 200 and 'id="polyrl-data"' in body and json.dumps("reward") in body
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "/etc/passwd", timeout=10)
        assert err.value.code == 404
    finally:
        server.shutdown()
        t.join(10)
    assert not t.is_alive()


def test_view_of_a_directory_without_a_run_is_a_config_error(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a run")
    assert main(["view", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} is not a run directory: it has none of metrics.jsonl, rollouts.jsonl, run_config.json" in err


ROW = '{"step": 1, "sample": 0, "prompt": "p", "completion": "c", "reward": 1.0}\n'


@pytest.mark.parametrize(
    ("files", "steps", "curve", "note"),
    [
        # the run has started (its config is written) but logged no step: the page says so
        ({"run_config.json": "{}"}, 0, False, "no metrics.jsonl in this run directory yet: curves appear once"),
        ({"metrics.jsonl": ""}, 0, False, "metrics.jsonl has no step yet: curves appear once the run logs its first"),
        ({"metrics.jsonl": "\n\n", "rollouts.jsonl": ROW}, 1, False, "metrics.jsonl has no step yet"),
        # a crash mid-write: the complete steps are drawn, the cut line is counted
        ({"metrics.jsonl": '{"step": 1, "loss": 2.0}\n{"step": 2, "lo'}, 1, True, "1 line(s) could not be read"),
        ({"metrics.jsonl": '{"step": 1, "loss": 2.0}\n[1]\n{"step": "x"}\n'}, 1, True, "2 line(s) could not be"),
        # a summary.json that is not an object, a rollout row with a step that is not a number
        ({"metrics.jsonl": '{"step": 1, "loss": 2.0}\n', "summary.json": "[1, 2]"}, 1, True, "summary.json is not a"),
        ({"metrics.jsonl": '{"step": 1, "loss": 2}\n', "rollouts.jsonl": ROW + '{"step": "a"}\n'}, 1, True, None),
    ],
)
def test_a_run_missing_or_damaging_its_files_still_renders_and_says_what_is_missing(
    tmp_path, files, steps, curve, note
):
    """An empty metrics.jsonl (a run before its first step) was refused as 'neither metrics.jsonl nor rollouts.jsonl';
    a summary.json holding a list and a rollout row with a non-numeric step were tracebacks; a run folder with only
    its config was refused. Each renders now, the notes in the HTML itself (no script needed)."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    page = render(tmp_path)
    data = json.loads(page.split('id="polyrl-data">', 1)[1].split("</script>", 1)[0])
    assert data["steps"] == steps and bool(data["charts"]) == curve
    notes = page.split('<ul id="notes">', 1)[1].split("</ul>", 1)[0]
    if note is None:
        assert notes == "" and data["notes"] == [] and len(data["rollouts"]) == 1
    else:
        assert note in notes and any(note in n for n in data["notes"])


def test_view_out_that_cannot_be_written_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "a-file").write_text("x")
    assert main(["view", str(tmp_path), "--out", str(tmp_path / "a-file" / "page.html")]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the page to {tmp_path}/a-file/page.html: {tmp_path}/a-file is a file, not a folder" in err


def test_view_out_under_a_folder_that_cannot_be_entered_is_a_clear_error(tmp_path, unenterable_dir, capsys):
    """--out under a folder the user may not enter: Path.exists raises PermissionError there (as it does for a
    non-root user; these tests run as root, so it is made to), which was a traceback before the page was written."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    locked = unenterable_dir
    out = locked / "sub" / "page.html"
    assert main(["view", str(tmp_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the page to {out}: {locked} may not be entered (Permission denied); give --out" in err


def test_charts_select_eval_series(tmp_path):
    """The eval metrics land in the charts (no browser: the page's data): greedy and sampled eval reward beside the
    reward, every eval_pass@k in one chart (natural order), eval length beside the response length, DPO's held-out
    margin and accuracy beside the training ones."""
    from polyrl.run.viewer import load_run

    recs = [
        {"step": 1, "reward": 0.1, "response_length": 4.0, "rewards/margins": 0.0, "rewards/accuracies": 0.5},
        {
            "step": 2, "reward": 0.2, "eval_reward": 0.5, "eval_sampled_reward": 0.4, "eval_pass@1": 0.4,
            "eval_pass@2": 0.6, "eval_pass@16": 0.9, "eval_length": 5.5, "eval_rewards/margins": 0.3,
            "eval_rewards/accuracies": 0.75,
        },
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    charts = {c["title"]: [s["key"] for s in c["series"]] for c in load_run(tmp_path)["charts"]}
    assert charts["reward"] == ["reward", "eval_reward", "eval_sampled_reward"]
    assert charts["eval pass@k"] == ["eval_pass@1", "eval_pass@2", "eval_pass@16"]
    assert charts["response length (tokens)"] == ["response_length", "eval_length"]
    assert charts["accuracy"] == ["rewards/accuracies", "eval_rewards/accuracies"]
    assert charts["DPO reward margin"] == ["rewards/margins", "eval_rewards/margins"]
    pass_k = next(c for c in load_run(tmp_path)["charts"] if c["title"] == "eval pass@k")
    assert pass_k["series"][2]["points"] == [[2, 0.9]]
