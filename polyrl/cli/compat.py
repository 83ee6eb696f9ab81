"""``polyrl compat render [--compat-dir compat] [--out docs/compatibility.md]``: write the compatibility matrix
from the validation reports. Only parses and writes; the page is ``polyrl.validate.compat.render``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from polyrl.validate import compat


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("render",), help="render: write the matrix page")
    parser.add_argument("--compat-dir", default="compat", help="folder of report JSON files (default compat)")
    parser.add_argument("--out", default="docs/compatibility.md", help="page to write (default docs/compatibility.md)")


def run(args: argparse.Namespace) -> int:
    reports = compat.load_reports(args.compat_dir)
    out = Path(args.out)
    link = os.path.relpath(Path(args.compat_dir).resolve(), out.resolve().parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(compat.render(reports, compat_link=Path(link).as_posix()))
    print(f"wrote {out} from {len(reports)} report(s) in {args.compat_dir}")
    return 0
