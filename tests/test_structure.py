"""The shape of the package, checked: layers import one way, no import circle anywhere, every public
name documented, and a long module says why it is long.

Imports are read from the source (``ast``), counting those made under ``TYPE_CHECKING``; a
type-only back reference is allowed only where listed below, between two types that truly refer
to each other.
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

#: (importer, imported): type-only back references between two types that refer to each other.
ALLOWED_TYPE_ONLY_CYCLES = {
    ("xlog_actors.actors.gpu_ref", "xlog_actors.actors.device_context"),
    ("xlog_actors.driver.cuda.context", "xlog_actors.driver.cuda.streams"),
}

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


def _graph() -> dict[str, dict[str, bool]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


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


def test_no_import_circle_in_the_package() -> None:
    """Package ``__init__`` modules count as modules: a submodule that imports an ``__init__``
    which (perhaps through others) imports that submodule back closes a circle like any other."""
    edges: dict[str, set[str]] = {}
    for importer, imported in _graph().items():
        for target, type_only in imported.items():
            if not (type_only and (importer, target) in ALLOWED_TYPE_ONLY_CYCLES):
                edges.setdefault(importer, set()).add(target)
    assert _cycle(edges) is None, f"import circle: {' -> '.join(_cycle(edges) or [])}"


def test_each_allowed_back_reference_is_type_only_and_says_why() -> None:
    graph = _graph()
    for importer, imported in ALLOWED_TYPE_ONLY_CYCLES:
        assert graph[importer].get(imported) is True, f"{importer} -> {imported} is not type-only"
        source = _modules()[importer].read_text(encoding="utf-8")
        block = source[source.index("if TYPE_CHECKING") :][:600]
        assert "#" in block, f"{importer}: the type-only import of {imported} must say why in a comment"


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
