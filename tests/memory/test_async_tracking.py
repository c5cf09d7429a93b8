"""AsyncCudaResource's tracking rules: the allocation-ready fence, ``last_write`` and the reads.

Two kinds of evidence, both needed: the waits and records the resource *issues* (observed through a
stream-pool proxy that logs every ``wait``/``record``, on any driver), and the *ordering* they
produce on the streams (checked through data and stream state, with sleeps only to make the race
deterministic).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import xlog_actors as xa
from xlog_actors import Access, AsyncCudaResource, BlockId, DeviceBlock, StreamId, StreamPool

SLOW_US = 150_000
N = 4096


class _LoggedStream:
    """Forwards to a driver stream, logging the waits and records issued on it."""

    def __init__(self, real: Any, sid: StreamId, log: _Log) -> None:
        self._real = real
        self._sid = sid
        self._log = log

    def wait(self, event: Any) -> None:
        self._log.waits.append((self._sid, self._log.recorded_on.get(id(event))))
        self._real.wait(event)

    def record(self, event: Any) -> None:
        self._log.records.append(self._sid)
        self._log.recorded_on[id(event)] = self._sid
        self._real.record(event)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Log:
    def __init__(self) -> None:
        self.waits: list[
            tuple[StreamId, StreamId | None]
        ] = []  # (waiting stream, recording stream)
        self.records: list[StreamId] = []
        self.recorded_on: dict[int, StreamId] = {}

    def clear(self) -> None:
        self.waits.clear()
        self.records.clear()


class _LoggedPool:
    def __init__(self, real: StreamPool, log: _Log) -> None:
        self.real = real
        self._log = log
        self._wrapped: dict[StreamId, _LoggedStream] = {}

    @property
    def device_ordinal(self) -> int:
        return self.real.device_ordinal

    def acquire(self) -> StreamId:
        return self.real.acquire()

    @property
    def streams(self) -> _LoggedPool:
        # The resource looks streams up with ``pool.streams.get(sid)``: route that through
        # ``resolve`` too.
        return self

    def get(self, sid: StreamId) -> _LoggedStream | None:
        return self.resolve(sid)

    def resolve(self, sid: StreamId) -> _LoggedStream | None:
        real = self.real.resolve(sid)
        if real is None:
            return None
        wrapped = self._wrapped.get(sid)
        if wrapped is None:
            wrapped = self._wrapped[sid] = _LoggedStream(real, sid, self._log)
        return wrapped


class _UnwrappingDriver:
    """Hands the driver its own stream objects back for stream-ordered allocation."""

    def __init__(self, real: xa.Driver) -> None:
        self._real = real

    def alloc_async(self, nbytes: int, stream: Any) -> int:
        return self._real.alloc_async(nbytes, getattr(stream, "_real", stream))

    def free_async(self, ptr: int, stream: Any) -> None:
        self._real.free_async(ptr, getattr(stream, "_real", stream))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class Tracked:
    def __init__(self, driver: xa.Driver) -> None:
        self.driver = driver
        self.pool = StreamPool(driver, 0)
        self.log = _Log()
        self._scratch = [driver.alloc(0, N) for _ in range(8)]
        self._free_scratch = list(self._scratch)
        self.res = AsyncCudaResource(_UnwrappingDriver(driver), 0, _LoggedPool(self.pool, self.log))  # type: ignore[arg-type]  # logging proxies

    def s(self, sid: StreamId) -> Any:
        return self.pool.resolve(sid)

    def prepare(self, block: DeviceBlock, sid: StreamId, access: Access) -> None:
        self.res.prepare_block_use(BlockId.from_block(block), sid, access)

    def finish(self, block: DeviceBlock, sid: StreamId, access: Access) -> None:
        self.res.finish_block_use(BlockId.from_block(block), sid, access)

    def events(self, block: DeviceBlock) -> int | None:
        return self.res.pending_use_event_count(block.ptr)

    def scratch(self) -> int:
        """A device buffer of N bytes outside the resource, for a reader to copy into. All are
        allocated up front: a synchronous allocation in the middle of a race might synchronize."""
        return self._free_scratch.pop()

    def close(self) -> None:
        for sid in self.pool.ids():
            self.s(sid).synchronize()
        self.res.reap_pending()
        for ptr in self._scratch:
            self.driver.free(0, ptr)
        self.pool.close()


class Readback:
    """What a read on a stream saw: the read is a device-to-device copy into a scratch buffer, and
    ``get()`` synchronizes that stream and fetches the bytes. (On CUDA a device-to-host copy into
    pageable memory returns only once it ran, which would end the very race a test sets up.)"""

    def __init__(self, t: Tracked, ptr: int, sid: StreamId) -> None:
        self._t, self._ptr, self._sid = t, ptr, sid

    def get(self) -> bytes:
        stream = self._t.s(self._sid)
        stream.synchronize()
        out = self._t.driver.copy_to_host(self._ptr, N, stream)
        stream.synchronize()
        return bytes(out)


@pytest.fixture
def t(driver: xa.Driver) -> Iterator[Tracked]:
    tr = Tracked(driver)
    yield tr
    tr.close()


def _slow_write(t: Tracked, block: DeviceBlock, sid: StreamId, byte: int) -> None:
    t.prepare(block, sid, Access.WRITE)
    t.driver.sleep(t.s(sid), SLOW_US)
    t.driver.fill(block.ptr, byte, block.nbytes, t.s(sid))
    t.finish(block, sid, Access.WRITE)


def _read(t: Tracked, block: DeviceBlock, sid: StreamId, slow: bool = False) -> Readback:
    scratch = t.scratch()
    t.prepare(block, sid, Access.READ)
    if slow:
        t.driver.sleep(t.s(sid), SLOW_US)
    t.driver.copy_device_to_device(scratch, block.ptr, block.nbytes, t.s(sid))
    t.finish(block, sid, Access.READ)
    return Readback(t, scratch, sid)


def test_read_waits_on_the_last_write_only(t: Tracked) -> None:
    A = StreamId.DEFAULT
    W, R1, R2 = (t.pool.acquire() for _ in range(3))
    x = t.res.allocate(N, A)
    _slow_write(t, x, W, 0x33)
    slow_read = _read(t, x, R1, slow=True)  # waits on W's write, then sleeps: finishes last
    scratch = t.scratch()
    t.log.clear()
    t.prepare(x, R2, Access.READ)
    assert t.log.waits == [(R2, W)], "a read waits on the last write and on nothing else"
    t.driver.copy_device_to_device(scratch, x.ptr, N, t.s(R2))
    t.finish(x, R2, Access.READ)
    t.s(R2).record_event().synchronize()
    assert not t.s(R1).query(), "the read waited on the other, slower read"
    assert Readback(t, scratch, R2).get() == bytes([0x33]) * N, (
        "the read did not wait for the write"
    )
    assert slow_read.get() == bytes([0x33]) * N
    t.res.deallocate(x)


def test_write_waits_on_the_last_write_and_every_read(t: Tracked) -> None:
    A = StreamId.DEFAULT
    W, R1, R2, W2 = (t.pool.acquire() for _ in range(4))
    x = t.res.allocate(N, A)
    _slow_write(t, x, W, 0x33)
    slow_read = _read(t, x, R1, slow=True)
    fast_read = _read(t, x, R2)
    t.log.clear()
    t.prepare(x, W2, Access.WRITE)
    assert sorted(t.log.waits) == sorted([(W2, W), (W2, R1), (W2, R2)])
    t.driver.fill(x.ptr, 0x44, N, t.s(W2))
    t.finish(x, W2, Access.WRITE)
    t.s(W2).record_event().synchronize()
    assert t.s(R1).query(), "the write ran before the slow read finished"
    # Write-after-read: the readers saw the old bytes, not the new write.
    assert slow_read.get() == fast_read.get() == bytes([0x33]) * N
    t.res.deallocate(x)


@pytest.mark.parametrize("access", list(Access), ids=lambda a: a.name)
def test_read_write_access_waits_like_a_write(t: Tracked, access: Access) -> None:
    W, R, U = (t.pool.acquire() for _ in range(3))
    x = t.res.allocate(N)
    _slow_write(t, x, W, 1)
    _read(t, x, R)
    t.log.clear()
    t.prepare(x, U, access)
    expected = [(U, W)] if access is Access.READ else sorted([(U, W), (U, R)])
    assert sorted(t.log.waits) == expected
    t.finish(x, U, access)
    t.res.deallocate(x)


def test_same_stream_waits_are_skipped(t: Tracked) -> None:
    A = StreamId.DEFAULT
    W = t.pool.acquire()
    x = t.res.allocate(N, A)
    for access in Access:  # on its allocation stream: ordered already
        t.prepare(x, A, access)
        t.finish(x, A, access)
    assert t.log.waits == []
    t.prepare(x, W, Access.WRITE)  # first cross-stream use: the fence, one wait
    assert t.log.waits == [(W, A)]
    t.finish(x, W, Access.WRITE)
    t.log.clear()
    for access in Access:  # the last write and every read are on W itself
        t.prepare(x, W, access)
        t.finish(x, W, access)
    assert t.log.waits == [], "a stream waited on its own events"
    t.res.deallocate(x)  # alloc stream waits on W's write: cross-stream, needed
    assert t.log.waits == [(A, W)]


def test_finish_write_replaces_last_write_and_clears_reads(t: Tracked) -> None:
    A = StreamId.DEFAULT
    R1, R2, W, R3 = (t.pool.acquire() for _ in range(4))
    x = t.res.allocate(N, A)
    assert t.events(x) == 0
    _read(t, x, R1)
    _read(t, x, R2)
    assert t.events(x) == 3  # the allocation fence as last_write, plus two reads
    t.prepare(x, W, Access.WRITE)
    t.finish(x, W, Access.WRITE)
    assert t.events(x) == 1, "a write replaces last_write and clears the reads"
    t.log.clear()
    t.prepare(x, R3, Access.READ)
    assert t.log.waits == [(R3, W)], "the next read waits on the new last write only"
    _read(t, x, R3)
    assert t.events(x) == 2
    _read(t, x, R3)
    assert t.events(x) == 2, "a second read on the same stream re-records its event in place"
    t.res.deallocate(x)
    assert t.events(x) is None


def test_a_later_read_on_the_same_stream_is_what_a_writer_waits_for(t: Tracked) -> None:
    """One read event per stream, re-recorded in place: it must then mark the *later* read."""
    A = StreamId.DEFAULT
    R, W = t.pool.acquire(), t.pool.acquire()
    x = t.res.allocate(N, A)
    t.driver.fill(x.ptr, 0x21, N, t.s(A))
    _read(t, x, R)
    t.s(R).synchronize()
    slow_read = _read(t, x, R, slow=True)
    assert t.events(x) == 2
    t.prepare(x, W, Access.WRITE)
    t.driver.fill(x.ptr, 0x22, N, t.s(W))
    t.finish(x, W, Access.WRITE)
    t.s(W).synchronize()
    assert t.s(R).query(), "the writer waited on the first read only"
    assert slow_read.get() == bytes([0x21]) * N
    t.res.deallocate(x)


def test_record_block_use_is_finish_with_read(t: Tracked) -> None:
    A = StreamId.DEFAULT
    B = t.pool.acquire()
    x = t.res.allocate(N, A)
    t.res.record_block_use(x, B)
    assert t.log.records == [B] and t.log.waits == []  # recorded after the use, no pre-launch wait
    assert t.events(x) == 1
    t.log.clear()
    t.res.deallocate(x)
    assert t.log.waits == [(A, B)], "the free waits on the recorded use"


def test_deallocate_waits_on_every_cross_stream_event(t: Tracked) -> None:
    A = t.pool.acquire()
    W, R1, R2 = (t.pool.acquire() for _ in range(3))
    x = t.res.allocate(N, A)
    _slow_write(t, x, W, 7)
    _read(t, x, R1)
    _read(t, x, R2)
    _read(t, x, A)  # a read on the allocation stream itself: ordered before the free already
    t.log.clear()
    t.res.deallocate(x)
    assert sorted(t.log.waits) == sorted([(A, W), (A, R1), (A, R2)])


def test_allocation_ready_fence_and_event_reuse(t: Tracked) -> None:
    A = StreamId.DEFAULT
    B = t.pool.acquire()
    before = t.res.events_created()
    x = t.res.allocate(N, A)
    assert t.res.events_created() == before, "no event at allocation time"
    t.prepare(x, B, Access.READ)
    assert t.log.records == [A] and t.log.waits == [(B, A)], "first use on B is fenced on A"
    assert t.res.events_created() == before + 1
    t.finish(x, B, Access.READ)
    assert t.res.events_created() == before + 2  # B's read event
    t.res.deallocate(x)
    for _ in range(20):  # later blocks take their events from the pool
        t.log.clear()
        y = t.res.allocate(N, A)
        t.prepare(y, B, Access.WRITE)
        assert t.log.waits == [(B, A)]
        t.finish(y, B, Access.WRITE)
        t.res.deallocate(y)
    assert t.res.events_created() == before + 2, "events are not reused from the pool"


def test_a_block_used_only_on_its_stream_records_no_event(t: Tracked) -> None:
    S = t.pool.acquire()
    before = t.res.events_created()
    for _ in range(10):
        x = t.res.allocate(N, S)
        for access in (Access.WRITE, Access.READ, Access.READ_WRITE, Access.READ):
            t.prepare(x, S, access)
            t.driver.fill(x.ptr, 1, N, t.s(S))
            t.finish(x, S, access)
        t.res.record_block_use(x, S)
        assert t.events(x) == 0
        t.res.deallocate(x)
    assert t.log.records == [] and t.log.waits == []
    assert t.res.events_created() == before


def test_fence_after_own_stream_reads_still_covers_them(t: Tracked) -> None:
    """Reads on the allocation stream record nothing, so a later writer on another stream must
    still be ordered after them: the lazy fence, recorded at that moment, covers them."""
    A = t.pool.acquire()
    W = t.pool.acquire()
    x = t.res.allocate(N, A)
    t.driver.fill(x.ptr, 0x55, N, t.s(A))
    slow_read = _read(t, x, A, slow=True)  # on A, nothing recorded
    t.prepare(x, W, Access.WRITE)
    t.driver.fill(x.ptr, 0x66, N, t.s(W))
    t.finish(x, W, Access.WRITE)
    t.s(W).synchronize()
    assert t.s(A).query(), "the writer on W did not wait for the read on A"
    assert slow_read.get() == bytes([0x55]) * N
    t.res.deallocate(x)


@pytest.mark.parametrize("hook", ["prepare", "finish"])
def test_a_failed_hook_changes_nothing(hook: str) -> None:
    """Fail each driver call a hook makes in turn: the block's tracking state is as before, the
    event goes back to the pool, and the next call succeeds."""
    drv = xa.HostDriver(memory_per_device=16 << 20)  # its own: injected faults must not leak
    try:
        pool = StreamPool(drv, 0)
        res = AsyncCudaResource(drv, 0, pool)
        A, B = pool.acquire(), pool.acquire()
        # Warm the event pool, so the hooks create no event and their driver calls are exactly:
        # prepare: record the allocation fence on A, then B's wait on it; finish: record on B.
        warm = res.allocate(N, A)
        res.prepare_block_use(BlockId.from_block(warm), B, Access.WRITE)
        res.finish_block_use(BlockId.from_block(warm), B, Access.WRITE)
        res.deallocate(warm)
        created = res.events_created()
        x = res.allocate(N, A)
        bid = BlockId.from_block(x)
        if hook == "finish":
            res.prepare_block_use(bid, B, Access.WRITE)
        call = {"prepare": res.prepare_block_use, "finish": res.finish_block_use}[hook]
        for after_calls in range(2 if hook == "prepare" else 1):
            before = (
                res.pending_use_event_count(x.ptr),
                res.live_bytes(),
                res.pending_free_bytes(),
            )
            drv.inject_fault(0, "error", after_calls=after_calls)
            with pytest.raises(xa.DriverError, match="injected"):
                call(bid, B, Access.WRITE)
            assert (
                res.pending_use_event_count(x.ptr),
                res.live_bytes(),
                res.pending_free_bytes(),
            ) == before
        call(bid, B, Access.WRITE)
        if hook == "prepare":
            res.finish_block_use(bid, B, Access.WRITE)
        assert res.pending_use_event_count(x.ptr) == 1
        assert res.events_created() == created, "a failed hook's event did not go back to the pool"
        res.deallocate(x)
        res.reap_pending()
        assert res.bytes_outstanding() == 0
        pool.close()
    finally:
        drv.close()


def test_events_created_counts_only_events_the_driver_made() -> None:
    drv = xa.HostDriver(memory_per_device=16 << 20)
    try:
        pool = StreamPool(drv, 0)
        res = AsyncCudaResource(drv, 0, pool)
        B = pool.acquire()
        x = res.allocate(N)
        drv.inject_fault(0, "error")  # the pool is empty: creating the fence's event fails
        with pytest.raises(xa.DriverError):
            res.prepare_block_use(BlockId.from_block(x), B, Access.READ)
        assert res.events_created() == 0
        res.prepare_block_use(BlockId.from_block(x), B, Access.READ)
        assert res.events_created() == 1
        res.deallocate(x)
        pool.close()
    finally:
        drv.close()
