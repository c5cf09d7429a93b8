"""One conformance suite for every resource stack on every driver present.

The generic tests use only the ``DeviceMemoryResource`` interface (plus ``reap_pending()`` before
asserting zero), so any stack ``build_resource`` understands can be appended to
``STACK_DESCRIPTIONS``. The tests of each concrete backend follow.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import queue
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import xlog_actors as xa
from xlog_actors import (
    Access,
    AllocTag,
    AsyncCudaResource,
    BlockId,
    BlockState,
    DeviceBlock,
    DeviceMemoryResource,
    DirectCudaResource,
    Generation,
    StreamId,
    StreamPool,
)
from xlog_actors.errors import DriverError, InvalidRequest, StreamMisuse, UseAfterFree
from xlog_actors.memory.stack import build_resource

# Resource stacks under test. Other stacks (adaptors such as "async+stats") are appended here.
STACK_DESCRIPTIONS = [
    "async",
    "direct",
    "async+stats",
    "direct+stats",
    "async+log:/dev/null",
    "direct+log:/dev/null",
    "async+budget:256MiB",
    "direct+budget:256MiB",
    "async+guard",
    "direct+guard",
    "async+stats+log:/dev/null+budget:256MiB+guard",
    "direct+guard+budget:256MiB+log:/dev/null+stats",
    "async+cache",
    "async+cache:1MiB",
    "async+cache+stats+log:/dev/null+budget:256MiB+guard",
]

ALIGN = 256
KiB, MiB = 1 << 10, 1 << 20


class Stack:
    """A resource stack on device 0 of ``driver`` with its own stream pool."""

    def __init__(self, driver: xa.Driver, description: str) -> None:
        self.driver = driver
        self.description = description
        self.pool = StreamPool(driver, 0)
        self.res: DeviceMemoryResource = build_resource(description, driver, 0, self.pool)

    def stream(self, sid: StreamId) -> xa.Stream:
        s = self.pool.resolve(sid)
        assert s is not None
        return s

    def write(self, block: DeviceBlock, data: bytes, sid: StreamId | None = None) -> None:
        sid = block.alloc_stream if sid is None else sid
        self.driver.copy_to_device(block.ptr, data, self.stream(sid))

    def read(self, block: DeviceBlock, sid: StreamId | None = None) -> bytes:
        sid = block.alloc_stream if sid is None else sid
        stream = self.stream(sid)
        out = self.driver.copy_to_host(block.ptr, block.nbytes, stream)
        stream.synchronize()
        return bytes(out)

    def assert_drained(self) -> None:
        self.res.reap_pending()
        assert self.res.bytes_outstanding() == 0


@pytest.fixture(params=STACK_DESCRIPTIONS)
def stack(request: pytest.FixtureRequest, driver: xa.Driver) -> Iterator[Stack]:
    s = Stack(driver, request.param)
    yield s
    try:
        s.res.reap_pending()
    finally:
        s.pool.close()


@functools.lru_cache(maxsize=4)
def pattern(nbytes: int, seed: int) -> bytes:
    """Bytes that do not repeat with any short period, so a shifted or aliased copy shows.
    Cached: 64 MiB of them take longer to make than a round trip."""
    return random.Random(seed).randbytes(nbytes)


def assert_no_overlap(blocks: list[DeviceBlock]) -> None:
    spans = sorted((b.ptr, b.ptr + b.nbytes) for b in blocks)
    for (s0, e0), (s1, e1) in itertools.pairwise(spans):
        assert e0 <= s1, f"live blocks alias: [{s0:#x}, {e0:#x}) and [{s1:#x}, {e1:#x})"


# -- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [1, 4 * KiB, MiB, 64 * MiB], ids=["1B", "4KiB", "1MiB", "64MiB"])
@pytest.mark.parametrize("on_default", [True, False], ids=["default-stream", "acquired-stream"])
def test_round_trip(stack: Stack, nbytes: int, on_default: bool) -> None:
    sid = StreamId.DEFAULT if on_default else stack.pool.acquire()
    tag = AllocTag("round-trip")
    block = stack.res.allocate(nbytes, sid, tag)
    assert (block.nbytes, block.alloc_stream, block.tag, block.device_ordinal) == (
        nbytes,
        sid,
        tag,
        0,
    )
    assert block.state is BlockState.LIVE
    assert stack.res.bytes_outstanding() >= nbytes
    data = pattern(nbytes, nbytes)
    stack.write(block, data)
    assert stack.read(block) == data
    stack.res.deallocate(block)
    stack.assert_drained()


def test_pointers_are_aligned(stack: Stack) -> None:
    rng = random.Random(7)
    sizes = [1, 2, 3, 255, 256, 257, 511, 4097] + [rng.randint(1, 10_000) for _ in range(50)]
    blocks = [stack.res.allocate(n) for n in sizes]
    for b in blocks:
        assert b.ptr % ALIGN == 0, f"{b.ptr:#x} is not {ALIGN}-byte aligned"
    for b in blocks:
        stack.res.deallocate(b)
    stack.assert_drained()


def test_live_blocks_never_alias(stack: Stack) -> None:
    """Random allocate/free on two streams; every live block keeps its own bytes."""
    rng = random.Random(11)
    sids = [StreamId.DEFAULT, stack.pool.acquire()]
    live: list[tuple[DeviceBlock, bytes]] = []
    for step in range(300):
        if live and rng.random() < 0.35:
            block, _ = live.pop(rng.randrange(len(live)))
            stack.res.deallocate(block)
            continue
        block = stack.res.allocate(rng.randint(1, 3 * 4096), rng.choice(sids))
        data = pattern(block.nbytes, step)
        stack.write(block, data)
        live.append((block, data))
        assert_no_overlap([b for b, _ in live])
    for block, data in live:
        assert stack.read(block) == data, "a live block's bytes were overwritten by another's"
        stack.res.deallocate(block)
    stack.assert_drained()


def _random_steps(
    res: DeviceMemoryResource,
    sids: list[StreamId],
    rng: random.Random,
    steps: int,
    check: Callable[[DeviceBlock, int], None] | None = None,
    fill: Callable[[DeviceBlock, int], None] | None = None,
) -> None:
    live: list[DeviceBlock] = []
    for _ in range(steps):
        if live and rng.random() < 0.5:
            block = live.pop(rng.randrange(len(live)))
            if check:
                check(block, len(live))
            res.deallocate(block)
        else:
            block = res.allocate(rng.randint(1, 64 * KiB), rng.choice(sids), AllocTag("random"))
            if fill:
                fill(block, len(live))
            live.append(block)
        assert res.bytes_outstanding() >= sum(b.nbytes for b in live)
    for block in live:
        res.deallocate(block)


def test_random_alloc_free_ends_at_zero(stack: Stack) -> None:
    sids = [StreamId.DEFAULT, stack.pool.acquire(), stack.pool.acquire()]
    _random_steps(stack.res, sids, random.Random(1234), 1000)
    stack.assert_drained()


def _run_threads(targets: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(targets))

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                barrier.wait()
                fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
                errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]


def test_random_alloc_free_from_8_threads(stack: Stack) -> None:
    """Eight threads at once, each on its own stream plus the shared default one; each block
    carries its thread's byte and is checked before it is freed, so cross-thread aliasing shows."""

    def worker(tid: int) -> Callable[[], None]:
        def run() -> None:
            sids = [StreamId.DEFAULT, stack.pool.acquire()]
            byte = 0x10 + tid

            def fill(block: DeviceBlock, _: int) -> None:
                stack.driver.fill(block.ptr, byte, block.nbytes, stack.stream(block.alloc_stream))

            def check(block: DeviceBlock, _: int) -> None:
                assert stack.read(block) == bytes([byte]) * block.nbytes, (
                    f"thread {tid}: block clobbered"
                )

            _random_steps(stack.res, sids, random.Random(tid), 150, check=check, fill=fill)

        return run

    _run_threads([worker(t) for t in range(8)])
    stack.assert_drained()


def test_allocate_on_one_thread_free_on_another(stack: Stack) -> None:
    handoff: queue.Queue[tuple[DeviceBlock, bytes] | None] = queue.Queue()
    sid = stack.pool.acquire()
    other = stack.pool.acquire()
    tracked = stack.res.supports_block_use_tracking()

    def producer() -> None:
        rng = random.Random(5)
        for i in range(200):
            block = stack.res.allocate(
                rng.randint(1, 16 * KiB), rng.choice([StreamId.DEFAULT, sid])
            )
            data = pattern(block.nbytes, i)
            stack.write(block, data)
            handoff.put((block, data))
        handoff.put(None)

    def consumer() -> None:
        while (item := handoff.get()) is not None:
            block, data = item
            if tracked:
                # Read on yet another stream, tracked, then free from this thread: the free waits
                # for this read.
                bid = BlockId.from_block(block)
                stack.res.prepare_block_use(bid, other, Access.READ)
                out = stack.driver.copy_to_host(block.ptr, block.nbytes, stack.stream(other))
                stack.res.finish_block_use(bid, other, Access.READ)
                stack.res.deallocate(block)
                stack.stream(other).synchronize()
                assert bytes(out) == data
            else:
                assert stack.read(block) == data
                stack.res.deallocate(block)

    _run_threads([producer, consumer])
    stack.assert_drained()


def test_double_free_is_use_after_free(stack: Stack) -> None:
    block = stack.res.allocate(1000)
    stack.res.deallocate(block)
    stack.res.reap_pending()
    with pytest.raises(UseAfterFree) as info:
        stack.res.deallocate(block)
    assert info.value.generation == block.generation
    stack.assert_drained()


def test_aba_old_handle_cannot_touch_the_new_block(stack: Stack) -> None:
    """Free a block, allocate until its address comes back, then use the old DeviceBlock and
    BlockId: UseAfterFree every time, and the new block stays live with its bytes untouched."""
    res = stack.res
    nbytes = 4096
    old = res.allocate(nbytes)
    res.deallocate(old)
    new: DeviceBlock | None = None
    misses: list[DeviceBlock] = []
    for _ in range(64):
        res.reap_pending()
        candidate = res.allocate(nbytes)
        if candidate.ptr == old.ptr:
            new = candidate
            break
        misses.append(candidate)  # keep it live so the next try gets another address
    for b in misses:
        res.deallocate(b)
    assert new is not None, (
        f"{stack.description}: address {old.ptr:#x} never came back in 64 allocations"
    )
    assert new.generation != old.generation
    data = pattern(nbytes, 99)
    stack.write(new, data)
    res.reap_pending()
    outstanding = res.bytes_outstanding()

    old_id = BlockId.from_block(old)
    with pytest.raises(UseAfterFree) as info:
        res.deallocate(old)
    assert info.value.generation == old.generation
    if res.supports_block_use_tracking():
        other = stack.pool.acquire()
        for access in Access:
            with pytest.raises(UseAfterFree):
                res.prepare_block_use(old_id, other, access)
            with pytest.raises(UseAfterFree):
                res.finish_block_use(old_id, other, access)
        with pytest.raises(UseAfterFree):
            res.record_block_use(old, other)
    else:
        with pytest.raises(StreamMisuse):
            res.prepare_block_use(old_id, StreamId.DEFAULT, Access.WRITE)

    assert res.bytes_outstanding() == outstanding
    assert stack.read(new) == data, "the stale handle reached the new block's bytes"
    res.deallocate(new)  # the new block is still live
    stack.assert_drained()


def test_default_hooks_of_the_abstract_resource() -> None:
    """The base class never pretends to track."""

    class Minimal(DeviceMemoryResource):
        def allocate(
            self,
            nbytes: int,
            stream: StreamId = StreamId.DEFAULT,
            tag: AllocTag = AllocTag.UNTAGGED,
        ) -> DeviceBlock:
            raise NotImplementedError

        def deallocate(self, block: DeviceBlock) -> None:
            raise NotImplementedError

        @property
        def device_ordinal(self) -> int:
            return 0

        def bytes_outstanding(self) -> int:
            return 0

    r = Minimal()
    assert r.reap_pending() is None
    assert r.supports_block_use_tracking() is False
    block = DeviceBlock(0x100, 0, StreamId.DEFAULT, 1, 256, AllocTag.UNTAGGED, Generation.next())
    for hook in (
        lambda: r.record_block_use(block, StreamId.DEFAULT),
        lambda: r.prepare_block_use(BlockId.from_block(block), StreamId.DEFAULT, Access.READ),
        lambda: r.finish_block_use(BlockId.from_block(block), StreamId.DEFAULT, Access.READ),
    ):
        with pytest.raises(StreamMisuse, match="unsupported"):
            hook()


# == the concrete backends =======================================================================
def _bogus_block(ptr: int) -> DeviceBlock:
    return DeviceBlock(
        ptr, 0, StreamId.DEFAULT, 16, 1, AllocTag.UNTAGGED, Generation.next(), BlockState.LIVE
    )


class TestDirectBackend:
    """``DirectCudaResource`` on its own."""

    def test_allocate_then_deallocate_round_trips(self, driver: xa.Driver) -> None:
        r = DirectCudaResource(driver, 0)
        assert r.bytes_outstanding() == 0
        block = r.allocate(4096, StreamId.DEFAULT, AllocTag.UNTAGGED)
        assert block.nbytes == 4096
        assert block.state is BlockState.LIVE
        assert r.bytes_outstanding() == 4096
        r.deallocate(block)
        assert r.bytes_outstanding() == 0

    def test_zero_byte_allocate_rejects(self, driver: xa.Driver) -> None:
        r = DirectCudaResource(driver, 0)
        with pytest.raises(InvalidRequest):
            r.allocate(0, StreamId.DEFAULT, AllocTag.UNTAGGED)
        assert r.bytes_outstanding() == 0

    def test_deallocate_unknown_block_returns_use_after_free(self, driver: xa.Driver) -> None:
        r = DirectCudaResource(driver, 0)
        with pytest.raises(UseAfterFree):
            r.deallocate(_bogus_block(0xDEAD_BEEF))

    def test_record_block_use_rejected_with_stream_misuse(self, driver: xa.Driver) -> None:
        r = DirectCudaResource(driver, 0)
        block = r.allocate(64, StreamId.DEFAULT, AllocTag.UNTAGGED)
        with pytest.raises(StreamMisuse) as info:
            r.record_block_use(block, StreamId.DEFAULT)
        assert "unsupported" in str(info.value)
        assert r.bytes_outstanding() == 64  # the block stays live
        r.deallocate(block)

    def test_pointer_collision_leaves_the_map_unchanged(self) -> None:
        driver = _CollidingDriver()
        r = DirectCudaResource(driver, 0)  # type: ignore[arg-type]  # a stub with only what the resource calls
        first = r.allocate(64)
        driver.collide_next = first.ptr
        with pytest.raises(DriverError, match="collision"):
            r.allocate(128)
        assert r.bytes_outstanding() == 64
        assert r.live_blocks() == [first]
        assert driver.freed == [first.ptr], "the colliding allocation was given back"
        r.deallocate(first)
        assert r.bytes_outstanding() == 0


def test_a_direct_free_the_driver_refuses_leaves_the_block_live_and_counted(
    driver: xa.Driver, run_threads: Callable[[Callable[[], object], int, float], list[BaseException]]
) -> None:
    """The block leaves the map before the driver is called; when the driver refuses, it goes back
    under the lock with its bytes, the lock is free afterwards (another thread allocates within a
    deadline), and a second free succeeds."""
    proxy = _RefusingFreeDriver(driver)
    r = DirectCudaResource(proxy, 0)  # type: ignore[arg-type]  # a proxy driver, not a Driver subtype
    block = r.allocate(64)
    proxy.refuse_next = True
    with pytest.raises(DriverError, match="refused"):
        r.deallocate(block)
    other: list[Any] = []
    assert run_threads(lambda: other.append(r.allocate(64)), 1, 10.0) == []
    assert r.bytes_outstanding() == 128
    assert sorted(b.ptr for b in r.live_blocks()) == sorted([block.ptr, other[0].ptr])
    r.deallocate(block)
    r.deallocate(other[0])
    assert r.bytes_outstanding() == 0 and r.live_blocks() == []


class _RefusingFreeDriver:
    """Forwards to a real driver, except that it can refuse one synchronous free."""

    def __init__(self, real: xa.Driver) -> None:
        self._real = real
        self.refuse_next = False

    def free(self, ordinal: int, ptr: int) -> None:
        if self.refuse_next:
            self.refuse_next = False
            raise DriverError(f"device {ordinal}: cuMemFree({ptr:#x}) refused (test)")
        self._real.free(ordinal, ptr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _CollidingDriver:
    """Just enough of a driver for DirectCudaResource, able to hand out a live address again."""

    kind = "host"

    def __init__(self) -> None:
        self.next_ptr = 0x10000
        self.collide_next: int | None = None
        self.freed: list[int] = []

    def alloc(self, ordinal: int, nbytes: int) -> int:
        if self.collide_next is not None:
            ptr, self.collide_next = self.collide_next, None
            return ptr
        ptr = self.next_ptr
        self.next_ptr += 1 << 20
        return ptr

    def free(self, ordinal: int, ptr: int) -> None:
        self.freed.append(ptr)


class TestAsyncBackend:
    """``AsyncCudaResource`` on its own, with the pending-free accounting."""

    @pytest.fixture
    def pool(self, driver: xa.Driver) -> Iterator[StreamPool]:
        p = StreamPool(driver, 0)
        yield p
        p.close()

    def test_allocate_then_deallocate_round_trips_on_default_stream(
        self, driver: xa.Driver, pool: StreamPool
    ) -> None:
        r = AsyncCudaResource(driver, 0, pool)
        block = r.allocate(2048, StreamId.DEFAULT, AllocTag.UNTAGGED)
        assert block.nbytes == 2048
        assert block.alloc_stream == StreamId.DEFAULT
        assert r.bytes_outstanding() == 2048
        assert r.live_bytes() == 2048
        assert r.pending_free_bytes() == 0

        r.deallocate(block)
        # Pending after dealloc: the free is queued, not known to be done.
        assert r.live_bytes() == 0
        assert r.pending_free_bytes() == 2048
        assert r.bytes_outstanding() == 2048

        r.reap_pending()
        assert r.bytes_outstanding() == 0
        assert r.pending_free_bytes() == 0

    def test_allocate_on_acquired_non_default_stream(
        self, driver: xa.Driver, pool: StreamPool
    ) -> None:
        r = AsyncCudaResource(driver, 0, pool)
        stream = pool.acquire()
        assert stream != StreamId.DEFAULT and pool.resolve(stream) is not None
        block = r.allocate(1024, stream, AllocTag("async-test"))
        assert block.alloc_stream == stream
        r.deallocate(block)
        assert r.bytes_outstanding() == 1024  # still counted until reap
        r.reap_pending()
        assert r.bytes_outstanding() == 0

    def test_allocate_unknown_stream_id_rejected(self, driver: xa.Driver, pool: StreamPool) -> None:
        r = AsyncCudaResource(driver, 0, pool)
        with pytest.raises(StreamMisuse):
            r.allocate(64, StreamId(99), AllocTag.UNTAGGED)
        assert r.bytes_outstanding() == 0

    def test_deallocate_unknown_block_returns_use_after_free(
        self, driver: xa.Driver, pool: StreamPool
    ) -> None:
        r = AsyncCudaResource(driver, 0, pool)
        with pytest.raises(UseAfterFree):
            r.deallocate(_bogus_block(0xFEED_FACE))

    def test_reap_with_no_pending_is_noop(self, driver: xa.Driver, pool: StreamPool) -> None:
        r = AsyncCudaResource(driver, 0, pool)
        r.reap_pending()
        assert r.bytes_outstanding() == 0

        def never(_: StreamId) -> None:
            raise AssertionError("reap synchronized a stream although nothing was pending")

        r.reap_pending_with(never)

    def _pending_on(
        self, r: AsyncCudaResource, pool: StreamPool, sizes: list[int]
    ) -> dict[StreamId, int]:
        """Deallocate one block of each size, each on its own stream: real pending frees."""
        by_stream: dict[StreamId, int] = {}
        for nbytes in sizes:
            sid = pool.acquire()
            r.deallocate(r.allocate(nbytes, sid))
            by_stream[sid] = nbytes
        return by_stream

    def test_reap_pending_recovers_unsynced_streams_when_sync_fails(
        self, driver: xa.Driver, pool: StreamPool
    ) -> None:
        r = AsyncCudaResource(driver, 0, pool)
        s1, s2 = self._pending_on(r, pool, [1024, 2048])
        assert r.pending_free_bytes() == 3072
        assert r.pending_per_stream_total() == 3072

        synced: list[StreamId] = []

        def sync(stream_id: StreamId) -> None:
            if stream_id == s2:
                raise DriverError(f"simulated sync failure on {stream_id!r}")
            synced.append(stream_id)

        with pytest.raises(DriverError, match="simulated"):
            r.reap_pending_with(sync)
        # Whatever the visiting order, only what was synchronized is released.
        expected = 3072 - (1024 if s1 in synced else 0)
        assert r.pending_free_bytes() == expected
        assert r.pending_per_stream_total() == expected
        assert r.bytes_outstanding() == r.live_bytes() + r.pending_free_bytes()

        # A second reap retries what was restored, and drains.
        r.reap_pending_with(lambda _: None)
        assert r.pending_free_bytes() == 0
        assert r.pending_per_stream_total() == 0

    def test_reap_pending_drains_normally_when_sync_always_succeeds(
        self, driver: xa.Driver, pool: StreamPool
    ) -> None:
        r = AsyncCudaResource(driver, 0, pool)
        self._pending_on(r, pool, [256, 512])
        r.reap_pending_with(lambda _: None)
        assert r.pending_free_bytes() == 0
        assert r.pending_per_stream_total() == 0
        assert r.bytes_outstanding() == 0

    def test_reap_failure_keeps_the_failed_and_unvisited_streams(
        self, driver: xa.Driver, pool: StreamPool
    ) -> None:
        """Fail the second stream visited: the first is released, the second and third stay
        pending, and the next reap visits exactly those two."""
        r = AsyncCudaResource(driver, 0, pool)
        sizes = self._pending_on(r, pool, [1024, 2048, 4096])
        total = sum(sizes.values())
        visited: list[StreamId] = []
        failure = DriverError("simulated sync failure", code="CUDA_ERROR_UNKNOWN")

        def sync(stream_id: StreamId) -> None:
            visited.append(stream_id)
            if len(visited) == 2:
                raise failure
            r.stream_pool.resolve(stream_id).synchronize()  # type: ignore[union-attr]  # the pool is open

        with pytest.raises(DriverError) as info:
            r.reap_pending_with(sync)
        assert info.value is failure, "the sync error propagates unchanged"
        assert len(visited) == 2, "reap went on after a failure"
        assert r.pending_free_bytes() == total - sizes[visited[0]]
        assert r.pending_per_stream_total() == r.pending_free_bytes()
        assert r.bytes_outstanding() == r.live_bytes() + r.pending_free_bytes()

        retried: list[StreamId] = []
        r.reap_pending_with(retried.append)
        assert set(retried) == set(sizes) - {visited[0]}
        assert r.pending_free_bytes() == 0 == r.pending_per_stream_total()
        assert r.bytes_outstanding() == 0

    def test_deallocate_racing_a_reap_stays_pending(
        self, driver: xa.Driver, pool: StreamPool
    ) -> None:
        """A free queued while a reap is synchronizing lands after the reap's drain: it is not
        released by that reap and not lost."""
        r = AsyncCudaResource(driver, 0, pool)
        self._pending_on(r, pool, [1024])
        late_sid = pool.acquire()
        late = r.allocate(512, late_sid)

        def sync(stream_id: StreamId) -> None:
            if r.live_bytes():
                r.deallocate(late)

        r.reap_pending_with(sync)
        assert r.live_bytes() == 0
        assert r.pending_free_bytes() == 512 == r.pending_per_stream_total()
        r.reap_pending()
        assert r.bytes_outstanding() == 0

    def test_pending_free_accounting(self, driver: xa.Driver, pool: StreamPool) -> None:
        r = AsyncCudaResource(driver, 0, pool)
        sids = [StreamId.DEFAULT, pool.acquire(), pool.acquire()]
        rng = random.Random(3)
        blocks = [r.allocate(rng.randint(1, 8192), rng.choice(sids)) for _ in range(30)]
        live = sum(b.nbytes for b in blocks)
        assert (r.live_bytes(), r.pending_free_bytes(), r.bytes_outstanding()) == (live, 0, live)
        pending = 0
        for b in blocks[:20]:
            r.deallocate(b)
            live -= b.nbytes
            pending += b.nbytes
            assert r.live_bytes() == live
            assert r.pending_free_bytes() == pending == r.pending_per_stream_total()
            assert r.bytes_outstanding() == live + pending
        r.reap_pending()
        assert r.pending_free_bytes() == 0 == r.pending_per_stream_total()
        assert r.bytes_outstanding() == r.live_bytes() == live
        for b in blocks[20:]:
            r.deallocate(b)
        assert r.pending_free_bytes() == live and r.live_bytes() == 0
        r.reap_pending()
        assert r.bytes_outstanding() == 0

    def test_failed_deallocate_changes_nothing(self) -> None:
        driver = xa.HostDriver(memory_per_device=16 * MiB)  # its own: the fault must not leak
        pool = StreamPool(driver, 0)
        try:
            r = AsyncCudaResource(driver, 0, pool)
            other = pool.acquire()
            block = r.allocate(4096)
            bid = BlockId.from_block(block)
            r.prepare_block_use(bid, other, Access.READ)
            r.finish_block_use(bid, other, Access.READ)
            before = (r.live_bytes(), r.pending_free_bytes(), r.pending_use_event_count(block.ptr))
            for after_calls in (0, 1):  # the wait on the read fails; then the free itself fails
                driver.inject_fault(0, "error", after_calls=after_calls)
                with pytest.raises(DriverError, match="injected"):
                    r.deallocate(block)
                assert (
                    r.live_bytes(),
                    r.pending_free_bytes(),
                    r.pending_use_event_count(block.ptr),
                ) == before
                assert driver.live_allocations(0) == 1
            r.deallocate(block)  # the retry succeeds
            r.reap_pending()
            assert r.bytes_outstanding() == 0
        finally:
            driver.close()

    def test_pointer_collision_leaves_the_map_unchanged(
        self, driver: xa.Driver, pool: StreamPool
    ) -> None:
        proxy = _CollidingAsyncDriver(driver)
        r = AsyncCudaResource(proxy, 0, pool)  # type: ignore[arg-type]  # a proxy driver, not a Driver subtype
        first = r.allocate(64)
        proxy.collide_next = first.ptr
        with pytest.raises(DriverError, match="collision"):
            r.allocate(128)
        assert r.live_bytes() == 64 and r.pending_free_bytes() == 0
        assert proxy.swallowed_frees == [first.ptr], "the colliding allocation was given back"
        r.deallocate(first)
        r.reap_pending()
        assert r.bytes_outstanding() == 0


class _CollidingAsyncDriver:
    """Forwards to a real driver, except that it can hand out a live address once more (and
    swallows the free of that phantom allocation)."""

    def __init__(self, real: xa.Driver) -> None:
        self._real = real
        self.collide_next: int | None = None
        self._phantom: int | None = None
        self.swallowed_frees: list[int] = []

    def alloc_async(self, nbytes: int, stream: Any) -> int:
        if self.collide_next is not None:
            self._phantom, self.collide_next = self.collide_next, None
            return self._phantom
        return self._real.alloc_async(nbytes, stream)

    def free_async(self, ptr: int, stream: Any) -> None:
        if ptr == self._phantom:
            self._phantom = None
            self.swallowed_frees.append(ptr)
            return
        self._real.free_async(ptr, stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def test_block_fields_are_stable(stack: Stack) -> None:
    sid = stack.pool.acquire()
    a = stack.res.allocate(100, sid, AllocTag("a"))
    b = stack.res.allocate(100, sid, AllocTag("b"))
    assert b.generation > a.generation
    assert (a.tag, b.tag) == ("a", "b") and a.alloc_stream == sid
    assert dataclasses.replace(a) == a
    for blk in (a, b):
        stack.res.deallocate(blk)
    stack.assert_drained()


# == StreamPool ==================================================================================
def test_stream_pool(driver: xa.Driver) -> None:
    pool = StreamPool(driver, 0)
    try:
        assert StreamPool.DEFAULT == StreamId.DEFAULT == 0
        default = pool.resolve(StreamId.DEFAULT)
        assert default is not None and default.ordinal == 0
        ids = [pool.acquire() for _ in range(5)]
        assert all(type(i) is StreamId for i in ids)
        assert len(set(ids)) == 5 and StreamId.DEFAULT not in ids
        streams = [pool.resolve(i) for i in ids]
        assert len({id(s) for s in streams}) == 5 and default not in streams, (
            "acquire gives a new stream"
        )
        assert pool.resolve(StreamId(10_000)) is None
        assert pool.resolve(ids[0]) is streams[0], "resolve is stable"
        # Streams of a pool run concurrently: a sleep on one does not hold another back.
        driver.sleep(streams[0], 200_000)  # type: ignore[arg-type]  # resolved, so not None
        done = streams[1].record_event()  # type: ignore[union-attr]  # resolved, so not None
        done.synchronize()
        assert not streams[0].query()  # type: ignore[union-attr]  # resolved, so not None
    finally:
        pool.close()
    pool.close()  # idempotent
    assert pool.resolve(StreamId.DEFAULT) is None
