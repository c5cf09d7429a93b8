"""The shape of the package, checked: layers import one way, no import circle anywhere (none inside
a folder, none across folders), every public name documented, and a long module says why it is
long.

Imports are read from the source (``ast``), counting those made under ``TYPE_CHECKING`` and
those made inside functions: a type-only import closes a circle like any other. Two types that
truly refer to each other live in one module, or one names a protocol of the other that a lower
module defines.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import xlog_actors

PACKAGE_DIR = Path(xlog_actors.__file__).parent

#: Bottom up: a module may import modules of its own layer or of a lower one, never a higher one.
#: ``_core`` is the compiled core: it calls the driver, and ``memory`` is its Python face.
LAYERS = ["errors", "driver", "kernels", "_core", "memory", "runtime", "actors", "interop", "ray", "cli"]

LONG_MODULE_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    paths = sorted(PACKAGE_DIR.rglob("*.py")) + sorted(PACKAGE_DIR.rglob("*.pyx"))
    return {_module_name(p): p for p in paths}


def _python_imports(path: Path) -> str:
    """The source to parse for ``path``'s imports: the file itself, or for a Cython module its
    top-level import statements (``cimport`` read as ``import``), since the rest is not Python."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".pyx":
        return text
    statements = re.findall(r"^(?:from\s+\S+\s+c?import\s+(?:\([^)]*\)|[^\n]*)|c?import\s+[^\n]*)", text, re.M)
    return "\n".join(re.sub(r"\bcimport\b", "import", st) for st in statements)


def _module_docstring(path: Path) -> str:
    """The module docstring of a Python or Cython module (a Cython one's leading string literal,
    after its comment lines)."""
    source = path.read_text(encoding="utf-8")
    if path.suffix == ".pyx":
        match = re.match(r'(?:\s*#[^\n]*\n)*\s*"""(.*?)"""', source, re.S)
        return match.group(1) if match else ""
    return ast.get_docstring(ast.parse(source)) or ""


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(name: str, path: Path, known: dict[str, Path]) -> dict[str, bool]:
    """Modules of the package that ``name`` imports -> whether only under ``TYPE_CHECKING``."""
    tree = ast.parse(_python_imports(path))
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: dict[str, bool] = {}

    def add(target: str, node: ast.AST) -> None:
        if target == name or target not in known:
            return
        found[target] = found.get(target, True) and id(node) in type_only

    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(name, is_package, node.level, node.module)
            for alias in node.names:  # `from . import module` names a module, not a symbol
                if f"{target}.{alias.name}" in known:
                    add(f"{target}.{alias.name}", node)
                else:
                    add(target, node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
    return found


def _graph_of(known: dict[str, Path]) -> dict[str, dict[str, bool]]:
    """Module -> the modules of ``known`` it imports -> whether only under ``TYPE_CHECKING``."""
    return {name: _imports(name, path, known) for name, path in known.items()}


def _graph() -> dict[str, dict[str, bool]]:
    return _graph_of(_modules())


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the top-level package re-exports every layer
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def test_layers_import_one_way() -> None:
    wrong = []
    for importer, imported in _graph().items():
        low = _layer(importer)
        for target in imported:
            high = _layer(target)
            if low is not None and high is not None and high > low:
                wrong.append(f"{importer} -> {target}")
    assert not wrong, "imports that run back up the layers: " + ", ".join(wrong)


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _circles_inside_folders(graph: dict[str, dict[str, bool]], known: dict[str, Path]) -> list[list[str]]:
    """A circle of each folder that has one: imports between modules of one folder (a package's
    ``__init__`` belongs to its own folder), those made only under ``TYPE_CHECKING`` included."""
    by_folder: dict[Path, dict[str, set[str]]] = {}
    for importer, imported in graph.items():
        folder = known[importer].parent
        for target in imported:  # type-only or not: both close a circle
            if known[target].parent == folder:
                by_folder.setdefault(folder, {}).setdefault(importer, set()).add(target)
    return [circle for _, edges in sorted(by_folder.items()) if (circle := _cycle(edges)) is not None]


def test_no_import_circle_inside_a_folder() -> None:
    circles = _circles_inside_folders(_graph(), _modules())
    assert not circles, "import circles inside a folder: " + "; ".join(" -> ".join(c) for c in circles)


def test_no_import_circle_in_the_package() -> None:
    """Across folders too. Package ``__init__`` modules count as modules: a submodule that imports
    an ``__init__`` which (perhaps through others) imports that submodule back closes a circle like
    any other."""
    edges = {importer: set(imported) for importer, imported in _graph().items()}
    assert _cycle(edges) is None, f"import circle: {' -> '.join(_cycle(edges) or [])}"


def test_the_folder_check_finds_a_type_only_circle(tmp_path: Path) -> None:
    """The checker on a synthetic package read from files: ``a`` imports ``b``, and ``b`` imports
    ``a`` only under ``TYPE_CHECKING``; that is a circle. ``c``, in another folder, imports ``a``
    and ``a`` imports ``c`` back: not inside a folder (the package-wide test catches it)."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    files = {
        "pkg": "",
        "pkg.a": "from . import b\nfrom .sub import c\n",
        "pkg.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
        "pkg.sub": "",
        "pkg.sub.c": "def f():\n    from ..a import A\n",
    }
    known: dict[str, Path] = {}
    for name, text in files.items():
        is_package = name in ("pkg", "pkg.sub")
        path = tmp_path.joinpath(*name.split("."), "__init__.py") if is_package else (
            tmp_path.joinpath(*name.split(".")).with_suffix(".py")
        )
        path.write_text(text, encoding="utf-8")
        known[name] = path
    graph = _graph_of(known)
    assert graph["pkg.b"] == {"pkg.a": True} and graph["pkg.a"] == {"pkg.b": False, "pkg.sub.c": False}
    assert _circles_inside_folders(graph, known) == [["pkg.a", "pkg.b", "pkg.a"]]
    known["pkg.b"].write_text("", encoding="utf-8")  # the back reference gone: no circle in the folder
    assert _circles_inside_folders(_graph_of(known), known) == []
    assert _cycle({k: set(v) for k, v in _graph_of(known).items()}) == ["pkg.a", "pkg.sub.c", "pkg.a"]


def _public_objects() -> list[tuple[str, object]]:
    found = []
    for info in pkgutil.walk_packages(xlog_actors.__path__, "xlog_actors."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name, None)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == info.name:
                found.append((f"{info.name}.{name}", obj))
    return found


def test_every_public_name_has_a_docstring_with_its_thread_rule() -> None:
    undocumented, no_thread_rule = [], []
    for qualname, obj in _public_objects():
        doc = inspect.getdoc(obj) or ""
        if not doc:
            undocumented.append(qualname)
            continue
        if inspect.isfunction(obj):
            if "thread" not in doc.lower():
                no_thread_rule.append(qualname)
            continue
        class_says_threads = "thread" in doc.lower()
        for attr, value in vars(obj).items():
            if attr.startswith("_"):
                continue
            func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if not inspect.isfunction(func):
                continue
            method_doc = inspect.getdoc(func) or ""
            if not method_doc:
                undocumented.append(f"{qualname}.{attr}")
            elif not isinstance(value, property) and not class_says_threads and "thread" not in method_doc.lower():
                no_thread_rule.append(f"{qualname}.{attr}")
    assert not undocumented, "public names without a docstring: " + ", ".join(undocumented)
    assert not no_thread_rule, "public callables whose docstring gives no thread rule: " + ", ".join(no_thread_rule)


def test_a_module_past_400_lines_says_why_in_its_docstring() -> None:
    silent = []
    for name, path in _modules().items():
        source = path.read_text(encoding="utf-8")
        if source.count("\n") <= LONG_MODULE_LINES:
            continue
        doc = _module_docstring(path)
        if not re.search(r"\b(400 lines|long|longer)\b", doc):
            silent.append(f"{name} ({source.count(chr(10))} lines)")
    assert not silent, "long modules that do not say why: " + ", ".join(silent)
