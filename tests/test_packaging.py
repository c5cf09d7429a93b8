"""The package as a user installs it: metadata, the typing marker, type checkers that can see it, and
the wheel: what it holds, and the release builds that make it."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import xlog_actors

try:
    import tomllib
except ImportError:  # Python 3.10: the checks that read pyproject.toml skip
    tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[1]


def _distribution() -> importlib.metadata.Distribution:
    try:
        dist = importlib.metadata.distribution("xlog-actors")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("xlog-actors is not installed in this environment (run from a source tree)")
    return dist


def test_metadata_declares_license_urls_classifiers_and_numpy() -> None:
    meta = _distribution().metadata
    assert meta["License-Expression"] == "Apache-2.0"
    assert any(url.startswith("Homepage, ") for url in meta.get_all("Project-URL") or [])
    classifiers = meta.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers
    requires = [r.split(";")[0].replace(" ", "") for r in meta.get_all("Requires-Dist") or []]
    for name in ("pykka", "cuda-python", "cuda-core", "numpy"):
        assert any(r.startswith(name) for r in requires), (name, requires)
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_version_matches_the_distribution() -> None:
    assert xlog_actors.__version__ == _distribution().version


def test_the_package_ships_its_typing_marker() -> None:
    assert (Path(xlog_actors.__file__).parent / "py.typed").is_file()


def test_a_type_checker_sees_the_installed_package(tmp_path: Path) -> None:
    """mypy, run on a user's file outside the source tree, resolves the package's real types (an
    import hook that mypy cannot follow would leave every name ``Any``)."""
    _distribution()
    user = tmp_path / "user_code.py"
    user.write_text("import xlog_actors as xa\nreveal_type(xa.AllocTag.UNTAGGED)\nx: int = xa.AllocTag('a')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--python-executable", sys.executable, str(user)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    # AllocTag is defined in the compiled core; its stub (shipped beside it) gives mypy the type.
    assert 'Revealed type is "xlog_actors._core.blocks.AllocTag"' in out, out
    # AllocTag is a str subclass: assigning it to an int must be an error the checker can see.
    assert "Incompatible types in assignment" in out, out


# -- the wheel ----------------------------------------------------------------------------------

def _core_modules() -> list[str]:
    """The compiled modules setup.py builds (its ``_MODULES``), read without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_MODULES" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no _MODULES")


def _pyproject() -> dict:
    if tomllib is None:
        pytest.skip("reading pyproject.toml needs tomllib (Python 3.11)")
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def test_every_core_source_is_built_and_ships_its_stub() -> None:
    """Each ``.pyx`` of the core is an extension of setup.py (none left out of the wheel), its stub
    and the typing marker are package data, and the sdist carries the Cython sources."""
    core = ROOT / "xlog_actors" / "_core"
    modules = _core_modules()
    assert sorted(modules) == sorted(p.stem for p in core.glob("*.pyx"))
    for name in modules:
        assert (core / f"{name}.pyi").is_file(), name
    assert (ROOT / "xlog_actors" / "py.typed").is_file()
    data = _pyproject()["tool"]["setuptools"]["package-data"]["xlog_actors"]
    assert {"py.typed", "_core/*.pyi", "_core/*.pxd"} <= set(data)
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "recursive-include xlog_actors/_core *.pyx *.pxd *.pyi" in manifest


def test_release_wheels_are_cpython_310_to_313_manylinux_and_run_the_demo() -> None:
    project = _pyproject()
    cibw = project["tool"]["cibuildwheel"]
    assert cibw["build"].split() == ["cp310-*", "cp311-*", "cp312-*", "cp313-*"]
    assert project["project"]["requires-python"] == ">=3.10"
    versions = [c.rsplit(" :: ", 1)[1] for c in project["project"]["classifiers"]
                if c.startswith("Programming Language :: Python :: 3.")]
    assert [f"cp{v.replace('.', '')}-*" for v in versions] == cibw["build"].split()
    assert set(cibw["skip"]) == {"*-musllinux_*", "*_i686"}
    assert cibw["manylinux-x86_64-image"].startswith("manylinux")
    assert cibw["test-command"] == "xlog-actors demo --driver host --batches 4"


def test_the_built_wheel_holds_the_compiled_core_and_the_typing_marker() -> None:
    """The wheel CI builds (``$XLOG_ACTORS_WHEEL``, set by .ci/run): every compiled module, its
    stub, the typing marker, and none of the build's intermediate sources."""
    wheel = os.environ.get("XLOG_ACTORS_WHEEL")
    if not wheel:
        pytest.skip("no built wheel named (.ci/run sets XLOG_ACTORS_WHEEL to the one it builds)")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in _core_modules():
        built = [n for n in names if n.startswith(f"xlog_actors/_core/{name}.") and n.endswith(".so")]
        assert len(built) == 1, (name, built)
        assert f"xlog_actors/_core/{name}.pyi" in names, name
    assert "xlog_actors/py.typed" in names
    assert not [n for n in names if n.endswith((".pyx", ".c", ".cpp"))]
