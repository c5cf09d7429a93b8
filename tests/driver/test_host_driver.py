"""The host driver emulates the CUDA stream model faithfully.

Ordering is checked through data and event/stream state, never through elapsed time: a sleep on a
stream only makes a race deterministic (the slow side is still running when the fast side is
checked), so each test asserts what the stream order says must be seen.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors import StreamPool
from xlog_actors.driver.host import ALIGNMENT, POISON_BYTE, align_up
from xlog_actors.errors import (
    ContextLost,
    ContextPoisoned,
    DriverError,
    InvalidRequest,
    OutOfMemory,
    XlogError,
)

SLOW_US = 200_000  # 200 ms: long enough that the other side of every race finishes first
N = 4096


@pytest.fixture
def drv() -> Iterator[xa.HostDriver]:
    d = xa.HostDriver(device_count=2, memory_per_device=64 << 20)
    yield d
    d.close()


def filled(byte: int, n: int = N) -> bytearray:
    return bytearray([byte]) * n


# -- stream ordering -----------------------------------------------------------------------------
def test_work_on_one_stream_completes_in_order(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    ptr = drv.alloc(0, N)
    drv.sleep(s, 20_000)  # let the queue build up behind slow work
    outs = []
    for i in range(64):
        drv.fill(ptr, i, N, s)
        outs.append(drv.copy_to_host(ptr, N, s))
    s.synchronize()
    assert s.query()
    for i, out in enumerate(outs):
        assert out == filled(i), f"copy {i} did not see the fill queued just before it"


def test_two_streams_overlap(drv: xa.HostDriver) -> None:
    a, b = drv.create_stream(0), drv.create_stream(0)
    ptr = drv.alloc(0, N)
    drv.sleep(a, SLOW_US)
    a_done = a.record_event()
    drv.fill(ptr, 7, N, b)
    out = drv.copy_to_host(ptr, N, b)
    b_done = b.record_event()
    b_done.synchronize()
    # B finished its work while A is still in its sleep: the sleep did not delay B.
    assert not a_done.query() and not a.query()
    assert out == filled(7)
    a.synchronize()
    assert a_done.query() and a.query()


def test_event_after_slow_work_is_not_done_before_it(drv: xa.HostDriver) -> None:
    a, b = drv.create_stream(0), drv.create_stream(0)
    ptr = drv.alloc(0, N)
    drv.fill(ptr, 1, N, a)
    a.synchronize()
    drv.sleep(a, SLOW_US)
    drv.fill(ptr, 2, N, a)
    event = a.record_event()
    assert not event.query()
    peek = drv.copy_to_host(ptr, N, b)
    b.synchronize()
    assert not event.query()
    assert peek == filled(1), "the slow work had not run yet, so the fill after it cannot have"
    event.synchronize()
    assert event.query()
    after = drv.copy_to_host(ptr, N, b)
    b.synchronize()
    assert after == filled(2), "event.synchronize() returned before the work recorded ahead of it"


def test_unrecorded_event_counts_as_complete(drv: xa.HostDriver) -> None:
    event = drv.create_event(0)
    assert event.query()
    event.synchronize()


@pytest.mark.parametrize("waited", [True, False], ids=["wait", "no-wait"])
def test_wait_orders_the_second_stream_after_the_event(drv: xa.HostDriver, waited: bool) -> None:
    a, b = drv.create_stream(0), drv.create_stream(0)
    ptr = drv.alloc(0, N)
    drv.fill(ptr, 1, N, a)
    a.synchronize()
    # Work queued on B before the wait is not held back by it.
    early = drv.copy_to_host(ptr, N, b)
    early_done = b.record_event()
    drv.sleep(a, SLOW_US)
    drv.fill(ptr, 2, N, a)
    event = a.record_event()
    if waited:
        b.wait(event)
        assert not event.query(), "Stream.wait blocked the host until the event completed"
    late = drv.copy_to_host(ptr, N, b)
    early_done.synchronize()
    assert not event.query()
    assert early == filled(1)
    b.synchronize()
    if waited:
        assert event.query(), "B's later work finished before the event it waits on"
        assert late == filled(2)
    else:
        # Control: without the wait B reads the bytes from before A's slow fill. This is what
        # proves the waited variant can fail.
        assert late == filled(1)
    a.synchronize()


def test_wait_keeps_the_record_it_saw(drv: xa.HostDriver) -> None:
    """CUDA semantics pooled events rely on: re-recording an event does not change what an
    already enqueued wait waits for."""
    a, b, c = (drv.create_stream(0) for _ in range(3))
    ptr = drv.alloc(0, N)
    event = drv.create_event(0)
    drv.sleep(a, SLOW_US)
    drv.fill(ptr, 3, N, a)
    a.record(event)
    b.wait(event)  # waits for the slow fill on A
    out = drv.copy_to_host(ptr, N, b)
    c.record(event)  # re-recorded on an idle stream: completes at once
    event.synchronize()
    assert not a.query()
    b.synchronize()
    assert out == filled(3)


def test_free_queued_behind_slow_work_does_not_take_effect_before_it(drv: xa.HostDriver) -> None:
    a, b = drv.create_stream(0), drv.create_stream(0)
    ptr = drv.alloc_async(N, a)
    drv.fill(ptr, 0x5A, N, a)
    a.synchronize()
    free_before, total = drv.mem_info(0)
    drv.sleep(a, SLOW_US)
    drv.free_async(ptr, a)
    assert drv.mem_info(0) == (free_before, total), "memory came back before the free ran"
    peek = drv.copy_to_host(ptr, N, b)
    b.synchronize()
    assert not a.query()
    assert peek == filled(0x5A), "the freed bytes were poisoned before the free ran"
    # Another stream cannot be handed the address while the free is pending.
    other = drv.alloc_async(N, b)
    assert other != ptr
    assert drv.mem_info(0) == (free_before - align_up(N), total)
    a.synchronize()
    assert drv.mem_info(0) == (free_before, total), "the free ran but its memory did not come back"
    after = drv.copy_to_host(ptr, N, b)
    b.synchronize()
    assert after == filled(POISON_BYTE)
    drv.free_async(other, b)
    b.synchronize()
    assert drv.mem_info(0) == (total, total)


def test_same_stream_reuse_of_a_pending_free_is_ordered_after_it(drv: xa.HostDriver) -> None:
    a = drv.create_stream(0)
    ptr = drv.alloc_async(N, a)
    drv.sleep(a, SLOW_US)
    drv.free_async(ptr, a)
    again = drv.alloc_async(N, a)
    assert again == ptr, "CUDA pools hand a same-stream free back at once; so does the emulator"
    drv.fill(again, 0x42, N, a)
    out = drv.copy_to_host(again, N, a)
    a.synchronize()
    assert out == filled(0x42), "the queued free's poison ran after the new owner's fill"
    drv.free_async(again, a)
    a.synchronize()
    assert drv.mem_info(0)[0] == drv.mem_info(0)[1]


def test_a_copy_reads_what_the_stream_order_says(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    src, dst = drv.alloc(0, N), drv.alloc(0, N)
    pattern = bytes(range(256)) * (N // 256)
    buf = bytearray(filled(1))
    drv.sleep(s, 50_000)
    drv.copy_to_device(src, buf, s)
    buf[:] = filled(9)  # the driver copied the source when the copy was enqueued
    first = drv.copy_to_host(src, N, s)
    drv.fill(src, 2, N, s)
    second = drv.copy_to_host(src, N, s)
    drv.copy_to_device(src, pattern, s)
    drv.copy_device_to_device(dst, src, N, s)
    drv.fill(src, 3, N, s)
    third = drv.copy_to_host(dst, N, s)
    into = np.zeros(N, np.uint8)
    drv.copy_to_host_into(src, into, s)
    s.synchronize()
    assert first == filled(1)
    assert second == filled(2)
    assert third == pattern
    assert bytes(into) == bytes(filled(3))


def test_freed_memory_reads_poison(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    ptr = drv.alloc(0, N)
    drv.fill(ptr, 0x11, N, s)
    drv.free(0, ptr)  # synchronous: waits for the fill, as cuMemFree does
    out = drv.copy_to_host(ptr, N, s)
    s.synchronize()
    assert out == filled(POISON_BYTE)
    ptr = drv.alloc_async(N, s)
    drv.fill(ptr, 0x22, N, s)
    drv.free_async(ptr, s)
    out = drv.copy_to_host(ptr, N, s)
    s.synchronize()
    assert out == filled(POISON_BYTE)


# -- memory --------------------------------------------------------------------------------------
def test_addresses_are_aligned_and_distinct(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    sizes = [1, 2, 255, 256, 257, 1000, 4096, 65537, 1 << 20]
    ranges = []
    for n in sizes:
        for ptr in (drv.alloc(0, n), drv.alloc_async(n, s), drv.alloc(1, n)):
            assert ptr % ALIGNMENT == 0
            ranges.append((ptr, ptr + n))
    ranges.sort()
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert end <= start, "two live allocations overlap"


def test_mem_info_reflects_allocations(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    free0, total = drv.mem_info(0)
    assert (free0, total) == (64 << 20, 64 << 20)
    a = drv.alloc(0, 1000)
    assert drv.mem_info(0) == (total - 1024, total)
    b = drv.alloc_async(5000, s)
    assert drv.mem_info(0) == (total - 1024 - align_up(5000), total)
    assert drv.mem_info(1) == (total, total), "device 1 is not touched by device 0's allocations"
    assert drv.live_allocations(0) == 2
    drv.free(0, a)
    drv.free_async(b, s)
    s.synchronize()
    assert drv.mem_info(0) == (total, total)
    assert drv.live_allocations(0) == 0


def test_out_of_memory_past_memory_per_device() -> None:
    drv = xa.HostDriver(memory_per_device=1 << 20)
    try:
        s = drv.create_stream(0)
        with pytest.raises(OutOfMemory) as info:
            drv.alloc(0, 2 << 20)
        assert info.value.requested == 2 << 20
        assert isinstance(info.value, (MemoryError, XlogError))
        assert drv.mem_info(0) == (1 << 20, 1 << 20) and drv.live_allocations(0) == 0
        blocks = [drv.alloc(0, 256 << 10) for _ in range(4)]
        with pytest.raises(OutOfMemory):
            drv.alloc(0, 1)
        with pytest.raises(OutOfMemory):
            drv.alloc_async(1, s)
        assert drv.mem_info(0)[0] == 0
        drv.free(0, blocks.pop())
        blocks.append(drv.alloc_async(256 << 10, s))  # usable again
        for p in blocks:
            drv.free(0, p)
        assert drv.mem_info(0) == (1 << 20, 1 << 20)
    finally:
        drv.close()


# -- faults --------------------------------------------------------------------------------------
def test_inject_oom_fails_one_call(drv: xa.HostDriver) -> None:
    before = drv.mem_info(0)
    drv.inject_fault(0, "oom")
    with pytest.raises(OutOfMemory) as info:
        drv.alloc(0, 4096)
    assert info.value.requested == 4096
    assert drv.mem_info(0) == before and drv.live_allocations(0) == 0
    drv.free(0, drv.alloc(0, 4096))


def test_inject_error_fails_one_call_with_a_code(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    drv.inject_fault(0, "error")
    with pytest.raises(DriverError) as info:
        drv.alloc_async(64, s)
    assert not isinstance(info.value, ContextLost)
    assert isinstance(info.value.code, str) and info.value.code.startswith("CUDA_ERROR_")
    assert drv.live_allocations(0) == 0
    ptr = drv.alloc_async(64, s)  # context intact
    drv.free_async(ptr, s)
    s.synchronize()


def test_inject_after_calls_counts_calls(drv: xa.HostDriver) -> None:
    drv.inject_fault(0, "error", after_calls=2)
    a = drv.alloc(0, 64)
    b = drv.alloc(0, 64)
    with pytest.raises(DriverError):
        drv.alloc(0, 64)
    drv.free(0, a)
    drv.free(0, b)


def test_inject_context_lost_until_rebuild(drv: xa.HostDriver) -> None:
    old = drv.create_stream(0)
    drv.alloc(0, 64)
    drv.inject_fault(0, "context_lost")
    with pytest.raises(ContextLost) as info:
        drv.alloc(0, 64)
    assert isinstance(info.value, DriverError)  # code that catches DriverError still catches it
    for call in (
        lambda: drv.alloc(0, 64),
        lambda: drv.create_stream(0),
        old.synchronize,
        lambda: drv.mem_info(0),
    ):
        with pytest.raises(ContextLost):
            call()
    drv.free(1, drv.alloc(1, 64))  # the other device is unaffected
    drv.rebuild_context(0)
    assert drv.live_allocations(0) == 0 and drv.mem_info(0)[0] == 64 << 20
    with pytest.raises(DriverError) as stale:
        old.synchronize()  # a stream of the destroyed context
    assert not isinstance(stale.value, ContextLost)
    s = drv.create_stream(0)
    ptr = drv.alloc_async(64, s)
    drv.fill(ptr, 5, 64, s)
    out = drv.copy_to_host(ptr, 64, s)
    s.synchronize()
    assert out == filled(5, 64)


def test_inject_sticky_poisons_forever(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    drv.inject_fault(0, "sticky")
    with pytest.raises(ContextPoisoned) as info:
        drv.alloc(0, 64)
    assert info.value.code is not None
    for call in (
        lambda: drv.alloc(0, 64),
        lambda: drv.create_stream(0),
        s.synchronize,
        lambda: drv.mem_info(0),
    ):
        with pytest.raises(ContextPoisoned):
            call()
    with pytest.raises(ContextPoisoned):
        drv.rebuild_context(0)
    with pytest.raises(ContextPoisoned):
        drv.alloc(0, 64)  # still poisoned after the failed rebuild
    drv.free(1, drv.alloc(1, 64))


def _kernel(host: object) -> xa.Kernel:
    return xa.Kernel(
        name="k",
        source='extern "C" __global__ void k(unsigned char* p) {}',
        params=("ptr",),
        host=host,
    )  # type: ignore[arg-type]


def test_host_kernel_runs_in_stream_order(drv: xa.HostDriver) -> None:
    def write(mem: object, grid: object, block: object, ptr: int) -> None:
        mem.array(ptr, N, np.uint8)[:] = 0x77  # type: ignore[attr-defined]

    s = drv.create_stream(0)
    ptr = drv.alloc(0, N)
    drv.fill(ptr, 1, N, s)
    drv.launch(_kernel(write), 1, 1, [ptr], s)
    out = drv.copy_to_host(ptr, N, s)
    s.synchronize()
    assert out == filled(0x77)


@pytest.mark.parametrize("how", ["illegal-address", "exception"])
def test_a_raising_host_kernel_poisons_the_device(drv: xa.HostDriver, how: str) -> None:
    def bad(mem: object, grid: object, block: object, ptr: int) -> None:
        if how == "illegal-address":
            mem.array(ptr + (1 << 41), 1, np.uint8)[0] = 1  # type: ignore[attr-defined]
        else:
            raise ZeroDivisionError("kernel bug")

    s = drv.create_stream(0)
    ptr = drv.alloc(0, N)
    drv.launch(_kernel(bad), 1, 1, [ptr], s)
    with pytest.raises(ContextPoisoned) as info:
        s.synchronize()
    expected = (
        "CUDA_ERROR_ILLEGAL_ADDRESS" if how == "illegal-address" else "CUDA_ERROR_LAUNCH_FAILED"
    )
    assert info.value.code == expected
    with pytest.raises(ContextPoisoned):
        drv.alloc(0, 64)
    with pytest.raises(ContextPoisoned):
        drv.rebuild_context(0)
    drv.free(1, drv.alloc(1, 64))


# -- shutdown and threads ------------------------------------------------------------------------
def _stream_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("xlog-host-stream")}


def test_close_leaves_no_thread_behind() -> None:
    before = _stream_threads()
    drv = xa.HostDriver(device_count=2, memory_per_device=1 << 20)
    streams = [drv.create_stream(o) for o in (0, 1) for _ in range(3)]
    pool = StreamPool(drv, 0)
    pool.acquire()
    mine = {f"xlog-host-stream-{s.ordinal}.{s.id}" for s in streams}
    mine |= {f"xlog-host-stream-0.{pool.resolve(sid).id}" for sid in pool.ids()}  # type: ignore[union-attr]
    assert mine <= _stream_threads(), "each stream runs on a thread named after it"
    ptr = drv.alloc_async(4096, streams[0])
    drv.sleep(streams[0], 50_000)
    drv.free_async(ptr, streams[0])
    streams[1].wait(streams[0].record_event())
    drv.close()
    assert not (_stream_threads() & mine)
    assert _stream_threads() <= before
    drv.close()  # idempotent
    with pytest.raises(DriverError):
        drv.alloc(0, 64)
    with pytest.raises(DriverError):
        streams[2].synchronize()


def test_rebuild_stops_the_old_context_threads(drv: xa.HostDriver) -> None:
    old = [drv.create_stream(0) for _ in range(3)]
    names = {f"xlog-host-stream-0.{s.id}" for s in old}
    drv.rebuild_context(0)
    assert not (_stream_threads() & names)


def test_stream_creation_races_with_synchronous_free(drv: xa.HostDriver) -> None:
    """``free`` waits on every stream of the device while other threads create streams: neither
    may fail (a set of streams iterated while another thread adds to it raises)."""
    errors: list[BaseException] = []
    stop = threading.Event()
    keep = [drv.create_stream(0) for _ in range(50)]  # a long set to iterate: a wide race window

    def make_streams() -> None:
        try:
            while not stop.is_set():
                drv.create_stream(0).close()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    def alloc_free() -> None:
        try:
            for _ in range(1000):
                drv.free(0, drv.alloc(0, 256))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)
        finally:
            stop.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=make_streams) for _ in range(3)]
        threads.append(threading.Thread(target=alloc_free))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert len(keep) == 50


def test_bad_sleep_and_closed_stream(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)
    with pytest.raises(InvalidRequest):
        drv.sleep(s, -1)
    s.close()
    s.close()
    with pytest.raises(DriverError):
        drv.fill(drv.alloc(0, 64), 0, 64, s)


def test_a_stream_refuses_an_event_of_another_driver(drv: xa.HostDriver) -> None:
    s = drv.create_stream(0)

    class Foreign:
        ordinal = 0

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            return None

    for call in (s.record, s.wait):
        with pytest.raises(InvalidRequest, match="HostEvent"):
            call(Foreign())
    assert s.query()
