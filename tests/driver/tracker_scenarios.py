"""Segments unlinked by a process that does not own them, each scenario run in a fresh process
tree by ``test_tracker_records.py`` (``python tracker_scenarios.py NAME``; exit code 0 means the
segments went as they should).

Why a process tree each: ``multiprocessing``'s resource tracker is one process per tree, and what
it gets wrong it prints on its own stderr, an ``unregister`` of a name it does not hold as a
``KeyError`` traceback, and the names still held when the tree ends as a "leaked
shared_memory objects" warning (both after the scenario's own code has returned). A fresh tree
whose stderr the test reads sees all of it, whatever the test process's own tracker holds.

Scenarios:

* ``orphan``: a segment left by a process killed with its tracker (another tree) is swept.
* ``killed-before-register``: a spawned child is killed after it made a segment's file and
  before it registered the name; its parent unlinks the child's segments.
* ``killed-before-unlink``: the child is killed inside ``close()``, before it unlinks the name.
* ``killed-after-unlink``: the child is killed inside ``close()``, right after it unlinked the
  name.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection

from xlog_actors.driver import shared_memory
from xlog_actors.driver.shared_memory import SHM_DIR, SharedSegment, segment_name, sweep_orphans, unlink_segments_of


def _die(*_args: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _unlink_then_die(path: str) -> None:
    _real_unlink(path)
    _die()


_real_unlink = os.unlink


def _child(conn: Connection, where: str) -> None:
    """Make a segment and die at ``where``; the segment's name goes to the parent first."""
    shared_memory._swept_in = os.getpid()  # no sweep: it would meet the patched steps below
    name = segment_name("test", 0)
    conn.send(name)
    if where == "before-register":
        resource_tracker.register = _die  # type: ignore[assignment]
    segment = SharedSegment.create(name, 4096)
    os.unlink = _die if where == "before-unlink" else _unlink_then_die  # type: ignore[assignment]
    segment.close()
    raise AssertionError("the child outlived its death")


def _killed(where: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(theirs, where), daemon=True)
    proc.start()
    assert ours.poll(60), "the child did not start"
    name = ours.recv()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL, proc.exitcode
    assert proc.pid is not None
    unlink_segments_of(proc.pid)  # as the parent of an isolated device does when its child dies
    assert not os.path.exists(os.path.join(SHM_DIR, name)), f"{name} is left"


def _orphan() -> None:
    name = segment_name("test", 0)
    path = os.path.join(SHM_DIR, name)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))  # unowned: its owner was killed
    assert name in sweep_orphans(min_age_s=0.0)
    assert not os.path.exists(path)


SCENARIOS: dict[str, Callable[[], None]] = {
    "orphan": _orphan,
    "killed-before-register": lambda: _killed("before-register"),
    "killed-before-unlink": lambda: _killed("before-unlink"),
    "killed-after-unlink": lambda: _killed("after-unlink"),
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
