"""``PinnedBuffer`` and ``PinnedAllocator``: zero-copy numpy views, a lifetime that follows the
views, frees from any thread, counts by tag, and the memory report's pinned figures."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors.memory.pinned import PinnedAllocator, PinnedUsage


@pytest.fixture
def pinned(driver: xa.Driver) -> Iterator[PinnedAllocator]:
    yield PinnedAllocator(driver, 0)
    gc.collect()


def test_views_are_zero_copy_and_writable(pinned: PinnedAllocator, driver: xa.Driver) -> None:
    buf = pinned.allocate(4096, xa.AllocTag("io"))
    assert (buf.nbytes, buf.tag, buf.device_ordinal, buf.driver) == (4096, "io", 0, driver)
    words = buf.array(np.uint32)
    assert words.shape == (1024,) and words.flags.writeable
    words[:] = 0x01020304
    assert buf.view()[:4].tobytes() == np.uint32(0x01020304).tobytes()
    buf.view()[0] = 0xFF
    assert buf.array()[0] == 0xFF  # the same bytes, not a copy
    assert buf.array(np.float64, 3).shape == (3,)
    assert buf.array(count=0).shape == (0,)
    assert "io" in repr(buf)
    buf.release()
    assert "released" in repr(buf)


def test_bad_views_are_refused(pinned: PinnedAllocator) -> None:
    buf = pinned.allocate(100)
    for dtype, count in [(np.uint8, 101), (np.uint32, 26), (np.uint8, -1), (np.uint8, 2.0), (object, None)]:
        with pytest.raises(xa.InvalidRequest, match="PinnedBuffer.array"):
            buf.array(dtype, count)  # type: ignore[arg-type]
    with pytest.raises(xa.InvalidRequest, match="not a numpy dtype"):
        buf.array("no such dtype")
    buf.release()
    for call in (buf.array, buf.view):
        with pytest.raises(xa.InvalidRequest, match="released"):
            call()


def test_bad_allocations_are_refused_and_count_nothing(pinned: PinnedAllocator) -> None:
    for nbytes in (0, -3, 2.5, None):
        with pytest.raises(xa.InvalidRequest, match="AllocatePinned.nbytes"):
            pinned.allocate(nbytes)  # type: ignore[arg-type]
    with pytest.raises(xa.InvalidRequest, match="AllocatePinned.tag"):
        pinned.allocate(64, 5)  # type: ignore[arg-type]
    assert pinned.usage() == PinnedUsage(0, 0, {})


def test_the_memory_lives_as_long_as_any_view(pinned: PinnedAllocator) -> None:
    buf = pinned.allocate(4096, xa.AllocTag("a"))
    arr = buf.array(np.uint16)
    mv = buf.view()[10:20]
    buf.release()
    buf.release()
    assert (pinned.usage().count, pinned.usage().nbytes) == (1, 4096)
    del arr
    assert pinned.usage().count == 1  # the memoryview still holds it
    mv[0] = 1
    del mv
    assert pinned.usage() == PinnedUsage(0, 0, {})


def test_a_free_from_another_thread(pinned: PinnedAllocator) -> None:
    """The last reference dropped on another thread (as a stream thread does) frees it there."""
    buf = pinned.allocate(8192)
    views = [buf.array()]
    buf.release()
    del buf
    thread = threading.Thread(target=views.clear)
    thread.start()
    thread.join()
    assert pinned.usage().count == 0


def test_usage_by_tag_and_in_the_memory_report(pinned: PinnedAllocator, driver: xa.Driver) -> None:
    bufs = [pinned.allocate(n, xa.AllocTag(t)) for n, t in [(100, "x"), (200, "x"), (50, "y")]]
    usage = pinned.usage()
    assert (usage.count, usage.nbytes) == (3, 350)
    assert dict(usage.by_tag) == {"x": (2, 300), "y": (1, 50)}
    assert usage.as_dict() == {
        "count": 3,
        "nbytes": 350,
        "by_tag": {"x": {"count": 2, "nbytes": 300}, "y": {"count": 1, "nbytes": 50}},
    }
    pool = xa.StreamPool(driver, 0)
    resource = xa.AsyncCudaResource(driver, 0, pool)
    try:
        report = xa.memory_report(resource, usage)
        assert (report.pinned_count, report.pinned_bytes) == (3, 350)
        assert report.pinned_by_tag[xa.AllocTag("x")].count == 2
        assert report.as_dict()["pinned"]["by_tag"]["y"] == {"count": 1, "nbytes": 50, "oldest_age_s": None}
        assert "pinned host memory: 3 buffers" in report.format()
        bare = xa.memory_report(resource)
        assert (bare.pinned_count, bare.pinned_bytes, dict(bare.pinned_by_tag)) == (0, 0, {})
        assert "pinned" not in bare.format()
    finally:
        pool.close()
    for buf in bufs:
        buf.release()
    del buf
    assert pinned.usage() == PinnedUsage(0, 0, {})
