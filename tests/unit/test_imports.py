"""No import cycles among anytrain's modules (module-level imports, as Python runs them at import time)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(tree: ast.Module):
    """Import statements run when the module is imported: the body, and inside module-level if/try/with blocks
    (not function bodies, not ``if TYPE_CHECKING:``)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                stack.extend(node.body)
            stack.extend(node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend([*node.body, *node.orelse, *node.finalbody, *(s for h in node.handlers for s in h.body)])
        elif isinstance(node, ast.With):
            stack.extend(node.body)


def import_graph() -> dict[str, set[str]]:
    """anytrain module -> the anytrain modules its module-level imports name (``from pkg import sub`` counts
    ``pkg.sub`` when that is a module, else ``pkg``)."""
    files = {_module_name(p): p for p in (SRC / "anytrain").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_walk_sees_the_package():
    graph = import_graph()
    assert "anytrain.models" in graph and "anytrain.cost.planner" in graph
    assert "anytrain.cost.model" in graph["anytrain.cost.planner"]


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_library_module_imports_the_cli():
    """``anytrain.cli`` is the top of the package graph: nothing but itself and ``python -m anytrain`` imports it, at
    any level (function bodies and ``TYPE_CHECKING`` blocks included)."""
    offenders = []
    for path in (SRC / "anytrain").rglob("*.py"):
        name = _module_name(path)
        if name == "anytrain.__main__" or name == "anytrain.cli" or name.startswith("anytrain.cli."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                base = node.module or ""
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            if any(t == "anytrain.cli" or t.startswith("anytrain.cli.") for t in targets):
                offenders.append(f"{name}:{node.lineno}")
    assert not offenders, "library modules importing anytrain.cli: " + ", ".join(offenders)


def test_every_verb_group_registers_the_same_way():
    """One registration mechanism: each module of ``anytrain.cli`` (but the package itself) is a verb group listed in
    ``VERB_GROUPS``, with a ``register(app)``."""
    import anytrain.cli as cli

    modules = {p.stem for p in (SRC / "anytrain" / "cli").glob("*.py") if p.stem != "__init__"}
    assert {group.__name__.rpartition(".")[2] for group in cli.VERB_GROUPS} == modules
    assert all(callable(getattr(group, "register", None)) for group in cli.VERB_GROUPS)
