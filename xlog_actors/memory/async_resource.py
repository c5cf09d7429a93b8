"""``AsyncCudaResource``: stream-ordered allocation with cross-stream dependency tracking.

The seed's rules, all kept:

* ``allocate(n, stream)`` is ordered on ``stream`` (``cuMemAllocAsync``); the block's first
  producer is the allocation itself, so a consumer on another stream waits for an
  *allocation-ready fence* before touching the bytes.
* Per block: ``last_write`` (the stream and event of the most recent write, or of the allocation)
  and ``reads`` (the read events recorded since). ``prepare_block_use`` queues the minimal waits
  before a launch: a read waits on ``last_write``; a write waits on ``last_write`` and on every
  read; waits on the using stream itself are skipped. ``finish_block_use`` records after the
  launch: a write replaces ``last_write`` and clears the reads (its prepare already waited on
  them), a read is added. ``record_block_use`` is finish-with-READ.
* ``deallocate`` validates ``(ptr, generation)`` first (the ABA guard), makes the allocation
  stream wait on every cross-stream event, then queues the free there. Any failure leaves the
  block live and every counter unchanged.
* ``bytes_outstanding() == live_bytes() + pending_free_bytes()``: a queued free counts until
  ``reap_pending`` synchronized its stream; a reap releases only what it synchronized and keeps
  failed and unvisited streams for the next reap.

Beyond the seed, for cost (see DESIGN.md: an event per allocation doubles the allocator's cost):

* The allocation-ready fence is recorded lazily, on the allocation stream, the first time a
  consumer on another stream prepares a use. It then covers the allocation and whatever was
  queued on that stream since: never less than the seed's fence, at times more. A block used only
  on its own stream never costs an event.
* Events come from an :class:`EventPool`; a block keeps at most one read event per stream
  (a later read on the same stream re-records it in place, which subsumes the earlier one).

Thread rules: one lock guards the live map, the per-block state, the pending map and both byte
counters, so they always move together. Waits and records are enqueued under it (they never
block the host); the stream-ordered allocation itself runs outside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..driver.checks import check_device, check_nbytes, unknown_block, unknown_stream
from ..driver.limits import ALIGNMENT
from ..driver.protocol import Driver, Event, Stream
from ..errors import DriverError
from .block import (
    Access,
    AllocTag,
    BlockId,
    DeviceBlock,
    Generation,
    StreamId,
    generation_counter,
    make_block,
)
from .event_pool import EventPool
from .resource import DeviceMemoryResource
from .stream_pool import StreamPool

__all__ = ["AsyncCudaResource", "LiveBlockInfo"]

_READ = Access.READ


class _Entry:
    """Tracking state of one live block."""

    __slots__ = ("created", "generation", "last_write", "nbytes", "reads", "stream", "tag")

    def __init__(self, generation: Generation, nbytes: int, stream: StreamId, tag: AllocTag) -> None:
        self.generation = generation
        self.nbytes = nbytes
        self.stream = stream
        self.tag = tag
        self.created = time.monotonic()
        # (stream, event) of the last write; None while the allocation is the only producer and
        # its fence has not been needed yet (it is recorded lazily on ``stream``).
        self.last_write: tuple[StreamId, Event] | None = None
        # read events since last_write, at most one per stream
        self.reads: dict[StreamId, Event] | None = None


class LiveBlockInfo(tuple[int, int, AllocTag, StreamId, float]):
    """``(ptr, nbytes, tag, stream, age_s)`` of one live block, for memory reports."""

    __slots__ = ()

    @property
    def ptr(self) -> int:
        return self[0]

    @property
    def nbytes(self) -> int:
        return self[1]

    @property
    def tag(self) -> AllocTag:
        return self[2]

    @property
    def stream(self) -> StreamId:
        return self[3]

    @property
    def age_s(self) -> float:
        return self[4]


class AsyncCudaResource(DeviceMemoryResource):
    """Stream-ordered allocator with tracking; see the module docstring for every rule."""

    def __init__(self, driver: Driver, ordinal: int, stream_pool: StreamPool) -> None:
        if stream_pool.device_ordinal != ordinal:
            from ..errors import InvalidRequest

            raise InvalidRequest(
                f"AsyncCudaResource: stream pool of device {stream_pool.device_ordinal} given for device {ordinal}"
            )
        self._driver = driver
        self._ordinal = ordinal
        self._pool = stream_pool
        self._streams = stream_pool.streams
        self._events = EventPool(driver, ordinal)
        self._lock = threading.Lock()
        self._live: dict[int, _Entry] = {}
        self._live_bytes = 0
        self._pending: dict[StreamId, int] = {}
        self._pending_bytes = 0

    # -- properties and diagnostics ---------------------------------------------------------
    @property
    def device_ordinal(self) -> int:
        return self._ordinal

    @property
    def driver(self) -> Driver:
        return self._driver

    @property
    def stream_pool(self) -> StreamPool:
        return self._pool

    def bytes_outstanding(self) -> int:
        with self._lock:
            return self._live_bytes + self._pending_bytes

    def live_bytes(self) -> int:
        return self._live_bytes

    def pending_free_bytes(self) -> int:
        return self._pending_bytes

    def pending_per_stream_total(self) -> int:
        with self._lock:
            return sum(self._pending.values())

    def pending_use_event_count(self, ptr: int) -> int | None:
        """Events attached to the live block at ``ptr`` (its reads, plus one for a recorded
        ``last_write``), or None when no block is live there."""
        with self._lock:
            entry = self._live.get(ptr)
            if entry is None:
                return None
            return (len(entry.reads) if entry.reads else 0) + (entry.last_write is not None)

    def events_created(self) -> int:
        """How many driver events the pool ever created (diagnostic: reuse keeps it small)."""
        return self._events.created

    def live_blocks(self) -> list[LiveBlockInfo]:
        now = time.monotonic()
        with self._lock:
            return [
                LiveBlockInfo((ptr, e.nbytes, e.tag, e.stream, now - e.created))
                for ptr, e in self._live.items()
            ]

    def supports_block_use_tracking(self) -> bool:
        return True

    def describe(self) -> str:
        return "async"

    # -- allocation -------------------------------------------------------------------------
    def allocate(
        self, nbytes: int, stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED
    ) -> DeviceBlock:
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_nbytes(nbytes)
        cu_stream = self._streams.get(stream)
        if cu_stream is None:
            raise unknown_stream("AsyncCudaResource.allocate", self._ordinal, stream)
        ptr = self._driver.alloc_async(nbytes, cu_stream)
        generation = Generation(next(generation_counter))
        entry = _Entry(generation, nbytes, stream, tag)
        with self._lock:
            live = self._live
            if ptr not in live:
                live[ptr] = entry
                self._live_bytes += nbytes
                return make_block(ptr, self._ordinal, stream, nbytes, ALIGNMENT, tag, generation)
        self._driver.free_async(ptr, cu_stream)
        raise DriverError(
            f"AsyncCudaResource on device {self._ordinal}: pointer collision on alloc "
            f"({ptr:#x} is already live); the new allocation was given back"
        )

    def deallocate(self, block: DeviceBlock) -> None:
        if block.device_ordinal != self._ordinal:
            check_device("AsyncCudaResource.deallocate", self._ordinal, block)
        with self._lock:
            entry = self._live.get(block.ptr)
            if entry is None or entry.generation != block.generation:
                raise unknown_block(
                    "AsyncCudaResource.deallocate",
                    self._ordinal,
                    block,
                    None if entry is None else int(entry.generation),
                )
            alloc_sid = entry.stream
            alloc_stream = self._streams.get(alloc_sid)
            if alloc_stream is None:
                raise unknown_stream("AsyncCudaResource.deallocate", self._ordinal, alloc_sid)
            # Fence the free behind every cross-stream use. If a wait or the free fails, the
            # entry stays live and nothing is counted: the caller may retry. (Waits already
            # queued are harmless: they only order the stream after work that was enqueued.)
            last_write = entry.last_write
            if last_write is not None and last_write[0] != alloc_sid:
                alloc_stream.wait(last_write[1])
            reads = entry.reads
            if reads:
                for sid, event in reads.items():
                    if sid != alloc_sid:
                        alloc_stream.wait(event)
            self._driver.free_async(block.ptr, alloc_stream)
            del self._live[block.ptr]
            nbytes = entry.nbytes
            self._live_bytes -= nbytes
            pending = self._pending
            pending[alloc_sid] = pending.get(alloc_sid, 0) + nbytes
            self._pending_bytes += nbytes
            if last_write is not None:
                self._events.put(last_write[1])
            if reads:
                for event in reads.values():
                    self._events.put(event)

    # -- reaping ----------------------------------------------------------------------------
    def reap_pending(self) -> None:
        def sync(stream_id: StreamId) -> None:
            stream = self._pool.resolve(stream_id)
            # A stream the pool no longer knows was closed, which waited for its queue: its
            # frees ran.
            if stream is not None:
                stream.synchronize()

        self.reap_pending_with(sync)

    def reap_pending_with(self, sync_stream: Callable[[StreamId], None]) -> None:
        """Synchronize each stream with pending frees through ``sync_stream`` and stop counting
        what it synchronized. On the first failure, the failed stream and every stream not yet
        visited stay pending for the next reap, and the error propagates."""
        with self._lock:
            drained = self._pending
            if not drained:
                return
            self._pending = {}
        items = list(drained.items())
        synced = 0
        failed_at = len(items)
        error: BaseException | None = None
        for i, (stream_id, nbytes) in enumerate(items):
            try:
                sync_stream(stream_id)
            except BaseException as exc:  # noqa: BLE001 - re-raised below once state is restored
                failed_at = i
                error = exc
                break
            synced += nbytes
        with self._lock:
            for stream_id, nbytes in items[failed_at:]:
                self._pending[stream_id] = self._pending.get(stream_id, 0) + nbytes
            self._pending_bytes -= synced
        if error is not None:
            raise error

    # -- block-use tracking -----------------------------------------------------------------
    def _checked_entry(self, owner: str, block_id: BlockId | DeviceBlock) -> _Entry:
        entry = self._live.get(block_id.ptr)
        if entry is None or entry.generation != block_id.generation:
            raise unknown_block(owner, self._ordinal, block_id, None if entry is None else int(entry.generation))
        return entry

    def _resolve_use(self, owner: str, block_id: BlockId | DeviceBlock, use_stream: StreamId) -> Stream:
        if block_id.device_ordinal != self._ordinal:
            check_device(owner, self._ordinal, block_id)
        stream = self._streams.get(use_stream)
        if stream is None:
            raise unknown_stream(owner, self._ordinal, use_stream)
        return stream

    def prepare_block_use(self, block_id: BlockId, use_stream: StreamId, access: Access) -> None:
        """Queue on ``use_stream`` the waits it needs before work with ``access`` on the block.
        Call before enqueueing that work."""
        stream = self._resolve_use("AsyncCudaResource.prepare_block_use", block_id, use_stream)
        with self._lock:
            entry = self._checked_entry("AsyncCudaResource.prepare_block_use", block_id)
            last_write = entry.last_write
            if last_write is None:
                if entry.stream != use_stream:
                    # First cross-stream consumer: materialize the allocation-ready fence.
                    alloc_stream = self._streams.get(entry.stream)
                    if alloc_stream is None:
                        raise unknown_stream("AsyncCudaResource.prepare_block_use", self._ordinal, entry.stream)
                    event = self._events.get()
                    try:
                        alloc_stream.record(event)
                        stream.wait(event)
                    except BaseException:
                        # Nobody waits on it: back to the pool, and the block stays as it was.
                        self._events.put(event)
                        raise
                    entry.last_write = (entry.stream, event)
            elif last_write[0] != use_stream:
                stream.wait(last_write[1])
            if access is not _READ and entry.reads:
                for sid, event in entry.reads.items():
                    if sid != use_stream:
                        stream.wait(event)

    def finish_block_use(self, block_id: BlockId, use_stream: StreamId, access: Access) -> None:
        """Record, after work with ``access`` on the block was enqueued on ``use_stream``, what
        later users and the free must wait for."""
        stream = self._resolve_use("AsyncCudaResource.finish_block_use", block_id, use_stream)
        with self._lock:
            entry = self._checked_entry("AsyncCudaResource.finish_block_use", block_id)
            if access is _READ:
                if entry.last_write is None and use_stream == entry.stream:
                    # Still only on its own stream: the free is queued there, and the lazy fence a
                    # later cross-stream user records there will cover this read too. No event.
                    return
                reads = entry.reads
                if reads is None:
                    reads = entry.reads = {}
                event = reads.get(use_stream)
                if event is not None:
                    stream.record(event)  # same stream: the new record subsumes the old one
                    return
                event = self._events.get()
                try:
                    stream.record(event)
                except BaseException:
                    self._events.put(event)
                    raise
                reads[use_stream] = event
                return
            last_write = entry.last_write
            if last_write is None and use_stream == entry.stream:
                pass  # still only on its own stream: the lazy fence will cover this write too
            elif last_write is not None and last_write[0] == use_stream:
                stream.record(last_write[1])
            else:
                event = self._events.get()
                try:
                    stream.record(event)
                except BaseException:
                    self._events.put(event)
                    raise
                entry.last_write = (use_stream, event)
                if last_write is not None:
                    self._events.put(last_write[1])
            reads = entry.reads
            if reads:
                for event in reads.values():
                    self._events.put(event)
                entry.reads = None

    def record_block_use(self, block: DeviceBlock, use_stream: StreamId) -> None:
        """The seed's older hook: finish-with-READ. It queues no pre-launch wait, so it only
        protects the free, not a read after a cross-stream write."""
        self.finish_block_use(BlockId.from_block(block), use_stream, _READ)
