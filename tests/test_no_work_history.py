"""The code, tests, scripts and documents say what a thing does and why, not when it was done.

A number of an issue, of a working session or of a stop in a plan means nothing to a reader who
does not have that tracker or that plan (and the repository does not), and goes stale as soon as
the work moves on. This test reads every text file that git tracks, or would track (untracked and
not ignored), under ``xlog_actors/``, ``tests/``, ``scripts/``, ``docs/``, ``examples/`` and
``.ci/``, and ``README.md``, and fails listing each line that names one. Build products are
ignored by git, so never read.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("xlog_actors", "tests", "scripts", "docs", "examples", ".ci", "README.md")

#: What a reference to the work's own history looks like (case-insensitive): the word session,
#: stop or issue followed by a number (after a space, a hash, an underscore as in a test name, or
#: a dash), and a bare issue number in parentheses. A Markdown link to a numbered heading,
#: ``(#8-actors)``, is not one.
PATTERNS = tuple(
    re.compile(p, re.IGNORECASE)
    for p in (
        r"(?<![a-z])sessions?[ _-]?#?\d",
        r"(?<![a-z])stops?[ _-]?#?\d",
        r"(?<![a-z])issues?[ _-]?#?\d",
        r"\(#\d+(?=[)\s,;:])",
    )
)


def _listed(*args: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", *args, "--", *SCANNED], cwd=ROOT, capture_output=True,
                         check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def project_files() -> list[Path]:
    """Tracked files and untracked, not ignored ones, under the scanned paths (read-only git)."""
    names = set(_listed()) | set(_listed("--others", "--exclude-standard"))
    return [ROOT / name for name in sorted(names) if (ROOT / name).is_file()]


def offending_lines(paths: Iterable[Path], root: Path = ROOT) -> list[str]:
    """``path:line: text`` for each line of a text file in ``paths`` that matches a pattern."""
    found = []
    for path in paths:
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if any(p.search(line) for p in PATTERNS):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()[:160]}")
    return found


@pytest.fixture(scope="module")
def files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a checkout (it lists the files git tracks)")
    return project_files()


def test_the_scan_covers_the_package_tests_scripts_docs_and_readme(files: list[Path]) -> None:
    tops = {path.relative_to(ROOT).parts[0] for path in files}
    assert {"xlog_actors", "tests", "scripts", "README.md"} <= tops
    assert Path(__file__).resolve() in files


def test_no_line_names_a_session_stop_or_issue_number(files: list[Path]) -> None:
    found = offending_lines(files)
    assert not found, (
        f"{len(found)} line(s) name a session, a stop or an issue by number; say what the thing does "
        "and why instead:\n" + "\n".join(found)
    )


#: The examples' numbers are put in at run time, so that this file's own text passes its scan.
N = 18


@pytest.mark.parametrize("line", [
    f"Handles across processes (issue #{N} step 2).",
    f"def test_targets_are_issue_{N}s_table():",
    f"the row's figure until Session {N}",
    f"as planned at stop {N}",
    f"the isolated fast path (#{N}): frees ride along",
    f"Issues {N} and {N + 1}",
])
def test_the_scan_reports_each_kind_of_reference(tmp_path: Path, line: str) -> None:
    path = tmp_path / "module.py"
    path.write_text(f'"""A module."""\n\n# {line}\n')
    assert offending_lines([path], tmp_path) == [f"module.py:3: # {line}"]


@pytest.mark.parametrize("line", [
    "stop the actor, then issue the next launch",
    'colors = ("#4e79a7", "#f28e2b")',
    "a session-scoped fixture; the stop message",
    "see [Actors](#8-actors) and [Surviving](#12-surviving-a-sticky-error)",
    "tissue 5, nonstop 3",
    "Issues = \"https://github.com/xlog-actors/xlog-actors/issues\"",
])
def test_the_scan_leaves_ordinary_words_alone(tmp_path: Path, line: str) -> None:
    path = tmp_path / "module.py"
    path.write_text(line + "\n")
    assert offending_lines([path], tmp_path) == []
