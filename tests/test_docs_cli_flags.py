"""The commands the docs show are commands polyrl takes: every ``--flag`` written after ``polyrl CMD`` (or ``polyrl
bench NAME``) in README.md and the user guides in docs/ is an option of that command's parser, and every ``--set
section.key=value`` names a key the run config knows. A renamed or removed flag fails here, naming the doc and the
command, instead of failing for the first user who copies the line.

docs/performance.md is left out: it is a dated log of what was measured with the commands of each session's code."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

import polyrl.agents  # noqa: F401 - registers the [agent] table into run, as the CLI does
from polyrl.cli import main as cli
from polyrl.errors import ConfigError
from polyrl.run import config as rc

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "performance.md")]
COMMAND = re.compile(r"\bpolyrl (" + "|".join(sorted(map(re.escape, cli.COMMANDS), key=len, reverse=True)) + r")\b")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SET = re.compile(r"--set\s+([a-z_]+\.[a-z_0-9.]+)=([^\s`'\"]+)")
FIT = re.compile(r"\bfit\(\"([a-z]+)\"")
FIT_TABLE = re.compile(r"\b([a-z_]+)=(\{[^{}]*\})")
ALGOS = ("sft", "dpo", "rm", "grpo", "gspo", "ppo", "distill")
# what build() says of a key it does not take (a placeholder value it refuses is fine: X, schema.json)
NOT_A_SETTING = re.compile(r"unknown .*setting|there is no \[| is now ")


def _parser(name: str) -> argparse.ArgumentParser:
    parser = cli.Parser(prog=f"polyrl {name}")
    importlib.import_module(cli.COMMANDS[name][0]).add_arguments(parser)
    return parser


def _options(parser: argparse.ArgumentParser, sub: str | None) -> set[str]:
    """The command's options, plus those of its subcommand (``polyrl bench sft``) when it has subcommands."""
    opts = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and sub in action.choices:
            opts |= set(action.choices[sub]._option_string_actions)
    return opts


def _commands(text: str) -> list[tuple[int, str, str]]:
    """(line number, command name, the rest of the command) for each ``polyrl CMD ...`` in a doc: in code blocks to
    the end of the line (``\\`` continuations joined, a ``# comment`` cut), in prose to the end of its code span."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        number, line = i + 1, lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        for match in COMMAND.finditer(line):
            rest = line[match.end() :]
            inline = line[: match.start()].count("`") % 2 == 1
            rest = rest.split("`")[0] if inline else rest
            rest = COMMAND.split(rest)[0].split(" #")[0]  # the next command on the line is read on its own
            out.append((number, match.group(1), rest))
    return out


def test_the_scanner_reads_code_blocks_inline_spans_and_continuations():
    text = (
        "Run `polyrl train --algo sft --lr 1e-3` then --not-a-flag.\n"
        "polyrl train --model M \\\n    --max-steps 3   # --ignored\n"
        "polyrl bench sft --shape x\n"
    )
    assert _commands(text) == [
        (1, "train", " --algo sft --lr 1e-3"),
        (2, "train", " --model M  --max-steps 3  "),
        (4, "bench", " sft --shape x"),
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_flag_in_the_docs_is_an_option_of_its_command(doc):
    parsers = {name: _parser(name) for name in cli.COMMANDS}
    wrong = []
    found = 0
    for number, name, rest in _commands(doc.read_text()):
        sub = re.match(r"\s+([a-z][a-z0-9-]*)", rest)
        known = _options(parsers[name], sub.group(1) if sub else None)
        for flag in FLAG.findall(rest):
            found += 1
            if flag not in known:
                wrong.append(f"{doc.name}:{number}: `polyrl {name}` has no {flag}")
    assert not wrong, "\n".join(wrong)
    if doc.name == "README.md":
        assert found > 100, "the scanner no longer finds the README's commands"


@pytest.fixture(scope="module")
def stub_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stub")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def _not_a_setting(stub: Path, algo: str, tables: dict) -> str | None:
    """The build error when ``tables`` (merged over a minimal run of ``algo``) hold a key the config does not take."""
    raw = {"algo": algo, "model": str(stub), "out": str(stub / "out"), "data": {"path": "builtin:arithmetic"}}
    if algo == "distill":
        raw["distill"] = {"teacher": str(stub)}
    for name, value in tables.items():
        raw[name] = {**raw.get(name, {}), **value} if isinstance(value, dict) else value
    try:
        rc.build(raw)
    except ConfigError as exc:
        return str(exc) if NOT_A_SETTING.search(str(exc)) else None
    return None


def test_every_set_key_in_the_docs_is_a_setting(stub_model):
    wrong = []
    checked = 0
    for doc in DOCS:
        for key, value in {m.groups() for m in SET.finditer(doc.read_text())} - {("section.key", "value")}:
            section = key.split(".")[0]
            try:
                parsed = rc.parse_value(value)
            except ConfigError:
                parsed = value
            raw = rc.apply_overrides({}, [(key, parsed)])
            error = _not_a_setting(stub_model, section if section in ALGOS else "grpo", raw)
            if error:
                wrong.append(f"{doc.name}: --set {key}: {error}")
            checked += 1
    assert checked > 10
    assert not wrong, "\n".join(wrong)


def _call_args(text: str, start: int) -> str:
    """The text of a call's arguments, from ``start`` (inside its parentheses) to the parenthesis that closes it."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]


def test_every_fit_call_in_the_docs_passes_tables_the_config_has(stub_model):
    """``fit("grpo", ..., agent={"env": ...})``: each keyword table and its keys exist for that algorithm."""
    wrong = []
    checked = 0
    for doc in DOCS:
        text = doc.read_text()
        for call in FIT.finditer(text):
            for name, literal in FIT_TABLE.findall(_call_args(text, call.end())):
                if name in ("model_args",):
                    continue
                error = _not_a_setting(stub_model, call.group(1), {name: ast.literal_eval(literal)})
                if error:
                    wrong.append(f"{doc.name}: fit({call.group(1)!r}, {name}={literal}): {error}")
                checked += 1
    assert checked >= 5
    assert not wrong, "\n".join(wrong)


def test_every_toml_block_in_the_docs_builds_into_a_run_config(stub_model):
    """A ``toml`` block copied into a run file runs: its tables and keys exist and fit together (README's reward
    block once set a reward model that its own ``reward = "judge"`` refuses)."""
    blocks = [(doc, b) for doc in DOCS for b in re.findall(r"```toml\n(.*?)```", doc.read_text(), flags=re.DOTALL)]
    assert len(blocks) >= 2
    for doc, block in blocks:
        tables = tomllib.loads(block)
        algo = next((name for name in tables if name in ALGOS), "sft")
        raw = {"algo": algo, "model": str(stub_model), "out": str(stub_model / "out")}
        raw = {**raw, "data": {"path": "builtin:arithmetic"}, **tables}
        try:
            rc.build(raw)
        except ConfigError as exc:
            pytest.fail(f"{doc.name}: a toml block does not build: {exc}\n{block}")
