"""Import directions of ARCHITECTURE.md, checked on the source, and a cheap `import polyrl`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "polyrl"

# Layers from the bottom; a package may import its own layer and layers below it.
LAYERS = [
    {"errors", "platform"},
    {"kernels"},
    {"models", "data"},
    {"train", "infer"},
    {"algorithms", "rewards", "agents"},
    {"trainer"},
    {"server"},
    {"validate", "bench"},
    {"cli"},
]
FREE = {"__init__", "__main__"}


def _layer(pkg: str) -> int:
    for i, layer in enumerate(LAYERS):
        if pkg in layer:
            return i
    raise AssertionError(f"polyrl.{pkg} is not placed in a layer; add it to LAYERS in {__file__}")


def _imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
    return found


def test_import_directions():
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        src_pkg = rel.parts[0].removesuffix(".py")
        if src_pkg in FREE:
            continue
        src_layer = _layer(src_pkg)
        for module, line in _imports(path):
            parts = module.split(".")
            if parts[0] != "polyrl" or len(parts) < 2 or parts[1] in FREE:
                continue
            dst_pkg = parts[1]
            if dst_pkg == "cli" and src_pkg != "cli":
                bad.append(f"{rel}:{line} imports polyrl.cli (nothing imports cli)")
            elif src_pkg in ("validate", "bench") or src_pkg == "cli":
                continue
            elif _layer(dst_pkg) > src_layer:
                bad.append(f"{rel}:{line} imports {module} (layer {dst_pkg} is above {src_pkg})")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_only_platform_touches_torch_cuda():
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "platform":
            continue
        text = path.read_text()
        if "torch.cuda." in text:
            offenders.append(str(rel))
    assert not offenders, f"call polyrl.platform.device instead of torch.cuda in: {offenders}"


def test_import_polyrl_is_cheap():
    code = (
        "import sys, polyrl, polyrl.errors, polyrl.platform;"
        "bad=[m for m in ('triton','fastapi','transformers','uvicorn','torch') if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import polyrl pulled in: {out}"


def test_import_kernels_does_not_load_triton_or_init_device():
    code = "import sys, polyrl.kernels, torch;print('triton' in sys.modules, torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False False", out
