"""Fixtures of the actor tests that spawn device processes (isolated devices): the check that
none outlives its test, and the slow kernels those processes import."""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pykka
import pytest

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
