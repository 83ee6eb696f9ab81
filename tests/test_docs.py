"""The install instructions are true: polyrl is installed from a clone (it is not on PyPI), and every extra the
README or docs/install.md names (``.[serve]``, ``polyrl[data]``, the README's table of extras) exists in
pyproject.toml, and the table lists each of them."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "install.md"]
# `.[serve,data]`, `polyrl[serve]`, `-e ".[dev]"`: the brackets after a path or the package name
EXTRAS = re.compile(r"(?:\.|polyrl)\[([A-Za-z0-9_,\- ]+)\]")


def _extras() -> set[str]:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return set(tomllib.load(fh)["project"]["optional-dependencies"])


def _install_section(text: str) -> str:
    start = text.index("## Install\n")
    return text[start : text.index("\n## ", start + 1)]


def test_the_docs_name_only_extras_that_exist():
    known = _extras()
    for doc in DOCS:
        named = {e.strip() for m in EXTRAS.finditer(doc.read_text()) for e in m.group(1).split(",")}
        assert named, f"{doc.name} names no extras; the pattern no longer matches the install commands"
        assert named <= known, f"{doc.name} names extras {sorted(named - known)}, not in pyproject.toml {sorted(known)}"


def test_the_readme_table_lists_every_extra():
    section = _install_section((ROOT / "README.md").read_text())
    rows = set(re.findall(r"^\| `([A-Za-z0-9_\-]+)` \|", section, flags=re.MULTILINE))
    assert rows == _extras()


def test_install_starts_from_a_clone():
    for doc in DOCS:
        text = doc.read_text()
        assert "git clone" in text, doc.name
        commands = [line for line in text.splitlines() if re.match(r"\s*pip install\b", line)]
        for line in commands:  # `pip install polyrl` fetches from PyPI, where polyrl is not published
            assert not re.search(r"pip install\b.*(?<![\w.-])polyrl(?![\w.-])", line.split("#")[0]), (doc.name, line)
