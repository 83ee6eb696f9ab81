"""``polyrl`` entry point: a registry of subcommands, each a module with ``add_arguments`` and ``run``.

Subcommand modules are imported only when chosen, so ``polyrl env`` never pays for transformers.
Errors a user can fix are raised as ``polyrl.errors.UserError`` and printed as one sentence plus what to do, exit
code 2, no traceback (``--debug`` or ``POLYRL_DEBUG=1`` shows it).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from polyrl import __version__
from polyrl.errors import RunStopped, UserError, did_you_mean

# name -> (module, one-line help). Add a command by adding a row and a module.
COMMANDS: dict[str, tuple[str, str]] = {
    "env": ("polyrl.cli.env", "describe this machine: platform, torch build, devices, vendor packages"),
    "check": ("polyrl.cli.check", "check the installation for known pitfalls (exit 0 when ready)"),
    "init-model": ("polyrl.cli.init_model", "create a random-initialised HF checkpoint from a preset"),
    "train": ("polyrl.cli.train", "post-train a model: --algo sft|dpo|rm|grpo|gspo|ppo|distill"),
    "export": ("polyrl.cli.export", "merge a LoRA adapter into its base: --adapter DIR --merge --out DIR"),
    "serve": ("polyrl.cli.serve", "serve a model over an OpenAI-compatible HTTP API"),
    "generate": ("polyrl.cli.generate", "generate completions for prompts with the rollout engine"),
    "eval": ("polyrl.cli.eval", "evaluate a model: lm-eval tasks (--tasks) or rewards and pass@k (--data --reward)"),
    "validate": ("polyrl.cli.validate", "run the validation levels and write a compatibility report"),
    "bench": ("polyrl.cli.bench", "benchmark polyrl against baselines in one run"),
    "compat": ("polyrl.cli.compat", "render the compatibility matrix from compat/*.json"),
    "view": ("polyrl.cli.view", "the run viewer: curves and sampled rollouts of a run as one HTML page"),
    "demo": ("polyrl.cli.demo", "the embedded demo: tiny model, bundled data, CPU is fine"),
}


class Parser(argparse.ArgumentParser):
    """argparse, with a one-line error instead of the full usage (``polyrl train``'s is 50 lines, which buried the
    message), naming the flag or choice meant: a typo (``--max-stalness``), ``_`` for ``-`` (``--max_steps``), another
    trainer's name (``--num-generations``, ``--learning-rate``: ``polyrl.errors.FOREIGN_NAMES``), a verl-style
    ``a.b=v`` (``--set``)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}{self._hint(message)}; see `{self.prog} --help`\n")

    def _hint(self, message: str) -> str:
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            return did_you_mean(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if not unknown:
            return ""
        flags = [o[2:] for o in self._option_string_actions if o.startswith("--")]
        hints: list[str] = []
        sets: list[str] = []
        for token in unknown.group(1).split():
            if token.startswith("-"):
                hints.append(did_you_mean(token.lstrip("-").split("=")[0], flags, "--{}"))
            elif "=" in token and "." in token.split("=")[0] and "--set" in self._option_string_actions:
                key = token.split("=")[0]
                sets.append(f"--set {token}" if key.count(".") == 1 else "--set section.key=value")
        if sets:
            hints.append(f" (settings go through {', '.join(dict.fromkeys(sets))})")
        return "".join(h for h in hints if h)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="polyrl", description="LLM post-training on any accelerator.")
    parser.add_argument("--version", action="version", version=f"polyrl {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("POLYRL_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    top = build_parser()
    if not argv or argv[0] not in COMMANDS:
        top.parse_args(argv)  # prints help / version / "invalid choice" and exits
        top.print_help()
        return 2
    name, rest = argv[0], argv[1:]
    module_name, help_text = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            print(f"polyrl {name}: not available in this build.", file=sys.stderr)
            return 2
        raise
    parser = Parser(prog=f"polyrl {name}", description=help_text)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    except UserError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunStopped as exc:  # a SIGTERM: the run saved a checkpoint of its last step first
        print(str(exc), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
