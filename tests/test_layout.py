"""The code's shape: layers import downwards only, the ``workers`` subpackages too (in their
declared order, function-level imports included), no import circle, small files, and a
``workers`` package grouped into subpackages (docs/architecture.md)."""

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
# workers' parts, lowest first: a module may import its own level and the levels below it, at
# the top or in a function (docs/architecture.md "Layers of workers")
WORKERS_ORDER = (
    ("checked", "settings"),  # the knobs, declared once, and their checks
    ("runtime",),  # what a worker process runs on: leases, events, trace, metrics, devices
    ("config", "schema"),  # the typed worker records; the sample table
    ("rl", "weights"),  # the RL math; weight sync
    ("engines",),  # rollout and training engines, the simulated ones
    ("models", "tasks", "agent"),  # models on disk, tasks and verifiers, trajectories and tools
    ("gateway",),  # the OpenAI-compatible gateway
    ("roles",),  # the stages and their loop
    ("main",),  # a worker process
)


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


def _imports(path: Path, module: str, *, top_level_only: bool,
             type_only: bool = True) -> set[str]:
    """The product modules ``module`` imports (``from a import b`` counts ``a.b`` when that is a
    module). ``top_level_only``: only statements run at import time (not inside a function,
    nor under ``if TYPE_CHECKING``); ``type_only`` False: all but those under ``if
    TYPE_CHECKING`` (what runs, at import or in a function)."""
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
    elif type_only:
        nodes = list(ast.walk(tree))
    else:
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        nodes = [n for n in ast.walk(tree) if id(n) not in skipped]
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


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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
    return cycles


def _graph(**kw: bool) -> dict[str, set[str]]:
    graph = {m: _imports(p, m, **kw) for m, p in MODULES.items()}
    # a package's __init__ importing its own submodules is not a circle of concepts
    return {m: {t for t in targets if not t.startswith(m + ".")} for m, targets in graph.items()}


def test_no_module_level_import_circle():
    assert _cycles(_graph(top_level_only=True)) == []


def test_no_workers_import_circle_even_in_a_function():
    # (type-only imports under TYPE_CHECKING run nowhere: a mixin may name its owner's types)
    graph = _graph(top_level_only=False, type_only=False)
    assert [c for c in _cycles(graph) if c[0].startswith("workers")] == []


def _level(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "workers" or len(parts) < 2:
        return None
    return next(i for i, names in enumerate(WORKERS_ORDER) if parts[1] in names)


def test_every_workers_part_has_a_level():
    parts = {m.split(".")[1] for m in MODULES if m.startswith("workers.")}
    assert parts == {name for names in WORKERS_ORDER for name in names}


def test_workers_parts_import_their_level_and_below_only():
    """Function-level and type-only imports count too: an import in a function is a dependency
    all the same, only a later one."""
    upward = []
    for module, path in MODULES.items():
        level = _level(module)
        if level is None:
            continue
        for target in _imports(path, module, top_level_only=False):
            to = _level(target)
            if to is not None and to > level:
                upward.append(f"{module} imports {target}")
    assert upward == []


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
