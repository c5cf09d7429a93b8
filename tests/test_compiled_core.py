"""The compiled core as a build product: a build without a compiler stops with a message that
names what is missing, a package whose core was not built refuses to import with the command
that builds it, and the modules that run are the compiled ones (no silent pure-Python copy)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import xlog_actors
from xlog_actors import _core
from xlog_actors._core import (
    alloc_bridge,
    async_core,
    blocks,
    client_core,
    context_core,
    direct_core,
    handles,
    ops,
    resource_core,
)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(xlog_actors.__file__).resolve().parent


def _copy_sources(dest: Path, with_built: bool) -> None:
    """The checkout's package and build files under ``dest``; the compiled modules only when
    ``with_built``. Generated C files keep their times, so Cython need not translate again."""
    ignore = shutil.ignore_patterns("__pycache__", *(() if with_built else ("*.so", "*.pyd")))
    shutil.copytree(PACKAGE, dest / "xlog_actors", ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, dest / name)


def test_the_core_modules_are_compiled_extensions() -> None:
    core = (alloc_bridge, async_core, blocks, client_core, context_core, direct_core, handles, ops, resource_core)
    for module in core:
        assert Path(module.__file__ or "").suffix in (".so", ".pyd"), module.__file__
    assert not list(Path(_core.__file__).parent.glob("*_fallback*.py")), "no pure-Python copy of the core"


def test_a_build_without_a_compiler_fails_with_a_clear_message(tmp_path: Path) -> None:
    _copy_sources(tmp_path, with_built=False)
    # No C compiler and no C++ one (alloc_bridge's): with the C++ compiler left in place it compiled
    # that module (some 5 s) before the build failed on the others.
    env = dict(os.environ, CC="/nonexistent/cc", LDSHARED="/nonexistent/cc -shared",
               CXX="/nonexistent/c++", LDCXXSHARED="/nonexistent/c++ -shared")
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "the compiled core (xlog_actors._core) could not be built" in out, out
    assert "C compiler" in out and "Python.h" in out, out
    assert not list((tmp_path / "xlog_actors" / "_core").glob("*.so")), "nothing half-built is left to import"


def test_an_unbuilt_core_refuses_to_import_and_names_the_build_command(tmp_path: Path) -> None:
    _copy_sources(tmp_path, with_built=False)
    proc = subprocess.run(
        [sys.executable, "-c", "import xlog_actors"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(tmp_path)), capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert proc.returncode != 0
    assert "compiled core is not built" in proc.stderr, proc.stderr
    assert "pip install -e ." in proc.stderr and "build_ext --inplace" in proc.stderr, proc.stderr
