"""The host driver's pinned table under its one hazard: a free that a finalizer makes on the very
thread that is inside the table (the garbage collector runs finalizers on whatever thread
allocates). Each test hangs (a pytest-timeout failure) on a table that allocates under its lock."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from xlog_actors.driver.host.pinned import HostPinnedTable


@pytest.fixture
def collect_every_allocation() -> Iterator[Callable[[HostPinnedTable, Callable[[], None]], None]]:
    """Run a callback once, from the first collection that starts while the table's lock is held
    (in this thread: the tests run one thread), with collections as frequent as they get."""
    pending: list[tuple[HostPinnedTable, Callable[[], None]]] = []

    def on_gc(phase: str, _info: dict[str, Any]) -> None:
        if phase == "start" and pending and pending[0][0]._lock.locked():
            pending.pop()[1]()

    threshold = gc.get_threshold()
    gc.callbacks.append(on_gc)
    gc.set_threshold(1)  # a collection at nearly every container allocation
    try:
        yield lambda table, callback: pending.append((table, callback))
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(on_gc)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("inside", ["holds", "register", "alloc", "free"])
def test_a_free_from_a_collection_inside_the_table_does_not_hang(
    inside: str, collect_every_allocation: Callable[[HostPinnedTable, Callable[[], None]], None]
) -> None:
    table = HostPinnedTable()
    victim = table.alloc(0, 4096)
    other = table.alloc(0, 4096)
    own = np.zeros(64, np.uint8)
    freed: list[int] = []
    raised: list[BaseException] = []

    def finalizer_free() -> None:
        # What the collector does with an exception here is print it: keep it for the assert.
        try:
            table.free(0, victim)
            freed.append(victim)
        except BaseException as exc:  # noqa: BLE001 - the timeout's, on a table that hangs here
            raised.append(exc)

    collect_every_allocation(table, finalizer_free)
    if inside == "holds":
        assert not table.holds(memoryview(own))
    elif inside == "register":
        table.unregister(0, table.register(0, own))
    elif inside == "alloc":
        table.free(0, table.alloc(0, 4096))
    else:
        table.free(0, other)
        other = 0
    assert raised == [], f"the free from a collection inside the table failed: {raised}"
    if not freed:  # no collection started under the lock (none can, now): free it as a finalizer would
        table.free(0, victim)
    assert victim not in table._live
    with pytest.raises(Exception, match="not a live pinned allocation"):
        table.free(0, victim)  # exactly once
    if other:
        assert other in table._live
        table.free(0, other)
    assert table._live == {} and table._registered == {}
