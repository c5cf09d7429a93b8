"""Shared-segment names never repeat on a node, and segments whose owner died with its resource
tracker are swept away (the orphans a killed Ray worker, or a killed CI run, leaves in
``/dev/shm``). A live owner's segment is never swept, whichever process or pid namespace looks."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

import xlog_actors as xa
from xlog_actors.driver import shared_memory
from xlog_actors.driver.shared_memory import SHM_DIR, SharedSegment, segment_name, sweep_orphans
from xlog_actors.errors import InvalidRequest

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def orphan() -> Iterator[str]:
    """A segment file that no process owns: what a process killed with its tracker leaves."""
    name = f"xlog-test-{os.getpid()}-orphan"
    path = os.path.join(SHM_DIR, name)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    yield name
    if os.path.exists(path):
        os.unlink(path)


def test_a_reused_pid_never_meets_the_name_an_earlier_process_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes of the same pid (a container restarted on a shared ``/dev/shm``): the second
    one's first name differs from the first one's, so the leftover does not stop it."""
    monkeypatch.setattr(os, "getpid", lambda: 424242)
    monkeypatch.setattr(shared_memory, "_serial", itertools.count())
    monkeypatch.setattr(shared_memory, "_token", (-1, ""))
    first = segment_name("mem", 0)
    leftover = SharedSegment.create(first, 64)
    try:
        monkeypatch.setattr(shared_memory, "_serial", itertools.count())  # a new process counts anew
        monkeypatch.setattr(shared_memory, "_token", (-1, ""))
        second = segment_name("mem", 0)
        assert second != first and second.split("-")[:3] == first.split("-")[:3] == ["xlog", "mem", "424242"]
        SharedSegment.create(second, 64).close()
    finally:
        leftover.close()


def test_a_name_carries_its_role_pid_and_ordinal() -> None:
    name = segment_name("lane", 3)
    parts = name.split("-")
    assert parts[:3] == ["xlog", "lane", str(os.getpid())] and parts[4] == "3"
    assert segment_name("lane", 3) != name


def test_an_orphan_is_swept_and_a_live_owners_segment_is_kept(orphan: str) -> None:
    live = SharedSegment.create(segment_name("test", 0), 64)
    try:
        assert orphan not in sweep_orphans(min_age_s=3600.0), "a young orphan may be one being created"
        gone = sweep_orphans(min_age_s=0.0)
        assert orphan in gone and live.name not in gone
        assert not os.path.exists(os.path.join(SHM_DIR, orphan))
        assert os.path.exists(os.path.join(SHM_DIR, live.name))
    finally:
        live.close()


def test_a_negative_age_is_refused_and_sweeps_nothing(orphan: str) -> None:
    with pytest.raises(InvalidRequest, match="min_age_s"):
        sweep_orphans(min_age_s=-1.0)
    assert os.path.exists(os.path.join(SHM_DIR, orphan))


def _own_a_device(conn: Connection) -> None:
    """A process that owns a shared host device's memory and events, then waits to be killed."""
    driver = xa.HostDriver(memory_per_device=1 << 20, shared=True)
    driver.create_stream(0)
    driver.export_event(driver.create_stream(0))
    conn.send(sorted(n for n in os.listdir(SHM_DIR) if f"-{os.getpid()}-" in n))
    conn.recv()


def test_a_killed_owners_segments_are_kept_while_it_lives_and_swept_once_it_died() -> None:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_own_a_device, args=(theirs,), daemon=True)
    proc.start()
    try:
        assert ours.poll(30), "the owner did not start"
        names = ours.recv()
        assert any(n.startswith("xlog-mem-") for n in names), names
        assert not set(names) & set(sweep_orphans(min_age_s=0.0)), "a live owner's segments were swept"
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names), "nobody unlinked them yet"
        assert set(names) <= set(sweep_orphans(min_age_s=0.0))
        assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def test_the_first_segment_a_process_makes_sweeps_the_orphans(
    monkeypatch: pytest.MonkeyPatch, orphan: str
) -> None:
    monkeypatch.setattr(shared_memory, "ORPHAN_AGE_S", 0.0)
    monkeypatch.setattr(shared_memory, "_swept_in", -1)
    SharedSegment.create(segment_name("test", 0), 64).close()
    assert not os.path.exists(os.path.join(SHM_DIR, orphan))
