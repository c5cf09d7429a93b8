"""Profiler ranges: one NVTX range per message an actor serves, one per batch of allocations, and
nothing at all without the optional ``nvtx`` package."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.actors import ranges


class _Recorder:
    """Stands in for :class:`ranges.Ranges`: logs pushes and pops per thread."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.depth: dict[int, int] = {}
        self._lock = threading.Lock()

    def push(self, actor: type, message: type) -> None:
        with self._lock:
            self.log.append(("push", f"{actor.__name__}.{message.__name__}"))
            self.depth[threading.get_ident()] = self.depth.get(threading.get_ident(), 0) + 1

    def pop(self) -> None:
        with self._lock:
            self.log.append(("pop", ""))
            self.depth[threading.get_ident()] -= 1


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Recorder]:
    rec = _Recorder()
    monkeypatch.setattr(ranges, "RANGES", rec)
    yield rec
    pykka.ActorRegistry.stop_all()


def test_each_message_is_one_range_named_after_actor_and_message(recorder: _Recorder, driver: Any) -> None:
    device = xa.DeviceActor.start(0, driver)
    copy = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(4096))
    copy.ask(xa.Fill(ref, 1))
    assert copy.ask(xa.CopyToHost(ref, nbytes=2)) == b"\x01\x01"
    names = [name for what, name in recorder.log if what == "push"]
    assert "DeviceActor.Allocate" in names
    assert names[-2:] == ["CopyActor.Fill", "CopyActor.CopyToHost"]
    assert all(depth == 0 for depth in recorder.depth.values()), "every range was closed on its thread"


def serve_on_the_actors_thread(device: Any) -> None:
    """Queue every ask, as these tests need: an idle device's inbox would serve an ``Allocate``
    in the asker's thread (``CallerServedInbox``), and push its range there, under the lock the
    test holds."""
    device.actor_inbox.serve_in_caller((), None)


def test_a_batch_of_allocations_is_one_range(recorder: _Recorder, driver: Any) -> None:
    device = xa.DeviceActor.start(0, driver)
    serve_on_the_actors_thread(device)
    device.ask(xa.GetStats())
    # While the test holds the recorder's lock the device cannot open (or close) a range, so
    # all eight asks are queued before it serves the first: it then serves them in one wake-up.
    with recorder._lock:
        futures = [device.ask(xa.Allocate(256), block=False) for _ in range(8)]
    assert len([f.get(timeout=10) for f in futures]) == 8
    pushes = [name for what, name in recorder.log if what == "push" and name == "DeviceActor.Allocate"]
    assert device.ask(xa.GetStats()).largest_batch == 8
    assert pushes == ["DeviceActor.Allocate"], "one range for the whole batch"


def test_without_nvtx_nothing_is_pushed(monkeypatch: pytest.MonkeyPatch, driver: Any) -> None:
    monkeypatch.setattr(ranges, "RANGES", None)
    calls: list[str] = []
    monkeypatch.setattr(ranges.Ranges, "push", lambda *a: calls.append("push"))
    device = xa.DeviceActor.start(0, driver)
    try:
        device.ask(xa.Allocate(64))
    finally:
        device.stop()
    assert calls == []


def test_the_real_nvtx_module_takes_the_ranges(driver: Any) -> None:
    nvtx = pytest.importorskip("nvtx", reason="the optional nvtx package is not installed (pip install nvtx)")
    real = ranges.Ranges(nvtx)
    real.push(xa.CopyActor, xa.Fill)
    real.pop()
    assert ranges.RANGES is not None, "with nvtx installed the runtime's ranges are on"


@pytest.mark.parametrize("traced", [True, False], ids=["ranges on", "ranges off"])
def test_no_reply_outlives_its_asker_through_a_failure(
    recorder: _Recorder, driver: Any, traced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure's traceback keeps the serving frames; no frame of the loop may keep the batch's
    first envelope (and so its reply's handles) through it, ranges on or off."""
    import gc

    device = xa.DeviceActor.start(0, driver)
    serve_on_the_actors_thread(device)
    device.ask(xa.GetStats())
    with recorder._lock:  # the recorder's lock holds the device until both asks are queued
        good = device.ask(xa.Allocate(256), block=False)
        wrong = device.ask(xa.Allocate(-1), block=False)  # fails in the same batch
        if not traced:
            monkeypatch.setattr(ranges, "RANGES", None)  # the loop looks again at its next message
    with pytest.raises(xa.InvalidRequest):
        wrong.get(timeout=10)
    assert good.get(timeout=10).nbytes == 256
    del good
    gc.collect()
    stats = device.ask(xa.GetStats())
    assert (stats.live_blocks, stats.bytes_outstanding) == (0, 0), "the failure held the first reply"
    assert wrong is not None  # the failed future, and its traceback, are still held here
