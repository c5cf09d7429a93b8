"""Fixtures of the actor tests that spawn device processes (isolated devices): the check that
none outlives its test, the slow kernels those processes import, the operands of another
process's driver they must refuse, and the answers of asks in flight from several threads."""

from __future__ import annotations

import multiprocessing
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pykka
import pytest

import xlog_actors as xa

IPC_DIR = Path(__file__).resolve().parent / "ipc"


def _device_children() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("xlog-device-")]


@pytest.fixture
def device_children() -> Callable[[], list[multiprocessing.Process]]:
    """The device processes this process has alive now, as a function to call."""
    return _device_children


@pytest.fixture
def no_leaked_process() -> Iterator[None]:
    """After the test: every actor stopped, and no device process left (a module that spawns
    them uses it for all its tests: ``pytestmark``)."""
    yield
    pykka.ActorRegistry.stop_all()
    assert _device_children() == [], "a device process outlived its actor"


@pytest.fixture
def slow_kernels() -> Iterator[Any]:
    """``ipc/slow_kernels.py``, importable in the device processes spawned meanwhile."""
    sys.path.insert(0, str(IPC_DIR))
    try:
        import slow_kernels  # only importable with the path above

        yield slow_kernels
    finally:
        pykka.ActorRegistry.stop_all()  # before the path goes: a restart would spawn without it
        sys.path.remove(str(IPC_DIR))


@pytest.fixture
def foreign() -> Iterator[tuple[xa.GpuRef, xa.PinnedBuffer]]:
    """A handle and a pinned buffer of 64 bytes of device 0 of a host driver of this process's
    own (what an isolated device's actors must refuse: neither can cross to its process); the
    device stopped and the driver closed after the test."""
    driver = xa.HostDriver()
    device = xa.DeviceActor.start(0, driver)
    try:
        yield device.ask(xa.Allocate(64)), device.ask(xa.AllocatePinned(64))
    finally:
        device.stop()
        driver.close()


@pytest.fixture
def answers_from_threads(
    run_threads: Callable[[Callable[[], object], int, float], list[BaseException]],
) -> Callable[[Callable[[], list[Any]], int, float], list[object]]:
    """``answers(ask, count, timeout)``: ``ask()`` (a list of futures of asks sent) run in
    ``count`` threads at once, each future's value or the error it raised (waited for 30 s
    each), every thread's; a thread still running after ``timeout`` seconds, or one that
    raised, fails the test (``run_threads``)."""

    def answers(ask: Callable[[], list[Any]], count: int, timeout: float) -> list[object]:
        outcomes: list[object] = []
        lock = threading.Lock()

        def collect() -> None:
            for future in ask():
                try:
                    value: object = future.get(timeout=30)
                except BaseException as exc:  # noqa: BLE001 - the test checks it
                    value = exc
                with lock:
                    outcomes.append(value)

        assert run_threads(collect, count, timeout) == []
        return outcomes

    return answers
