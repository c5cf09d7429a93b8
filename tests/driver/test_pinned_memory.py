"""Pinned host memory at the driver: ``alloc_pinned``, ``free_pinned``, ``pinned_view``; typed
errors that change nothing; it outlives a context rebuild; copies to and from it."""

from __future__ import annotations

import numpy as np
import pytest

import xlog_actors as xa


def test_alloc_view_copy_and_free(driver: xa.Driver) -> None:
    ptr = driver.alloc_pinned(0, 10_000)
    try:
        assert ptr % 4096 == 0
        view = driver.pinned_view(ptr, 10_000)
        assert len(view) == 10_000 and not view.readonly and view.format == "B"
        view[:] = bytes(range(256)) * 39 + bytes(16)
        dev = driver.alloc(0, 10_000)
        stream = driver.create_stream(0)
        try:
            driver.copy_to_device(dev, view, stream)
            back = driver.pinned_view(ptr, 100)
            stream.synchronize()
            back[:] = bytes(100)
            driver.copy_to_host_into(dev, back, stream)
            stream.synchronize()
            assert bytes(back) == bytes(range(100))
        finally:
            stream.close()
            driver.free(0, dev)
        del view, back
    finally:
        driver.free_pinned(0, ptr)


def test_bad_pinned_calls_are_refused_and_change_nothing(driver: xa.Driver) -> None:
    for nbytes in (0, -1, 1.5, None, True):
        with pytest.raises(xa.InvalidRequest, match="pinned allocation size"):
            driver.alloc_pinned(0, nbytes)  # type: ignore[arg-type]
    with pytest.raises(xa.InvalidRequest):
        driver.alloc_pinned(driver.device_count(), 64)
    ptr = driver.alloc_pinned(0, 4096)
    with pytest.raises(xa.InvalidRequest, match="pinned view size"):
        driver.pinned_view(ptr, 0)
    with pytest.raises(xa.DriverError, match="holds 4096 bytes"):
        driver.pinned_view(ptr, 4097)
    foreign = np.zeros(8192, np.uint8)
    with pytest.raises(xa.DriverError, match="not a live"):
        driver.free_pinned(0, int(foreign.ctypes.data))
    with pytest.raises(xa.DriverError, match="not a live"):
        driver.pinned_view(int(foreign.ctypes.data), 16)
    with pytest.raises(xa.DriverError, match="not a live"):
        driver.free_pinned(0, ptr + 64)
    # None of that freed it: it is still viewable, and it frees exactly once.
    assert len(driver.pinned_view(ptr, 4096)) == 4096
    driver.free_pinned(0, ptr)
    with pytest.raises(xa.DriverError, match="not a live"):
        driver.free_pinned(0, ptr)
    with pytest.raises(xa.DriverError, match="not a live"):
        driver.pinned_view(ptr, 16)


def test_the_host_refusing_a_huge_allocation_is_out_of_memory(driver: xa.Driver) -> None:
    with pytest.raises(xa.OutOfMemory) as info:
        driver.alloc_pinned(0, 1 << 50)
    assert info.value.requested == 1 << 50
    ptr = driver.alloc_pinned(0, 64)  # the driver is fine afterwards
    driver.free_pinned(0, ptr)


def test_pinned_memory_outlives_a_context_rebuild(driver: xa.Driver) -> None:
    ptr = driver.alloc_pinned(0, 4096)
    driver.pinned_view(ptr, 4096)[:] = b"\x11" * 4096
    driver.rebuild_context(0)
    assert bytes(driver.pinned_view(ptr, 4096)) == b"\x11" * 4096
    dev = driver.alloc(0, 4096)
    stream = driver.create_stream(0)
    try:
        driver.copy_to_device(dev, driver.pinned_view(ptr, 4096), stream)
        got = driver.copy_to_host(dev, 4096, stream)
        stream.synchronize()
        assert got == b"\x11" * 4096
    finally:
        stream.close()
        driver.free(0, dev)
        driver.free_pinned(0, ptr)


def test_a_pointer_of_another_device_is_refused() -> None:
    driver = xa.HostDriver(device_count=2, memory_per_device=1 << 20)
    try:
        ptr = driver.alloc_pinned(1, 4096)
        with pytest.raises(xa.DriverError, match="device 1's"):
            driver.free_pinned(0, ptr)
        driver.free_pinned(1, ptr)
    finally:
        driver.close()


def test_close_drops_what_is_left() -> None:
    driver = xa.HostDriver(memory_per_device=1 << 20)
    ptr = driver.alloc_pinned(0, 4096)
    driver.close()
    with pytest.raises(xa.DriverError, match="closed"):
        driver.free_pinned(0, ptr)
    with pytest.raises(xa.DriverError, match="not a live"):
        driver.pinned_view(ptr, 16)


def test_a_host_copy_from_pinned_memory_is_not_snapshotted() -> None:
    """Pageable memory is staged when the copy is enqueued; pinned memory is read when the copy
    runs, as on a GPU (so the caller must leave it alone until then)."""
    driver = xa.HostDriver(memory_per_device=1 << 20)
    try:
        stream = driver.create_stream(0)
        dev = driver.alloc(0, 4096)
        ptr = driver.alloc_pinned(0, 4096)
        pinned = driver.pinned_view(ptr, 4096)
        pageable = bytearray(b"\x01" * 4096)
        pinned[:] = b"\x01" * 4096
        for source in (pageable, pinned):
            driver.sleep(stream, 100_000)
            driver.copy_to_device(dev, source, stream)
            source[:] = b"\x02" * 4096  # before the copy ran
            got = driver.copy_to_host(dev, 4096, stream)
            stream.synchronize()
            assert got == (b"\x01" if source is pageable else b"\x02") * 4096
        stream.close()
        del pinned
        driver.free_pinned(0, ptr)
    finally:
        driver.close()
