"""A copy from another process's handle split between its asker and the copy actor
(``shared_copy.EnqueueShared``): enqueued in the asking thread while the actor is idle, landed and
answered by the actor; refused to the caller (``NOT_SERVED``) while the actor is busy; a bad
copy raised to the caller with nothing queued.

The source is a device of a ``shared=True`` host driver in this process, pickled (what an isolated
device's frame reader gets), and the copy actor of a second device pulls it.
"""

from __future__ import annotations

import pickle
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors import import_cache
from xlog_actors.actors.copy_actor import CopyActor
from xlog_actors.actors.served_ref import NOT_SERVED
from xlog_actors.actors.shared_copy import EnqueueShared

NBYTES = 4096


class _Answer:
    """A reply slot (``pykka_internals.Reply``) that records what it was given and where."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def set(self, value: Any = None) -> None:
        self.value, self.thread = value, threading.current_thread()
        self.done.set()

    def set_exception(self, exc_info: Any = None) -> None:
        self.error = (exc_info if exc_info is not None else sys.exc_info())[1]
        self.thread = threading.current_thread()
        self.done.set()


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any, Any, Any]]:
    drv = xa.HostDriver(device_count=2, memory_per_device=16 << 20, shared=True)
    import_cache.clear()
    dev0, dev1 = xa.DeviceActor.start(0, drv), xa.DeviceActor.start(1, drv)
    copy0, copy1 = xa.CopyActor.start(dev0), xa.CopyActor.start(dev1)
    yield dev0, dev1, copy0, copy1
    import_cache.clear()
    pykka.ActorRegistry.stop_all()
    drv.close()


def _source(dev0: Any, copy0: Any, value: int) -> Any:
    src = dev0.ask(xa.Allocate(NBYTES))
    copy0.ask(xa.Fill(src, value))
    return src, pickle.loads(pickle.dumps(src))


def test_an_idle_copy_actor_lets_the_asker_enqueue_and_lands_the_copy_itself(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev0, dev1, copy0, copy1 = pair
    src, shared = _source(dev0, copy0, 7)
    dst = dev1.ask(xa.Allocate(NBYTES))
    copy1.ask(xa.Fill(dst, 0))  # attached, idle
    threads: dict[str, threading.Thread] = {}
    real_enqueue, real_land = CopyActor._enqueue_shared, CopyActor._land_shared

    def enqueue(self: CopyActor, msg: EnqueueShared) -> Any:
        threads["enqueue"] = threading.current_thread()
        return real_enqueue(self, msg)

    def land(self: CopyActor, msg: Any) -> None:
        threads["land"] = threading.current_thread()
        real_land(self, msg)

    monkeypatch.setattr(CopyActor, "_enqueue_shared", enqueue)
    monkeypatch.setattr(CopyActor, "_land_shared", land)
    answer = _Answer()
    bell = copy1.serve_here(EnqueueShared(xa.CopyDeviceToDevice(shared, dst), answer))
    assert bell is not NOT_SERVED, "an idle actor lets the asker serve"
    if bell is not None:
        bell.ring()
    assert answer.done.wait(10) and answer.error is None and answer.value is None
    assert threads["enqueue"] is threading.current_thread(), "enqueued in the asking thread"
    assert threads["land"] is not threading.current_thread(), "landed and answered by the actor"
    assert answer.thread is threads["land"]
    assert copy1.ask(xa.CopyToHost(dst)) == bytes([7]) * NBYTES
    del src


def test_a_busy_copy_actor_leaves_the_copy_to_its_inbox(pair: Any) -> None:
    dev0, dev1, copy0, copy1 = pair
    src, shared = _source(dev0, copy0, 9)
    dst = dev1.ask(xa.Allocate(NBYTES))
    copy1.ask(xa.Fill(dst, 1))
    actor = copy1._actor_weakref()
    answer = _Answer()
    assert actor._exclusive.acquire(timeout=5)  # the actor (or another asker) is serving
    try:
        served = copy1.serve_here(EnqueueShared(xa.CopyDeviceToDevice(shared, dst), answer))
    finally:
        actor._exclusive.release()
    assert served is NOT_SERVED and not answer.done.is_set()
    assert copy1.ask(xa.CopyToHost(dst)) == bytes([1]) * NBYTES, "nothing was enqueued"
    del src


def test_a_bad_shared_copy_is_raised_to_the_asker_with_nothing_queued(pair: Any) -> None:
    dev0, dev1, copy0, copy1 = pair
    src, shared = _source(dev0, copy0, 3)
    small = dev1.ask(xa.Allocate(NBYTES // 2))
    copy1.ask(xa.Fill(small, 2))
    answer = _Answer()
    with pytest.raises(xa.InvalidRequest, match="does not fit"):
        copy1.serve_here(EnqueueShared(xa.CopyDeviceToDevice(shared, small), answer))
    assert not answer.done.is_set(), "no landing was queued"
    assert copy1._actor_weakref().actor_inbox.unserved() == 0
    assert copy1.ask(xa.CopyToHost(small)) == bytes([2]) * (NBYTES // 2)
    del src
