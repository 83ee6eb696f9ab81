"""polyrl.validate: the validation harness behind ``polyrl validate`` and ``polyrl compat render``.

Validation is organised in levels, registered in ``LEVELS`` (name -> (module, one-line help)), run in this
order. A level module provides ``add_arguments(parser)`` (options that do not clash with other levels') and
``run_level(args) -> dict`` (see ``result.py``: ``level``, ``status`` passed/failed/skipped, ``reason``,
``metrics``, ``checks``; the ops level adds ``rows``); it may provide ``render_text(result, show)`` and
``render_markdown(result, show)``, else the generic ones in ``result.py`` are used. A level that cannot run on
this machine raises ``result.LevelSkipped(reason)``. The report file is ``report.py`` (schema
``polyrl.validate/1``), its Markdown ``markdown.py``, the compatibility matrix ``compat.py``.

Importing this package is cheap: levels are imported only when run.
"""

from __future__ import annotations

LEVELS: dict[str, tuple[str, str]] = {
    "platform": ("polyrl.validate.platform_level", "resolved platform, versions, devices, `polyrl check` rows"),
    "ops": ("polyrl.validate.ops_level", "every kernel implementation vs its reference, forward and gradients"),
    "collectives": ("polyrl.validate.collectives", "all_reduce/all_gather/broadcast/reduce_scatter across devices"),
    "sft": ("polyrl.validate.sft_level", "SFT steps: finite falling loss, throughput, memory, save/reload logits"),
    "rl": ("polyrl.validate.rl_level", "rollout + GRPO step: rollout/trainer log-prob agreement, finite loss"),
    "serve": ("polyrl.validate.serve_level", "OpenAI server: chat and streaming through the openai client"),
    "eval": ("polyrl.validate.eval_level", "model-level gate: a bundled log-likelihood task, fast path vs reference"),
}
