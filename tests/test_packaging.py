"""The package as a user installs it: metadata, the typing marker, and type checkers that can see it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import xlog_actors

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
