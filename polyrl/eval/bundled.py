"""polyrl's own lm-eval tasks (``polyrl/eval/tasks/``: YAML + jsonl, nothing from the hub), made loadable.

The YAML files name their jsonl as ``{TASK_DIR}/...``; ``bundled_task_dir()`` renders them with the absolute folder
into a cache directory that lm-eval's ``--include_path`` (or ``TaskManager(include_path=...)``) reads. Tasks:

- ``polyrl_arith_mc``: 40 four-way multiple-choice one-digit sums (log-likelihood; ``acc``, ``acc_norm``);
- ``polyrl_arith_gen``: the same sums, greedy generation until a newline (``exact_match``);
- ``polyrl_text_ppl``: 8 short sentences (rolling log-likelihood; word/byte perplexity, bits per byte).

Not here: running them (``harness.py``, ``cli/eval.py``).
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

TASK_DIR = Path(__file__).resolve().parent / "tasks"
BUNDLED_TASKS = ("polyrl_arith_mc", "polyrl_arith_gen", "polyrl_text_ppl")


def bundled_task_dir(cache: str | Path | None = None) -> Path:
    """A folder of the bundled task YAMLs with their data paths made absolute (written once per content)."""
    files = sorted(TASK_DIR.glob("*.yaml"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in files) + str(TASK_DIR).encode()).hexdigest()[:12]
    root = Path(cache) if cache is not None else Path(tempfile.gettempdir()) / f"polyrl-eval-tasks-{digest}"
    root.mkdir(parents=True, exist_ok=True)
    for p in files:
        text = p.read_text().replace("{TASK_DIR}", str(TASK_DIR))
        out = root / p.name
        if not out.exists() or out.read_text() != text:
            out.write_text(text)
    return root
