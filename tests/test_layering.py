"""The package structure of docs/architecture.md, checked on the source (pure AST, no polyrl import).

Rules (each test below checks one; every failure names file:line and says what to do):

1. Layers. Every top-level package or module of polyrl/ sits in exactly one layer of LAYERS, and every name in
   LAYERS exists as polyrl/<name>/ or polyrl/<name>.py. A package may import its own layer and the layers below,
   never above; nothing imports `cli`; the pairs in SEPARATE share a layer but never import each other.
   `polyrl/__init__.py` and `polyrl/__main__.py` are free (they may import anything, and anything may import the
   root `polyrl` package itself).
2. Every import form counts: `import polyrl.x.y`, `import polyrl.x as z`, `from polyrl.x.y import z`,
   `from polyrl import x` (x is then the imported module), relative imports (`from . import x`, `from .x import y`,
   `from ..x import y`, resolved against the importing module's package), wherever the statement is: module level,
   inside functions, under `if TYPE_CHECKING:`, inside try/except.
3. No circles. The module-level dependency graph of polyrl (an edge per import of rule 2; `from polyrl.pkg import
   name` is an edge to the module polyrl.pkg.name when that is a module, else to polyrl.pkg) has no strongly
   connected component of more than one module.
4. A module never imports the `__init__` of a package that contains it (other than the root `polyrl`): import the
   module that defines the name instead. An `__init__` importing its own submodules is fine. With both, the
   `__init__`s re-export without making circles, and rule 3 ignores the (forbidden) submodule -> own-package edges
   so that each mistake is reported once.
5. Lazy imports are marked. An import statement inside a function body (at any depth) is deliberate: its block of
   consecutive import statements is preceded, immediately above its first statement, by a comment whose first line
   starts with `# lazy:` and says why (a cycle it breaks, a heavy or optional dependency it defers).
6. Only polyrl.platform touches `torch.cuda.`; `import polyrl` is cheap; `import polyrl.kernels` loads no Triton and
   initialises no device (these two run in a subprocess).
7. docs/architecture.md holds the layer list in a fenced ```layers block, one line per layer
   (`N. pkg, pkg — what it is`), and it equals LAYERS.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "polyrl"
DOC = REPO / "docs" / "architecture.md"

# Layers from the bottom; a package may import its own layer and the layers below it.
LAYERS = [
    {"errors", "platform"},
    {"kernels"},
    {"models", "data"},
    {"train", "infer"},
    {"algorithms"},
    {"run"},
    {"agents"},
    {"trainer"},
    {"server", "eval"},
    {"validate", "bench"},
    {"cli"},
]
FREE = {"__init__", "__main__"}
# Same layer, but neither imports the other.
SEPARATE = [{"validate", "bench"}, {"server", "eval"}]
LAZY_MARK = "# lazy:"


# --- the source, as modules -------------------------------------------------------------------------------------


@cache
def _modules() -> dict[str, Path]:
    """Every module of polyrl by dotted name (a package by its own name, e.g. polyrl.models -> its __init__.py)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_package(module: str) -> bool:
    return _modules()[module].name == "__init__.py"


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _known(module: str) -> str | None:
    """The longest prefix of a dotted name that is a polyrl module (`polyrl.x.y.Name` -> `polyrl.x.y`)."""
    parts = module.split(".")
    while parts:
        name = ".".join(parts)
        if name in _modules():
            return name
        parts.pop()
    return None


def _from_base(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom reads from, relative levels resolved against `module`'s package."""
    if node.level == 0:
        return node.module or ""
    package = module if _is_package(module) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The polyrl modules one import statement of `module` loads by name (empty for non-polyrl imports)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = _from_base(module, node)
        names = []
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            names.append(sub if alias.name != "*" and sub in _modules() else base)
    return [t for t in (_known(n) for n in names if n == "polyrl" or n.startswith("polyrl.")) if t]


@cache
def _imports(module: str) -> list[tuple[int, str]]:
    """(line, target module) for every polyrl import in `module`, wherever the statement is."""
    found = []
    for node in ast.walk(_tree(_modules()[module])):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.extend((node.lineno, target) for target in _targets(module, node))
    return sorted(found)


def _top(module: str) -> str | None:
    """The top-level package or module of polyrl a dotted name belongs to (None for the root package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _imports_own_package(src: str, dst: str) -> bool:
    """Whether `dst` is the __init__ of a package that contains `src` (the root `polyrl` excepted)."""
    return dst != "polyrl" and src != dst and src.startswith(dst + ".")


# --- layers --------------------------------------------------------------------------------------------------------


def _layer(pkg: str) -> int:
    for i, layer in enumerate(LAYERS):
        if pkg in layer:
            return i
    raise AssertionError(f"polyrl.{pkg} is not placed in a layer; add it to LAYERS in {__file__}")


def _top_level_names() -> set[str]:
    names = set()
    for entry in ROOT.iterdir():
        if entry.suffix == ".py" or (entry.is_dir() and any(entry.rglob("*.py"))):
            names.add(entry.stem)
    return names - FREE


def test_every_package_is_in_exactly_one_layer():
    placed = [name for layer in LAYERS for name in layer]
    doubled = sorted({name for name in placed if placed.count(name) > 1})
    missing = sorted(_top_level_names() - set(placed))
    stale = sorted(set(placed) - _top_level_names())
    assert not doubled, f"in more than one layer of LAYERS: {doubled}"
    assert not missing, f"polyrl/ has {missing} but LAYERS does not place them: add each to one layer"
    assert not stale, f"LAYERS names {stale}, which are neither polyrl/<name>/ nor polyrl/<name>.py: remove them"


def _direction_error(src_pkg: str, dst_pkg: str) -> str | None:
    if dst_pkg == "cli" and src_pkg != "cli":
        return "nothing imports polyrl.cli"
    if any({src_pkg, dst_pkg} == pair for pair in SEPARATE):
        return f"{src_pkg} and {dst_pkg} never import each other"
    if _layer(dst_pkg) > _layer(src_pkg):
        return f"layer of {dst_pkg} is above {src_pkg}"
    return None


def test_import_directions():
    bad = []
    for module, path in _modules().items():
        src_pkg = _top(module)
        if src_pkg is None or src_pkg in FREE:
            continue
        for line, target in _imports(module):
            dst_pkg = _top(target)
            if dst_pkg is None or dst_pkg in FREE or dst_pkg == src_pkg:
                continue
            error = _direction_error(src_pkg, dst_pkg)
            if error:
                bad.append(f"{_rel(path)}:{line} imports {target} ({error})")
    assert not bad, "layering violations:\n" + "\n".join(bad)


# --- circles ------------------------------------------------------------------------------------------------------


def test_no_submodule_imports_its_own_package():
    bad = [
        f"{_rel(path)}:{line} imports {target}, a package containing it: import the defining module instead"
        for module, path in _modules().items()
        for line, target in _imports(module)
        if _imports_own_package(module, target)
    ]
    assert not bad, "own-package imports:\n" + "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    graph = {module: set() for module in _modules()}
    for module in _modules():
        for _, target in _imports(module):
            if target != module and not _imports_own_package(module, target):
                graph[module].add(target)
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one node, each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through the component's first module, by breadth-first search inside the component."""
    start, members = component[0], set(component)
    parents = {start: None}
    queue = [start]
    for node in queue:
        for child in sorted(graph[node] & members):
            if child == start:
                path = [node]
                while parents[path[-1]] is not None:
                    path.append(parents[path[-1]])
                return [*reversed(path), start]
            if child not in parents:
                parents[child] = node
                queue.append(child)
    return component


def _edge_line(src: str, dst: str) -> int:
    return next(line for line, target in _imports(src) if target == dst)


def test_no_import_circles():
    graph = _graph()
    reports = []
    for component in _strongly_connected(graph):
        cycle = _cycle(graph, component)
        steps = [f"  {_rel(_modules()[a])}:{_edge_line(a, b)} imports {b}" for a, b in zip(cycle, cycle[1:])]
        reports.append(f"circle of {len(component)} modules ({', '.join(component)}):\n" + "\n".join(steps))
    assert not reports, "import circles (move the shared code down, or import the defining module):\n" + "\n".join(
        reports
    )


# --- lazy imports ---------------------------------------------------------------------------------------------------


def _bodies(node: ast.AST):
    """Every statement list directly under `node` (body, orelse, finalbody, handlers' and match cases' bodies)."""
    for field in ("body", "orelse", "finalbody"):
        stmts = getattr(node, field, None)
        if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
            yield stmts
    for child in getattr(node, "handlers", []) + getattr(node, "cases", []):
        yield child.body


def _function_import_blocks(tree: ast.Module):
    """The first statement of each block of consecutive import statements inside any function body."""

    def visit(node: ast.AST, in_function: bool):
        in_function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for stmts in _bodies(node):
            previous_is_import = False
            for stmt in stmts:
                is_import = isinstance(stmt, (ast.Import, ast.ImportFrom))
                if in_function and is_import and not previous_is_import:
                    yield stmt
                previous_is_import = is_import
                yield from visit(stmt, in_function)

    yield from visit(tree, False)


def _has_lazy_comment(lines: list[str], lineno: int) -> bool:
    """Whether the comment lines right above line `lineno` (1-based) begin with `# lazy:`."""
    i = lineno - 2
    first = None
    while i >= 0 and lines[i].strip().startswith("#"):
        first = lines[i].strip()
        i -= 1
    return first is not None and first.startswith(LAZY_MARK)


def test_lazy_imports_are_marked():
    bad = []
    for path in _modules().values():
        lines = path.read_text().splitlines()
        for stmt in _function_import_blocks(_tree(path)):
            if not _has_lazy_comment(lines, stmt.lineno):
                bad.append(f"{_rel(path)}:{stmt.lineno}")
    assert not bad, (
        f"imports inside functions without a '{LAZY_MARK} <why>' comment right above the import block "
        f"(or move them to the top of the module):\n" + "\n".join(bad)
    )


# --- device and import cost ---------------------------------------------------------------------------------------


def test_only_platform_touches_torch_cuda():
    offenders = [
        _rel(path)
        for module, path in _modules().items()
        if _top(module) != "platform" and "torch.cuda." in path.read_text()
    ]
    assert not offenders, f"call polyrl.platform.device instead of torch.cuda in: {offenders}"


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_import_polyrl_is_cheap():
    out = _run(
        "import sys, polyrl, polyrl.errors, polyrl.platform;"
        "bad=[m for m in ('triton','fastapi','transformers','uvicorn','torch') if m in sys.modules];"
        "print(','.join(bad))"
    )
    assert out == "", f"import polyrl pulled in: {out}"


def test_import_kernels_does_not_load_triton_or_init_device():
    out = _run("import sys, polyrl.kernels, torch;print('triton' in sys.modules, torch.cuda.is_initialized())")
    assert out == "False False", out


# --- the document ---------------------------------------------------------------------------------------------------

_DOC_LINE = re.compile(r"^(\d+)\.\s+([a-z_]+(?:\s*,\s*[a-z_]+)*)\s+—\s+\S.*$")


def _doc_layers() -> list[tuple[int, set[str]]]:
    """The numbered lines of the ```layers block in docs/architecture.md, as (number, packages)."""
    assert DOC.exists(), f"{_rel(DOC)} is missing: it holds the layer list this test checks"
    block = re.search(r"^```layers\n(.*?)^```", DOC.read_text(), re.M | re.S)
    assert block, f"{_rel(DOC)} has no ```layers fenced block"
    layers = []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        match = _DOC_LINE.match(line.strip())
        assert match, f"{_rel(DOC)}: layer line {line!r} is not 'N. pkg, pkg — one line'"
        layers.append((int(match.group(1)), {name.strip() for name in match.group(2).split(",")}))
    return layers


def test_architecture_doc_matches_layers():
    layers = _doc_layers()
    numbers = [number for number, _ in layers]
    assert numbers == list(range(1, len(layers) + 1)), f"{_rel(DOC)}: layers are not numbered 1..N: {numbers}"
    assert [names for _, names in layers] == LAYERS, (
        f"{_rel(DOC)} and LAYERS in {__file__} disagree:\n doc:    {[sorted(n) for _, n in layers]}\n"
        f" LAYERS: {[sorted(n) for n in LAYERS]}"
    )
