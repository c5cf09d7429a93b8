"""The host driver's large copies: one memcpy through views of the arena, pageable snapshots in
reused staging buffers, and the stream-order and pageable-snapshot semantics kept.

Ordering is checked through data: a sleep on a stream only keeps the copy queued while the test
changes the source, never as synchronization.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors.driver.host.staging import MIN_POOLED_BYTES, StagingPool

BIG = 2 * MIN_POOLED_BYTES  # pooled
SLOW_US = 100_000


@pytest.fixture
def drv() -> Iterator[xa.HostDriver]:
    d = xa.HostDriver(device_count=1, memory_per_device=64 << 20)
    yield d
    d.close()


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_pool_reuses_a_buffer_that_fits_and_not_a_much_larger_one() -> None:
    pool = StagingPool(max_bytes=8 * BIG, min_bytes=1)
    a = pool.take(BIG)
    pool.give(a)
    assert pool.held_bytes == BIG
    assert pool.take(BIG - 1) is a  # fits, at most twice the size
    assert pool.held_bytes == 0
    pool.give(a)
    b = pool.take(BIG // 4)  # a is more than twice that: a new buffer, a stays pooled
    assert b is not a and b.nbytes == BIG // 4
    assert pool.held_bytes == BIG


def test_pool_drops_what_exceeds_its_cap_and_clear_empties_it() -> None:
    pool = StagingPool(max_bytes=BIG, min_bytes=1)
    a, b = pool.take(BIG), pool.take(BIG)
    pool.give(a)
    pool.give(b)  # past the cap: dropped
    assert pool.held_bytes == BIG
    assert pool.take(BIG) is a
    assert pool.take(BIG) is not b
    pool.give(a)
    pool.clear()
    assert pool.held_bytes == 0
    assert pool.take(BIG) is not a


@pytest.mark.parametrize("nbytes", [100, BIG])  # a plain snapshot, a pooled one
def test_a_pageable_copy_is_snapshotted_at_enqueue(drv: xa.HostDriver, nbytes: int) -> None:
    s = drv.create_stream(0)
    ptr = drv.alloc(0, nbytes)
    src = _pattern(nbytes, 1)
    expected = src.copy()
    drv.sleep(s, SLOW_US)  # the copy stays queued while the source changes
    drv.copy_to_device(ptr, src, s)
    src[:] = 0
    out = np.zeros(nbytes, np.uint8)
    drv.copy_to_host_into(ptr, out, s)
    s.synchronize()
    assert np.array_equal(out, expected)


def test_back_to_back_pageable_copies_each_keep_their_own_snapshot(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    a, b = drv.alloc(0, BIG), drv.alloc(0, BIG)
    src = _pattern(BIG, 2)
    first = src.copy()
    drv.sleep(s, SLOW_US)
    drv.copy_to_device(a, src, s)
    src[:] = 7
    drv.copy_to_device(b, src, s)  # both queued: two staging buffers lent at once
    got_a, got_b = drv.copy_to_host(a, BIG, s), drv.copy_to_host(b, BIG, s)
    s.synchronize()
    assert bytes(got_a) == first.tobytes() and bytes(got_b) == bytes([7]) * BIG
    assert drv._staging.held_bytes == 2 * BIG  # both given back once they ran
    drv.sleep(s, SLOW_US)
    drv.copy_to_device(a, src, s)  # a warm buffer again, lent until the copy ran
    assert drv._staging.held_bytes == BIG
    got_a, got_b = drv.copy_to_host(a, BIG, s), drv.copy_to_host(b, BIG, s)
    s.synchronize()
    assert bytes(got_a) == bytes(got_b) == src.tobytes()


def test_copy_to_host_into_reads_after_the_stream_order_and_copies_a_suffix(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    ptr = drv.alloc(0, BIG)
    data = _pattern(BIG, 3)
    drv.sleep(s, SLOW_US)
    drv.copy_to_device(ptr, data, s)
    out = np.zeros(BIG // 2, np.uint8)
    drv.copy_to_host_into(ptr + BIG // 2, out, s)  # queued behind the write
    s.synchronize()
    assert np.array_equal(out, data[BIG // 2 :])


def test_device_and_peer_copies_move_the_bytes(drv: xa.HostDriver) -> None:
    two = xa.HostDriver(device_count=2, memory_per_device=16 << 20)
    try:
        s0 = two.create_stream(0)
        a, b = two.alloc(0, BIG), two.alloc(0, BIG)
        c = two.alloc(1, BIG)
        data = _pattern(BIG, 4)
        two.copy_to_device(a, data, s0)
        two.copy_device_to_device(b, a, BIG, s0)
        two.copy_peer(1, c, 0, b, BIG, s0)
        s0.synchronize()
        s1 = two.create_stream(1)
        got = two.copy_to_host(c, BIG, s1)
        s1.synchronize()
        assert bytes(got) == data.tobytes()
    finally:
        two.close()


def test_a_copy_dropped_by_a_rebuild_leaves_the_new_context_usable(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    ptr = drv.alloc(0, BIG)
    drv.sleep(s, SLOW_US)
    drv.copy_to_device(ptr, _pattern(BIG, 5), s)  # dropped: its context goes first
    drv.rebuild_context(0)
    s2 = drv.create_stream(0)
    ptr2 = drv.alloc(0, BIG)
    data = _pattern(BIG, 6)
    drv.copy_to_device(ptr2, data, s2)
    out = np.empty(BIG, np.uint8)
    drv.copy_to_host_into(ptr2, out, s2)
    s2.synchronize()
    assert np.array_equal(out, data)


# -- registered host buffers and device views (the Ray fetch's one-copy paths) --------------------
def test_a_registered_buffer_is_read_when_the_copy_runs_until_unregistered(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    ptr = drv.alloc(0, BIG)
    src = _pattern(BIG, 7)
    key = drv.register_host(0, src)
    assert key == src.ctypes.data
    drv.sleep(s, SLOW_US)
    drv.copy_to_device(ptr, src, s)  # no snapshot: the change below is what lands
    src[:] = 9
    s.synchronize()
    assert bytes(drv.device_view(0, ptr, BIG)) == bytes([9]) * BIG
    drv.unregister_host(0, key)
    drv.sleep(s, SLOW_US)
    drv.copy_to_device(ptr, src, s)  # snapshotted again
    src[:] = 1
    s.synchronize()
    assert bytes(drv.device_view(0, ptr, BIG)) == bytes([9]) * BIG


def test_register_refuses_bad_buffers_and_overlaps_and_changes_nothing(drv: xa.HostDriver) -> None:
    buf = np.zeros(4096, np.uint8)
    with pytest.raises(xa.errors.InvalidRequest, match="empty"):
        drv.register_host(0, b"")
    with pytest.raises(xa.errors.InvalidRequest, match="C-contiguous"):
        drv.register_host(0, np.zeros((8, 8), np.uint8)[:, ::2])
    with pytest.raises(xa.errors.InvalidRequest):
        drv.register_host(5, buf)
    key = drv.register_host(0, buf)
    with pytest.raises(xa.errors.DriverError, match="overlaps") as info:
        drv.register_host(0, buf[100:200])
    assert info.value.code == "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"
    pinned = drv.alloc_pinned(0, 4096)
    with pytest.raises(xa.errors.DriverError, match="overlaps"):
        drv.register_host(0, drv.pinned_view(pinned, 4096))
    with pytest.raises(xa.errors.DriverError) as info:
        drv.unregister_host(0, key + 1)
    assert info.value.code == "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"
    drv.unregister_host(0, key)
    with pytest.raises(xa.errors.DriverError, match="not a buffer registered"):
        drv.unregister_host(0, key)  # twice
    assert drv.register_host(0, buf[100:200]) == key + 100  # the first registration is gone
    drv.free_pinned(0, pinned)


def test_register_on_a_closed_driver_is_a_typed_error() -> None:
    d = xa.HostDriver(device_count=1, memory_per_device=1 << 20)
    d.close()
    with pytest.raises(xa.errors.DriverError):
        d.register_host(0, np.zeros(16, np.uint8))


def test_a_device_view_is_read_only_and_only_of_a_live_allocation(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    ptr = drv.alloc(0, 4096)
    drv.fill(ptr, 3, 4096, s)
    s.synchronize()
    view = drv.device_view(0, ptr + 96, 64)
    assert view.readonly and bytes(view) == bytes([3]) * 64
    with pytest.raises(TypeError):
        view[0] = 1
    with pytest.raises(xa.errors.DriverError, match="not inside one live allocation") as info:
        drv.device_view(0, ptr + 4000, 200)
    assert info.value.code == "CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(xa.errors.DriverError, match="outside device memory"):
        drv.device_view(0, 12, 8)
    with pytest.raises(xa.errors.InvalidRequest):
        drv.device_view(0, ptr, 0)
    drv.free(0, ptr)
    with pytest.raises(xa.errors.DriverError, match="not inside one live allocation"):
        drv.device_view(0, ptr, 64)
    drv.rebuild_context(0)  # the view still held keeps the old mapping readable
    assert len(bytes(view)) == 64


def test_a_staging_buffer_the_host_cannot_give_is_out_of_memory() -> None:
    pool = StagingPool()
    with pytest.raises(xa.errors.OutOfMemory) as info:
        pool.take(1 << 62)
    assert info.value.requested == 1 << 62
    assert pool.held_bytes == 0
