# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled body of ``AsyncCudaResource``: stream-ordered allocation with cross-stream
dependency tracking, and the event pool it draws its events from.

The rules (the public face, :mod:`xlog_actors.memory.async_resource`, documents them for users):

* ``allocate(n, stream)`` is ordered on ``stream``; the block's first producer is the allocation
  itself, so a consumer on another stream waits for an *allocation-ready fence*, recorded lazily
  on the allocation stream the first time such a consumer prepares a use.
* Per block: ``last_write`` (stream and event of the most recent write, or of the allocation)
  and ``reads`` (at most one read event per stream since). ``prepare_block_use`` queues the
  minimal waits; ``finish_block_use`` records after the launch.
* ``deallocate`` validates ``(ptr, generation)`` first (the ABA guard), makes the allocation
  stream wait on every cross-stream event, then queues the free there. Any failure leaves the
  block live and every counter unchanged.
* ``bytes_outstanding() == live_bytes() + pending_free_bytes()``; a reap releases only what it
  synchronized.

**The lock.** One C-level lock (``lock.pxd``: an int taken by compare-and-swap) guards the live map, the per-block state, the
pending map and both counters, so they always move together. On the CUDA path no holder lets
the GIL go (the driver calls keep it, see ``ops.pyx``), so the lock is never contended there and
costs one atomic operation; it is kept because a garbage collection run inside a critical
section may run a finalizer's Python code, and because the host driver's calls are Python and
may switch threads. A contended acquire waits with the GIL released.

The module is over 400 lines for the reason the old pure-Python one was: allocation, free, reap
and the tracking hooks all move the same per-block entries under the same lock, and the rules
above are checkable only when read in one place.
"""

cimport cython
from cpython.dict cimport PyDict_GetItemWithError
from cpython.object cimport PyObject
from libc.stdint cimport uint64_t

from .blocks cimport BlockId, DeviceBlock, generation_of, new_block, next_generation, ordinal_of, ptr_of
from .history_ring cimport HISTORY_ALLOC, HISTORY_FREE
from .lock cimport lock_acquire, lock_release
from .ops cimport DriverOps, ops_for
from .ptr_table cimport PtrTable, key_of
from .resource_core cimport ResourceCore, block_clock, record_history

from ..driver.checks import check_device, check_nbytes, unknown_block, unknown_stream
from ..driver.limits import ALIGNMENT
from ..errors import DriverError
from .blocks import Access, AllocTag, BlockState, LiveBlock, StreamId

__all__ = ["AsyncCore", "EventPool", "StreamsVersion"]

cdef object _READ = Access.READ
cdef object _LIVE = BlockState.LIVE
cdef object _ALIGNMENT = ALIGNMENT
cdef object _DEFAULT_STREAM = StreamId.DEFAULT
cdef object _UNTAGGED = AllocTag.UNTAGGED


cdef class EventPool:
    """A free list of the events of one device context, so tracking a block use does not create
    and destroy an event each time (``cuEventCreate`` + destroy costs more than the record).

    An event may go back to the pool as soon as nobody will enqueue a *new* wait on it: waits
    already enqueued keep the record they saw, so re-recording is safe (CUDA semantics, and the
    host driver's). ``created`` counts the events the pool ever created.

    Thread rule: ``get`` and ``put`` are single list operations, atomic under the GIL, so any
    thread may call them; the owning resource calls them under its own lock anyway, which also
    keeps ``created`` exact.
    """

    def __init__(self, driver, ordinal):
        """An empty pool for device ``ordinal`` of ``driver``; events are created on demand.

        Args:
            driver: the driver that owns the device.
            ordinal: the device's ordinal.
        Thread rule: any thread.
        """
        self._ops = ops_for(driver, ordinal)
        self._free = []
        self._shares = {}
        self.created = 0

    cdef object take(self):
        if self._free:
            return self._free.pop()
        event = self._ops.create_event()
        self.created += 1  # after the driver call: a failed creation made no event
        return event

    def get(self):
        """An event from the free list, or a new one.

        Returns:
            An event nobody will enqueue a new wait on until its taker records it.
        Raises:
            DriverError: the driver could not create an event; ``created`` is unchanged.
        Thread rule: any thread.
        """
        return self.take()

    cdef share(self, object event):
        # One more holder of ``event``: several blocks' tracking may hold one event (the last
        # write, or the reads on a stream, of the blocks one graph replay used), recorded once.
        key = id(event)
        held = self._shares.get(key)
        self._shares[key] = 1 if held is None else held + 1

    cdef release(self, object event):
        # A holder lets ``event`` go: back to the free list when it was the last one (an event
        # re-recorded by its next taker while a block still waits on it would order too little).
        cdef object held
        if self._shares:
            key = id(event)
            held = self._shares.get(key)
            if held is not None:
                if held == 1:
                    del self._shares[key]
                else:
                    self._shares[key] = held - 1
                return
        self._free.append(event)

    def put(self, event):
        """Give ``event`` back for reuse.

        Args:
            event: an event of this pool that nobody will enqueue a new wait on.
        Thread rule: any thread.
        """
        self._free.append(event)


@cython.final
cdef class _Pending:
    """Bytes whose free is queued on one stream and not yet reaped: a C counter, so a free adds
    to it without making an ``int`` or storing one back into the map."""



# Allocation makes one entry and free drops it: a free list spares the memory allocator both.
@cython.freelist(64)
@cython.final
cdef class _Entry:
    """Tracking state of one live block."""



cdef class StreamsVersion:
    """A stream pool's version: a number in a C field that the pool changes whenever a stream it
    held leaves its map (``StreamPool.close``), so a fast path that found a stream in the map may
    keep it, borrowed, while the number is unchanged (the block cache's hit and free do). Never
    0 (0 means "nothing remembered"); never comes back to an earlier value.

    Thread rule: the pool writes ``value`` under its lock, with the GIL held; readers load it
    once, in C, with the GIL held.
    """

    def __init__(self):
        """Thread rule: any thread."""
        self.value = 1


def _by_generation(item):
    return (<_Entry>item[1]).generation


cdef class AsyncCore(ResourceCore):
    """The state and hot paths of ``AsyncCudaResource`` (see the module docstring).

    Thread rule: every method may be called from any thread at any time.
    """

    def __init__(self, driver, ordinal, stream_pool):
        """An empty resource on device ``ordinal`` of ``driver``, ordering its work on the
        streams of ``stream_pool`` (whose device the caller checked).

        Thread rule: any thread.
        """
        ResourceCore.__init__(self, driver, ordinal)
        self._stream_pool = stream_pool
        self._streams = stream_pool.streams
        version = getattr(stream_pool, "streams_version", None)
        self._streams_version = version if isinstance(version, StreamsVersion) else None
        self._events = EventPool(driver, ordinal)
        self._live = PtrTable()
        self._live_bytes = 0
        self._pending = {}
        self._pending_bytes = 0

    # -- properties and diagnostics ---------------------------------------------------------
    @property
    def stream_pool(self):
        """The stream pool the resource orders its work on. Thread rule: any thread."""
        return self._stream_pool

    def bytes_outstanding(self):
        """Live bytes plus bytes whose free is queued but not yet reaped.

        Returns:
            ``live_bytes() + pending_free_bytes()``, both read at one instant.
        Thread rule: any thread.
        """
        lock_acquire(&self._lock)
        total = self._live_bytes + self._pending_bytes
        lock_release(&self._lock)
        return total

    def live_bytes(self):
        """Bytes of the live blocks.

        Returns:
            The counter (one read; it may lag a concurrent call).
        Thread rule: any thread.
        """
        return self._live_bytes

    def pending_free_bytes(self):
        """Bytes whose free is queued but not yet reaped.

        Returns:
            The counter (one read; it may lag a concurrent call).
        Thread rule: any thread.
        """
        return self._pending_bytes

    def pending_per_stream_total(self):
        """The sum of the per-stream pending map (diagnostic: it equals ``pending_free_bytes()``
        whenever no reap is running).

        Returns:
            The sum, taken under the lock.
        Thread rule: any thread.
        """
        lock_acquire(&self._lock)
        try:
            return sum([(<_Pending>p).nbytes for p in self._pending.values()])
        finally:
            lock_release(&self._lock)

    def pending_use_event_count(self, ptr):
        """Events attached to the live block at ``ptr``.

        Args:
            ptr: the block's pointer.
        Returns:
            Its read events plus one for a recorded ``last_write``, or None when no block is live
            at ``ptr``; taken under the lock.
        Thread rule: any thread.
        """
        cdef _Entry entry
        cdef uint64_t key
        cdef PyObject* found
        if not key_of(ptr, &key):
            return None
        lock_acquire(&self._lock)
        try:
            found = self._live.find(key)
            if found == NULL:
                return None
            entry = <_Entry>found
            return (len(entry.reads) if entry.reads else 0) + (entry.lw_event is not None)
        finally:
            lock_release(&self._lock)

    def events_created(self):
        """How many driver events the pool ever created (diagnostic: reuse keeps it small).

        Returns:
            The count.
        Thread rule: any thread.
        """
        return self._events.created

    def live_blocks(self):
        """The live blocks, with their ages.

        Returns:
            One ``LiveBlock`` per live block, in allocation order, taken under the lock.
        Thread rule: any thread.
        """
        cdef _Entry e
        cdef double now = block_clock()
        lock_acquire(&self._lock)
        try:
            items = list(self._live.items())
        finally:
            lock_release(&self._lock)
        items.sort(key=_by_generation)  # generations grow with every allocation
        out = []
        for ptr, found in items:
            e = <_Entry>found
            out.append(LiveBlock(ptr, e.nbytes, e.tag, e.stream, now - e.created))
        return out

    # -- allocation -------------------------------------------------------------------------
    def allocate(self, nbytes, stream=_DEFAULT_STREAM, tag=_UNTAGGED):
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
        return self._alloc_c(nbytes, stream, tag)

    cdef object _alloc_c(self, object nbytes, object stream, object tag):
        # allocate's body, which the device context calls in C (see context_core.pyx)
        cdef _Entry entry
        cdef DeviceBlock block
        cdef bint collision
        cdef uint64_t key
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_nbytes(nbytes)
        cu_stream = self._stream_of(stream)
        if cu_stream is None:
            raise unknown_stream("AsyncCudaResource.allocate", self._ordinal, stream)
        ptr = self._ops.alloc_async(nbytes, cu_stream)
        generation = next_generation()
        entry = _Entry.__new__(_Entry)
        entry.generation = generation
        entry.nbytes = nbytes
        entry.stream = stream
        entry.tag = tag
        entry.created = block_clock()
        block = new_block(ptr, self._ordinal, stream, nbytes, _ALIGNMENT, tag, generation, _LIVE)
        if not key_of(ptr, &key):
            self._ops.free_async(ptr, cu_stream)
            raise DriverError(
                f"AsyncCudaResource on device {self._ordinal}: the driver returned {ptr!r}, no int address; "
                f"it was given back"
            )
        lock_acquire(&self._lock)
        try:
            # One probe: the entry goes in unless the pointer is live already.
            collision = not self._live.add(key, entry)
        except BaseException:
            # The map could not grow (MemoryError): it is as it was; so must the driver be.
            lock_release(&self._lock)
            self._ops.free_async(ptr, cu_stream)
            raise
        if not collision:
            self._live_bytes += entry.nbytes
        lock_release(&self._lock)
        if not collision:
            record_history(self, block, HISTORY_ALLOC)
            return block
        self._ops.free_async(ptr, cu_stream)
        raise DriverError(
            f"AsyncCudaResource on device {self._ordinal}: pointer collision on alloc "
            f"({ptr:#x} is already live); the new allocation was given back"
        )

    def deallocate(self, block):
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
        self._dealloc_c(block)

    cdef object _dealloc_c(self, object block):
        # deallocate's body, which the device context calls in C (see context_core.pyx)
        cdef _Entry entry
        cdef _Pending pending
        cdef PyObject* found
        cdef uint64_t key
        if ordinal_of(block) != self._ordinal:
            check_device("AsyncCudaResource.deallocate", self._ordinal, block)
        ptr = ptr_of(block)
        lock_acquire(&self._lock)
        try:
            entry = self._checked_entry("AsyncCudaResource.deallocate", block, ptr, &key)
            alloc_sid = entry.stream
            alloc_stream = self._stream_of(alloc_sid)
            if alloc_stream is None:
                raise unknown_stream("AsyncCudaResource.deallocate", self._ordinal, alloc_sid)
            # Fence the free behind every cross-stream use. If a wait or the free fails, the
            # entry stays live and nothing is counted: the caller may retry. (Waits already
            # queued are harmless: they only order the stream after work that was enqueued.)
            lw_event = entry.lw_event
            if lw_event is not None and entry.lw_stream != alloc_sid:
                self._ops.wait(alloc_stream, lw_event)
            reads = entry.reads
            if reads:
                for sid, event in reads.items():
                    if sid != alloc_sid:
                        self._ops.wait(alloc_stream, event)
            self._ops.free_async(ptr, alloc_stream)
            self._live.remove_if(key, entry)
            self._live_bytes -= entry.nbytes
            found = PyDict_GetItemWithError(self._pending, alloc_sid)
            if found == NULL:
                pending = _Pending.__new__(_Pending)
                self._pending[alloc_sid] = pending
            else:
                pending = <_Pending>found
            pending.nbytes += entry.nbytes
            self._pending_bytes += entry.nbytes
            if lw_event is not None:
                self._events.release(lw_event)
            if reads:
                for event in reads.values():
                    self._events.release(event)
        finally:
            lock_release(&self._lock)
        record_history(self, block, HISTORY_FREE)

    # -- reaping ----------------------------------------------------------------------------
    def reap_pending(self):
        """Synchronize every stream with queued frees and stop counting what was synchronized.

        Raises:
            DriverError: a synchronization failed; that stream and every one not yet visited stay
                pending for the next reap.
        Thread rule: any thread; the synchronizations run outside the lock, so allocations and
        frees on other threads go on meanwhile.
        """
        pool = self._stream_pool

        def sync(stream_id):
            stream = pool.resolve(stream_id)
            # A stream the pool no longer knows was closed, which waited for its queue: its
            # frees ran.
            if stream is not None:
                stream.synchronize()

        self.reap_pending_with(sync)

    def reap_pending_with(self, sync_stream):
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
        cdef long long synced = 0
        cdef Py_ssize_t failed_at, i
        cdef _Pending pending
        cdef PyObject* found
        lock_acquire(&self._lock)
        drained = self._pending
        if not drained:
            lock_release(&self._lock)
            return
        self._pending = {}
        lock_release(&self._lock)
        items = list(drained.items())
        failed_at = len(items)
        error = None
        for i in range(len(items)):
            stream_id, counted = items[i]
            try:
                sync_stream(stream_id)
            except BaseException as exc:  # re-raised below once state is restored
                failed_at = i
                error = exc
                break
            synced += (<_Pending>counted).nbytes
        lock_acquire(&self._lock)
        for stream_id, counted in items[failed_at:]:
            found = PyDict_GetItemWithError(self._pending, stream_id)
            if found == NULL:
                self._pending[stream_id] = counted  # nobody else holds the drained counter
            else:
                pending = <_Pending>found
                pending.nbytes += (<_Pending>counted).nbytes
        self._pending_bytes -= synced
        lock_release(&self._lock)
        if error is not None:
            raise error

    # -- block-use tracking -----------------------------------------------------------------
    cdef object _stream_of(self, object sid):
        # The pool's map is a dict (typed lookup); tests may give any mapping with ``get``.
        if type(self._streams) is dict:
            return (<dict>self._streams).get(sid)
        return self._streams.get(sid)

    cdef _Entry _checked_entry(self, str owner, object block_id, object ptr, uint64_t* key):
        # ``key`` receives the entry's table key, for a caller that removes it.
        cdef PyObject* found = NULL
        if key_of(ptr, key):
            found = self._live.find(key[0])
        if found == NULL:
            raise unknown_block(owner, self._ordinal, block_id, None)
        entry = <_Entry>found
        generation = generation_of(block_id)
        if entry.generation is not generation and entry.generation != generation:
            raise unknown_block(owner, self._ordinal, block_id, int(entry.generation))
        return entry

    cdef object _resolve_use(self, str owner, object block_id, object use_stream):
        if ordinal_of(block_id) != self._ordinal:
            check_device(owner, self._ordinal, block_id)
        stream = self._stream_of(use_stream)
        if stream is None:
            raise unknown_stream(owner, self._ordinal, use_stream)
        return stream

    cdef object _recorded_event(self, object stream):
        """An event from the pool, recorded on ``stream``. Call under the lock. A failed record
        puts the event back (nobody waits on it) and raises."""
        event = self._events.take()
        try:
            self._ops.record(event, stream)
        except BaseException:
            self._events._free.append(event)
            raise
        return event

    def prepare_block_use(self, block_id, use_stream, access):
        """Queue on ``use_stream`` the waits it needs before work with ``access`` on the block.

        Call before enqueueing that work. The first cross-stream use records the block's
        allocation-ready fence on its allocation stream.

        Args:
            block_id: a live block of this resource (a ``BlockId`` or the block itself).
            use_stream: the stream the work goes on.
            access: how the work uses the block (a write also waits for every read).
        Raises:
            InvalidRequest: the block is of another device.
            UseAfterFree: the block is not live.
            StreamMisuse: ``use_stream`` (or the allocation stream) is not a stream of the pool.
            DriverError: a record or wait failed; the block's state is as it was.
        Thread rule: any thread; everything runs under the lock (the driver calls only enqueue).
        """
        cdef uint64_t key
        stream = self._resolve_use("AsyncCudaResource.prepare_block_use", block_id, use_stream)
        ptr = ptr_of(block_id)
        lock_acquire(&self._lock)
        try:
            self._prepare_locked(self._checked_entry("AsyncCudaResource.prepare_block_use", block_id, ptr, &key),
                                 stream, use_stream, access)
        finally:
            lock_release(&self._lock)

    cdef _prepare_locked(self, _Entry entry, object stream, object use_stream, object access):
        if entry.lw_event is None:
            if entry.stream != use_stream:
                # First cross-stream consumer: materialize the allocation-ready fence.
                alloc_stream = self._stream_of(entry.stream)
                if alloc_stream is None:
                    raise unknown_stream("AsyncCudaResource.prepare_block_use", self._ordinal, entry.stream)
                event = self._recorded_event(alloc_stream)
                try:
                    self._ops.wait(stream, event)
                except BaseException:
                    # Nobody waits on it: back to the pool, and the block stays as it was.
                    self._events._free.append(event)
                    raise
                entry.lw_stream = entry.stream
                entry.lw_event = event
        elif entry.lw_stream != use_stream:
            self._ops.wait(stream, entry.lw_event)
        if access is not _READ and entry.reads:
            for sid, event in entry.reads.items():
                if sid != use_stream:
                    self._ops.wait(stream, event)

    cdef int use_blocks(self, list blocks, object use_stream, tuple accesses, bint finish) except -1:
        """``prepare_block_use`` (``finish`` False) or ``finish_block_use`` (True) of every block
        of ``blocks`` with the access at the same index, in order, for work on ``use_stream``:
        the stream resolved once and the lock taken once, for a caller that tracks several
        blocks at a time (a graph's replay); the finish records one event for all of them
        (``_finish_locked``). The errors are the single calls'; on one, the
        blocks before it are done and the rest untouched, as a loop of single calls leaves them.
        Thread rule: any thread; everything runs under the lock."""
        cdef uint64_t key
        cdef Py_ssize_t i, n = len(blocks)
        cdef str owner = ("AsyncCudaResource.finish_block_use" if finish
                          else "AsyncCudaResource.prepare_block_use")
        if n == 0:
            return 0
        stream = self._resolve_use(owner, blocks[0], use_stream)
        for i in range(1, n):
            if ordinal_of(blocks[i]) != self._ordinal:
                check_device(owner, self._ordinal, blocks[i])
        shared = None  # the one event the finish records for all the blocks (_finish_locked)
        lock_acquire(&self._lock)
        try:
            for i in range(n):
                block = blocks[i]
                entry = self._checked_entry(owner, block, ptr_of(block), &key)
                if finish:
                    shared = self._finish_locked(entry, stream, use_stream, accesses[i], shared)
                else:
                    self._prepare_locked(entry, stream, use_stream, accesses[i])
        finally:
            lock_release(&self._lock)
        return 0

    def finish_block_use(self, block_id, use_stream, access):
        """Record, after work with ``access`` on the block was enqueued on ``use_stream``, what
        later users and the free must wait for.

        Args:
            block_id: a live block of this resource (a ``BlockId`` or the block itself).
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
        cdef uint64_t key
        stream = self._resolve_use("AsyncCudaResource.finish_block_use", block_id, use_stream)
        ptr = ptr_of(block_id)
        lock_acquire(&self._lock)
        try:
            self._finish_locked(self._checked_entry("AsyncCudaResource.finish_block_use", block_id, ptr, &key),
                                stream, use_stream, access, None)
        finally:
            lock_release(&self._lock)

    cdef object _finish_locked(self, _Entry entry, object stream, object use_stream, object access, object shared):
        # What later users and the free of ``entry``'s block must wait for, after work with
        # ``access`` went on ``use_stream``; call under the lock. ``shared``: None for one block
        # (its own event is re-recorded in place, or a new one recorded), or the event this call
        # recorded already for other blocks of the same work (``use_blocks``: a graph's replay),
        # which the block then takes instead of recording its own: a replay records one event,
        # not one a block. Returns the call's event so far. An event re-recorded in place may be
        # held by blocks outside the call too: only ever for this same stream (an event is only
        # shared for the stream it is recorded on), so they wait for a later point of it, never
        # less.
        cdef EventPool events = self._events
        if access is _READ:
            if entry.lw_event is None and use_stream == entry.stream:
                # Still only on its own stream: the free is queued there, and the lazy fence a
                # later cross-stream user records there will cover this read too. No event.
                return shared
            reads = entry.reads
            if reads is None:
                reads = entry.reads = {}
            event = reads.get(use_stream)
            if event is not None and event is shared:
                return shared
            if shared is None:
                if event is not None:
                    self._ops.record(event, stream)  # same stream: the new record subsumes the old one
                    return event
                shared = self._recorded_event(stream)
                reads[use_stream] = shared
                return shared
            events.share(shared)
            reads[use_stream] = shared
            if event is not None:
                events.release(event)
            return shared
        old_event = entry.lw_event
        if old_event is None and use_stream == entry.stream:
            pass  # still only on its own stream: the lazy fence will cover this write too
        elif old_event is not None and entry.lw_stream == use_stream and (shared is None or old_event is shared):
            if shared is None:
                self._ops.record(old_event, stream)
                shared = old_event
        else:
            if shared is None:
                shared = self._recorded_event(stream)
            else:
                events.share(shared)
            entry.lw_event = shared
            entry.lw_stream = use_stream
            if old_event is not None:
                events.release(old_event)
        if entry.reads:
            for event in entry.reads.values():
                events.release(event)
            entry.reads = None
        return shared

    def record_block_use(self, block, use_stream):
        """``finish_block_use(block, use_stream, Access.READ)``.

        It queues no pre-launch wait, so it only protects the free, not a read after a
        cross-stream write: use ``prepare_block_use`` for that.

        Args and Raises: as :meth:`finish_block_use`.
        Thread rule: any thread.
        """
        self.finish_block_use(block, use_stream, _READ)

