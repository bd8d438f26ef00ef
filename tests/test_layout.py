"""The code's shape: layers import downwards only, no module-level import circle, small files,
and a ``workers`` package grouped into subpackages (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("streamflow", "workers", "storage")
# streamflow -> workers -> storage: a layer may import itself and the layers below it
LAYER = {"storage": 0, "workers": 1, "streamflow": 2}
MAX_LINES = 500
MAX_FLAT_WORKERS_MODULES = 12


def _modules() -> dict[str, Path]:
    out = {}
    for top in PRODUCT:
        for path in (REPO / top).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path, module: str, *, top_level_only: bool) -> set[str]:
    """The product modules ``module`` imports (``from a import b`` counts ``a.b`` when that is a
    module). ``top_level_only``: only statements run at import time (not inside a function,
    nor under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes: list[ast.AST] = []
    if top_level_only:
        todo: list[ast.AST] = list(tree.body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.If | ast.Try | ast.With):
                todo.extend(ast.iter_child_nodes(node))
            nodes.append(node)
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name in MODULES:
                found.add(name)
    found.discard(module)
    return found


def test_imports_point_down_only():
    upward = []
    for module, path in MODULES.items():
        layer = LAYER[module.split(".")[0]]
        for target in _imports(path, module, top_level_only=False):
            if LAYER[target.split(".")[0]] > layer:
                upward.append(f"{module} imports {target}")
    assert upward == []


def test_no_module_level_import_circle():
    graph = {m: _imports(p, m, top_level_only=True) for m, p in MODULES.items()}
    # a package's __init__ importing its own submodules is not a circle of concepts
    for m in graph:
        graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


@pytest.mark.parametrize("top", PRODUCT)
def test_no_product_file_over_500_lines(top):
    long = {str(p.relative_to(REPO)): n for p in (REPO / top).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_workers_keeps_few_modules_flat():
    flat = sorted(p.name for p in (REPO / "workers").glob("*.py") if p.name != "__init__.py")
    assert len(flat) <= MAX_FLAT_WORKERS_MODULES, flat
    # every subpackage says what it holds
    for pkg in (REPO / "workers").iterdir():
        if pkg.is_dir() and not pkg.name.startswith(("_", ".")):
            init = pkg / "__init__.py"
            assert init.is_file(), pkg
            assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"
