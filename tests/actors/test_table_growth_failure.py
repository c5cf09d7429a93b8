"""A device context whose tables cannot grow (``MemoryError``, injected where ``calloc`` would
fail: the resource's live map or the context's block table, whichever grows first or second)
refuses that allocation and leaks nothing: the handles handed out before are the only live
blocks, every block comes back once they are dropped, the driver holds no allocation more, and
the device goes on in the same generation."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors._core.ptr_table import fail_a_grow

pytestmark = [pytest.mark.usefixtures("stop_actors"), pytest.mark.timeout(60)]

RunThreads = Callable[[Callable[[], object], int, float], list[BaseException]]


def _until_refused(allocate: Callable[[], list[Any]], after: int) -> list[Any]:
    held: list[Any] = []
    fail_a_grow(after)
    try:
        with pytest.raises(MemoryError, match="cannot grow"):
            for _ in range(1000):
                held.extend(allocate())
    finally:
        fail_a_grow(-1)
    return held


def _all_back(host_driver: xa.HostDriver, device: pykka.ActorRef[Any], held: list[Any], generation: int) -> None:
    stats = device.ask(xa.GetStats())
    assert stats.live_blocks == len(held) and stats.generation == generation and stats.restarts == 0
    assert host_driver.live_allocations(0) == len(held)
    held.clear()
    gc.collect()
    stats = device.ask(xa.GetStats())
    assert stats.bytes_outstanding == 0 and stats.live_blocks == 0
    assert host_driver.live_allocations(0) == 0


@pytest.mark.parametrize("after", [0, 1], ids=["first-grow", "second-grow"])
def test_a_client_allocation_whose_tables_cannot_grow_leaks_nothing(
    host_driver: xa.HostDriver, host_device: pykka.ActorRef[Any], after: int, run_threads: RunThreads
) -> None:
    client = host_device.ask(xa.GetClient())
    generation = host_device.ask(xa.GetStats()).generation
    held = _until_refused(lambda: [client.allocate(64)], after)
    assert 0 < len(held) < 1000
    # the locks are free: another allocation goes through, in a thread with a deadline
    assert run_threads(lambda: held.append(client.allocate(64)), 1, 10.0) == []
    _all_back(host_driver, host_device, held, generation)


@pytest.mark.parametrize("after", [0, 1], ids=["first-grow", "second-grow"])
def test_an_allocate_many_whose_tables_cannot_grow_is_all_or_none(
    host_driver: xa.HostDriver, host_device: pykka.ActorRef[Any], after: int, run_threads: RunThreads
) -> None:
    client = host_device.ask(xa.GetClient())
    generation = host_device.ask(xa.GetStats()).generation
    held = _until_refused(lambda: client.allocate_many([64] * 10), after)
    assert len(held) % 10 == 0 and 0 < len(held) < 1000, "each call gave all its handles or none"
    assert run_threads(lambda: held.extend(client.allocate_many([64] * 10)), 1, 10.0) == []
    _all_back(host_driver, host_device, held, generation)
