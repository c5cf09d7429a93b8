"""``AsyncCudaResource``: stream-ordered allocation with cross-stream dependency tracking.

The rules:

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

Two economies, because an event per allocation would double the allocator's cost:

* The allocation-ready fence is recorded lazily, on the allocation stream, the first time a
  consumer on another stream prepares a use. It then covers the allocation and whatever was
  queued on that stream since: never less than an eager fence, at times more. A block used only
  on its own stream never costs an event.
* Events come from an :class:`EventPool`; a block keeps at most one read event per stream
  (a later read on the same stream re-records it in place, which subsumes the earlier one).

Thread rules: one lock guards the live map, the per-block state, the pending map and both byte
counters, so they always move together. Waits and records are enqueued under it (they never
block the host); the stream-ordered allocation itself and every stream synchronization run
outside it.

The module is longer than most (about half of it docstrings): allocation, free, reap and the
tracking hooks all move the same per-block entries under the same lock, and the rules above are
checkable only when read in one place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..driver.checks import check_device, check_nbytes, unknown_block, unknown_stream
from ..driver.limits import ALIGNMENT
from ..driver.protocol import Driver, Event, Stream
from ..errors import DriverError, InvalidRequest
from .block import (
    Access,
    AllocTag,
    BlockId,
    DeviceBlock,
    Generation,
    LiveBlock,
    StreamId,
    generation_counter,
    make_block,
)
from .device_bound import DeviceBound
from .event_pool import EventPool
from .resource import DeviceMemoryResource
from .stream_pool import StreamPool

__all__ = ["AsyncCudaResource"]

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


class AsyncCudaResource(DeviceBound, DeviceMemoryResource):
    """Stream-ordered allocator with cross-stream tracking; see the module docstring for every
    rule and the lock.

    Thread rule: every method may be called from any thread at any time; each method's
    docstring says what it does under the lock.
    """

    def __init__(self, driver: Driver, ordinal: int, stream_pool: StreamPool) -> None:
        """An empty resource on device ``ordinal`` of ``driver``, ordering its work on the streams
        of ``stream_pool``.

        Args:
            driver: the driver that owns the device.
            ordinal: the device's ordinal.
            stream_pool: the device's stream pool; it must belong to the same device.
        Raises:
            InvalidRequest: ``stream_pool`` belongs to another device.
        Thread rule: any thread.
        """
        if stream_pool.device_ordinal != ordinal:
            raise InvalidRequest(
                f"AsyncCudaResource: stream pool of device {stream_pool.device_ordinal} given for device {ordinal}"
            )
        super().__init__(driver, ordinal)
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
    def stream_pool(self) -> StreamPool:
        """The stream pool the resource orders its work on. Thread rule: any thread."""
        return self._pool

    def bytes_outstanding(self) -> int:
        """Live bytes plus bytes whose free is queued but not yet reaped.

        Returns:
            ``live_bytes() + pending_free_bytes()``, both read under the lock at one instant.
        Thread rule: any thread.
        """
        with self._lock:
            return self._live_bytes + self._pending_bytes

    def live_bytes(self) -> int:
        """Bytes of the live blocks.

        Returns:
            The counter, read without the lock (one atomic read; it may lag a concurrent call).
        Thread rule: any thread.
        """
        return self._live_bytes

    def pending_free_bytes(self) -> int:
        """Bytes whose free is queued but not yet reaped.

        Returns:
            The counter, read without the lock (one atomic read; it may lag a concurrent call).
        Thread rule: any thread.
        """
        return self._pending_bytes

    def pending_per_stream_total(self) -> int:
        """The sum of the per-stream pending map (diagnostic: it equals ``pending_free_bytes()``
        whenever no reap is running).

        Returns:
            The sum, taken under the lock.
        Thread rule: any thread.
        """
        with self._lock:
            return sum(self._pending.values())

    def pending_use_event_count(self, ptr: int) -> int | None:
        """Events attached to the live block at ``ptr``.

        Args:
            ptr: the block's pointer.
        Returns:
            Its read events plus one for a recorded ``last_write``, or None when no block is live
            at ``ptr``; taken under the lock.
        Thread rule: any thread.
        """
        with self._lock:
            entry = self._live.get(ptr)
            if entry is None:
                return None
            return (len(entry.reads) if entry.reads else 0) + (entry.last_write is not None)

    def events_created(self) -> int:
        """How many driver events the pool ever created (diagnostic: reuse keeps it small).

        Returns:
            The count, read without the lock.
        Thread rule: any thread.
        """
        return self._events.created

    def live_blocks(self) -> list[LiveBlock]:
        """The live blocks, with their ages.

        Returns:
            One entry per live block, in allocation order, taken under the lock.
        Thread rule: any thread.
        """
        now = time.monotonic()
        with self._lock:
            return [LiveBlock(ptr, e.nbytes, e.tag, e.stream, now - e.created) for ptr, e in self._live.items()]

    def supports_block_use_tracking(self) -> bool:
        """True: the tracking hooks really track. Thread rule: any thread."""
        return True

    def describe(self) -> str:
        """``"async"``. Thread rule: any thread."""
        return "async"

    # -- allocation -------------------------------------------------------------------------
    def allocate(
        self, nbytes: int, stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED
    ) -> DeviceBlock:
        """Allocate ``nbytes`` ordered on ``stream``.

        Args:
            nbytes: a positive ``int``.
            stream: a stream of the pool; the block may be used on it at once, and its free is
                queued there.
            tag: what the allocation is for.
        Returns:
            A live block aligned to 256 bytes, with a new generation.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive ``int``.
            StreamMisuse: ``stream`` is not a stream of the pool.
            OutOfMemory: the driver cannot satisfy the request.
            DriverError: the driver failed, or handed out a pointer already live (then the new
                allocation was given back and nothing changed).
        Thread rule: any thread; the driver call runs outside the lock, the map update under it.
        """
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
        """Queue the free of ``block`` on its allocation stream, behind every cross-stream use.

        The block stops being live at once; its bytes count as pending until a reap.

        Args:
            block: a live block of this resource.
        Raises:
            InvalidRequest: ``block`` is of another device.
            UseAfterFree: no block with this ``(ptr, generation)`` is live (freed already, or
                never allocated here).
            StreamMisuse: the allocation stream was closed.
            DriverError: a wait or the free could not be queued; the block stays live and
                nothing is counted, so the caller may retry.
        Thread rule: any thread; everything runs under the lock (the driver calls only enqueue).
        """
        if block.device_ordinal != self._ordinal:
            check_device("AsyncCudaResource.deallocate", self._ordinal, block)
        with self._lock:
            entry = self._checked_entry("AsyncCudaResource.deallocate", block)
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
        """Synchronize every stream with queued frees and stop counting what was synchronized.

        Raises:
            DriverError: a synchronization failed; that stream and every one not yet visited stay
                pending for the next reap.
        Thread rule: any thread; the synchronizations run outside the lock, so allocations and
        frees on other threads go on meanwhile.
        """

        def sync(stream_id: StreamId) -> None:
            stream = self._pool.resolve(stream_id)
            # A stream the pool no longer knows was closed, which waited for its queue: its
            # frees ran.
            if stream is not None:
                stream.synchronize()

        self.reap_pending_with(sync)

    def reap_pending_with(self, sync_stream: Callable[[StreamId], None]) -> None:
        """Synchronize each stream with pending frees through ``sync_stream`` and stop counting
        what it synchronized.

        Args:
            sync_stream: called with each stream id that has pending frees; it returns once that
                stream's queued work is complete.
        Raises:
            BaseException: whatever ``sync_stream`` raised first; the failed stream and every
                stream not yet visited stay pending for the next reap.
        Thread rule: any thread; ``sync_stream`` is called outside the lock. Concurrent reaps
        each take the streams pending when they start, so no stream is counted off twice.
        """
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

    def _recorded_event(self, stream: Stream) -> Event:
        """An event from the pool, recorded on ``stream``. Call under the lock.

        A failed record puts the event back (nobody waits on it) and raises."""
        event = self._events.get()
        try:
            stream.record(event)
        except BaseException:
            self._events.put(event)
            raise
        return event

    def prepare_block_use(self, block_id: BlockId, use_stream: StreamId, access: Access) -> None:
        """Queue on ``use_stream`` the waits it needs before work with ``access`` on the block.

        Call before enqueueing that work. The first cross-stream use records the block's
        allocation-ready fence on its allocation stream.

        Args:
            block_id: a live block of this resource.
            use_stream: the stream the work goes on.
            access: how the work uses the block (a write also waits for every read).
        Raises:
            InvalidRequest: the block is of another device.
            UseAfterFree: the block is not live.
            StreamMisuse: ``use_stream`` (or the allocation stream) is not a stream of the pool.
            DriverError: a record or wait failed; the block's state is as it was.
        Thread rule: any thread; everything runs under the lock (the driver calls only enqueue).
        """
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
                    event = self._recorded_event(alloc_stream)
                    try:
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
        later users and the free must wait for.

        Args:
            block_id: a live block of this resource.
            use_stream: the stream the work went on.
            access: how the work used the block (a write replaces ``last_write`` and clears the
                reads).
        Raises:
            InvalidRequest: the block is of another device.
            UseAfterFree: the block is not live.
            StreamMisuse: ``use_stream`` is not a stream of the pool.
            DriverError: a record failed; the block's state is as it was.
        Thread rule: any thread; everything runs under the lock (the driver calls only enqueue).
        """
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
                reads[use_stream] = self._recorded_event(stream)
                return
            last_write = entry.last_write
            if last_write is None and use_stream == entry.stream:
                pass  # still only on its own stream: the lazy fence will cover this write too
            elif last_write is not None and last_write[0] == use_stream:
                stream.record(last_write[1])
            else:
                entry.last_write = (use_stream, self._recorded_event(stream))
                if last_write is not None:
                    self._events.put(last_write[1])
            reads = entry.reads
            if reads:
                for event in reads.values():
                    self._events.put(event)
                entry.reads = None

    def record_block_use(self, block: DeviceBlock, use_stream: StreamId) -> None:
        """``finish_block_use(BlockId.from_block(block), use_stream, Access.READ)``.

        It queues no pre-launch wait, so it only protects the free, not a read after a
        cross-stream write: use ``prepare_block_use`` for that.

        Args and Raises: as :meth:`finish_block_use`.
        Thread rule: any thread.
        """
        self.finish_block_use(BlockId.from_block(block), use_stream, _READ)
