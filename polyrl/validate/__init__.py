"""polyrl.validate: the validation harness behind ``polyrl validate``.

Validation is organised in levels, registered in ``LEVELS`` (name -> (module, one-line help)). A level
module provides ``add_arguments(parser)``, ``run_level(args) -> dict`` (JSON-able, with at least
``level``, ``passed``, ``summary``, ``rows``), ``render_text(result, show)`` and
``render_markdown(result, show)``. The CLI runs the chosen levels in registry order and writes one report.
Add a level (platform, collectives, sft, rl, serve) by adding a row and a module.

Importing this package is cheap: levels are imported only when run.
"""

from __future__ import annotations

LEVELS: dict[str, tuple[str, str]] = {
    "ops": ("polyrl.validate.ops_level", "every kernel implementation vs its reference, forward and gradients"),
}
