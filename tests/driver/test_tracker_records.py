"""A segment unlinked by a process that does not own it (a dead child's, by its parent; an
orphan, by a sweep) leaves ``multiprocessing``'s resource tracker silent: no ``KeyError``
traceback for a name it never held, no "leaked shared_memory objects" warning for a name nobody
took out of it. Each scenario runs in a fresh process tree (``tracker_scenarios.py`` says why)
whose stderr, the tracker's included, is read to its end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import xlog_actors

pytestmark = pytest.mark.timeout(90)

SCRIPT = Path(__file__).resolve().parent / "tracker_scenarios.py"
#: Where the package this test imported lives: the scenario imports the same one.
PACKAGE_ROOT = Path(xlog_actors.__file__).resolve().parent.parent
#: The scenarios of ``tracker_scenarios.py`` (its docstring says what each does).
SCENARIOS = ("orphan", "killed-before-register", "killed-before-unlink", "killed-after-unlink")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_tracker_says_nothing_when_another_process_unlinks_a_segment(scenario: str) -> None:
    # The tracker holds the stderr pipe until the tree ends, so the run returns only after its
    # last words (the leak warnings are written then).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(SCRIPT), scenario], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    for noise in ("resource_tracker", "Traceback", "leaked"):
        assert noise not in done.stderr, done.stderr
