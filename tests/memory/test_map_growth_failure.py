"""A resource whose live map cannot grow (``MemoryError``, injected where ``calloc`` would fail)
refuses that one allocation and changes nothing: the pointer the driver handed out is given back,
the figures are as they were, and the resource's lock is free: the next allocation goes through,
in a thread joined within a deadline (a lock left held makes it wait forever with the GIL
released, where no test timeout can interrupt it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import xlog_actors as xa
from xlog_actors._core.ptr_table import fail_a_grow
from xlog_actors.memory import AsyncCudaResource, DirectCudaResource, StreamPool

pytestmark = pytest.mark.timeout(60)

_MAX = 1000  # far more allocations than the map's first growth needs

RunThreads = Callable[[Callable[[], object], int, float], list[BaseException]]


class _CountingDriver:
    """Forwards to a real driver, recording every pointer allocated and freed."""

    def __init__(self, real: xa.Driver) -> None:
        self._real = real
        self.allocated: list[int] = []
        self.freed: list[int] = []

    def alloc_async(self, nbytes: int, stream: Any) -> int:
        ptr = self._real.alloc_async(nbytes, stream)
        self.allocated.append(ptr)
        return ptr

    def free_async(self, ptr: int, stream: Any) -> None:
        self._real.free_async(ptr, stream)
        self.freed.append(ptr)

    def alloc(self, ordinal: int, nbytes: int) -> int:
        ptr = self._real.alloc(ordinal, nbytes)
        self.allocated.append(ptr)
        return ptr

    def free(self, ordinal: int, ptr: int) -> None:
        self._real.free(ordinal, ptr)
        self.freed.append(ptr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.fixture
def pool(driver: xa.Driver) -> Iterator[StreamPool]:
    p = StreamPool(driver, 0)
    yield p
    p.close()


def _allocate_until_refused(resource: Any) -> list[Any]:
    """Allocate 64 bytes until the armed grow fails; the blocks allocated before it."""
    held: list[Any] = []
    fail_a_grow(0)
    try:
        with pytest.raises(MemoryError, match="cannot grow"):
            for _ in range(_MAX):
                held.append(resource.allocate(64))
    finally:
        fail_a_grow(-1)
    assert 0 < len(held) < _MAX
    return held


def _allocates_again(resource: Any, held: list[Any], run_threads: RunThreads) -> None:
    """One more allocation, in a thread that must finish within 10 s (the lock is free)."""
    assert run_threads(lambda: held.append(resource.allocate(64)), 1, 10.0) == []


def test_a_stream_ordered_allocation_whose_map_cannot_grow_changes_nothing(
    driver: xa.Driver, pool: StreamPool, run_threads: RunThreads
) -> None:
    proxy = _CountingDriver(driver)
    r = AsyncCudaResource(proxy, 0, pool)  # type: ignore[arg-type]  # a proxy driver, not a Driver subtype
    held = _allocate_until_refused(r)
    refused = proxy.allocated[-1]
    _allocates_again(r, held, run_threads)  # first: every call below takes the lock
    assert r.live_bytes() == 64 * len(held) and r.pending_free_bytes() == 0
    assert sorted(b.ptr for b in r.live_blocks()) == sorted(b.ptr for b in held)
    assert len(proxy.allocated) == len(held) + 1
    assert proxy.freed == [refused], "the refused allocation was given back to the driver"
    for block in held:
        r.deallocate(block)
    r.reap_pending()
    assert r.bytes_outstanding() == 0


def test_a_direct_allocation_whose_map_cannot_grow_changes_nothing(
    driver: xa.Driver, run_threads: RunThreads
) -> None:
    proxy = _CountingDriver(driver)
    r = DirectCudaResource(proxy, 0)  # type: ignore[arg-type]  # a proxy driver, not a Driver subtype
    held = _allocate_until_refused(r)
    refused = proxy.allocated[-1]
    _allocates_again(r, held, run_threads)  # first: every call below takes the lock
    assert r.bytes_outstanding() == 64 * len(held)
    assert sorted(b.ptr for b in r.live_blocks()) == sorted(b.ptr for b in held)
    assert len(proxy.allocated) == len(held) + 1
    assert proxy.freed == [refused], "the refused allocation was given back to the driver"
    for block in held:
        r.deallocate(block)
    assert r.bytes_outstanding() == 0 and r.live_blocks() == []
    assert sorted(proxy.freed) == sorted(proxy.allocated)


def test_fail_a_grow_fails_only_the_grow_it_was_armed_for() -> None:
    from xlog_actors._core.ptr_table import PtrTable

    table = PtrTable()
    fail_a_grow(1)  # the first grow passes, the second fails
    try:
        with pytest.raises(MemoryError):
            for i in range(_MAX):
                table.put(i << 8, i)
    finally:
        fail_a_grow(-1)
    # 64 slots grow at 33 entries, 128 at 65: the second grow is refused at the 65th put
    assert len(table) == 64 and table.get(63 << 8) == 63 and table.get(64 << 8) is None
    for i in range(64, 200):  # disarmed: it grows again
        table.put(i << 8, i)
    assert len(table) == 200
