"""No import circle inside ``xlog_actors/actors``, counting imports made for types only.

The one back reference allowed is type-only and joins two types that truly refer to each other:
``GpuRef`` holds the ``DeviceContext`` that made it. It must say so in a comment.
"""

from __future__ import annotations

import ast
from pathlib import Path

import xlog_actors.actors

FOLDER = Path(xlog_actors.actors.__file__).parent
PACKAGE = "xlog_actors.actors"

#: (importer, imported): type-only back references between two mutually referring types.
ALLOWED_BACK_REFERENCES = {("gpu_ref", "device_context")}


def _imports(path: Path) -> dict[str, bool]:
    """The modules of the folder that ``path`` imports -> whether only under TYPE_CHECKING."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only_nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only_nodes.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: dict[str, bool] = {}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names = [node.module] if node.module else [alias.name for alias in node.names]
            elif node.level == 0 and node.module and node.module.startswith(PACKAGE + "."):
                names = [node.module[len(PACKAGE) + 1 :]]
        elif isinstance(node, ast.Import):
            names = [a.name[len(PACKAGE) + 1 :] for a in node.names if a.name.startswith(PACKAGE + ".")]
        for name in names:
            module = name.split(".")[0]
            if (FOLDER / f"{module}.py").exists():
                type_only = id(node) in type_only_nodes
                found[module] = found.get(module, True) and type_only
    return found


def graph() -> dict[str, dict[str, bool]]:
    return {path.stem: _imports(path) for path in sorted(FOLDER.glob("*.py")) if path.stem != "__init__"}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``edges`` as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_walker_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_walker_sees_type_only_imports() -> None:
    imports = graph()["gpu_ref"]
    assert imports["device_context"] is True  # under TYPE_CHECKING
    assert imports["interop"] is False


def test_no_import_circle_in_the_actors_folder() -> None:
    edges = {
        module: {imported for imported in imports if (module, imported) not in ALLOWED_BACK_REFERENCES}
        for module, imports in graph().items()
    }
    assert find_cycle(edges) is None, f"import circle: {' -> '.join(find_cycle(edges) or [])}"


def test_each_allowed_back_reference_is_type_only_and_says_why() -> None:
    modules = graph()
    for importer, imported in ALLOWED_BACK_REFERENCES:
        assert modules[importer].get(imported) is True, f"{importer} -> {imported} must be type-only"
        source = (FOLDER / f"{importer}.py").read_text(encoding="utf-8")
        assert "truly refer to each other" in source
