# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled half of ``DeviceContext``: the allocate and free bookkeeping that the device
actor and every ``DeviceClient`` share, per generation of a device's context.

**What is live.** A free is honoured only for a block handed out as a handle of this generation
and not yet freed, so that a free racing another one, or a dropped handle's reclaim after its
block went with a rebuild, frees nothing twice. Where the runtime is a block cache called in C
(``"async+cache"``), the cache's own table of the blocks it holds says it: it answers a free of a
block that is not live with "nothing freed" instead of an error (``CacheCore._release``), so an
allocate + free makes no table operation here (two were about 250 of the client's 1,800
instructions a cached pair). Otherwise ``_blocks`` maps the address of every live block to it: a
:class:`~xlog_actors._core.ptr_table.PtrTable` (a C hash table on the address; a dict cost about
850 instructions per allocate + free here, the table about 100). Its updates are single table
operations made with the GIL held and no Python code in between, so they need no lock: in
particular a free removes the entry only if it is still the block just freed (once
``deallocate`` returned, another thread may already hold the same address, stream-ordered reuse,
and a plain pop would drop *its* entry). :meth:`ContextCore.rebind_runtime` moves the cache's
live blocks into the table when the cache stops being called in C; blocks left in the table when
it starts being called again are looked up there first.

Dropped handles: ``reclaim`` queues the block of a handle whose last reference went (from any
thread, a garbage collector's included) and wakes the device actor only for a large block or a
full batch; the actor frees the queue (``drain_reclaims``) before every message it handles.

The runtime's ``allocate`` and ``deallocate`` are read once, when the context is built (an
attribute lookup and a bound-method fetch per call were about 350 of the 2,200 instructions this
layer added to an allocate + free); when they are an ``AsyncCore``'s own methods (the default
stack's top), the context calls their compiled bodies in C. Code that replaces them on the
runtime afterwards (tests, instrumentation) calls :meth:`ContextCore.rebind_runtime`.

Thread rule: ``allocate``/``free``/``is_current``/``reclaim`` may run on any thread;
``drain_reclaims`` on the device actor's thread only.
"""

from collections import deque


from libc.stdint cimport uint64_t
from cpython.object cimport PyObject

from .async_core cimport AsyncCore
from .cache_core cimport CacheCore
from .blocks cimport DeviceBlock
from .handles cimport cell_of, new_handle_with
from .ptr_table cimport PtrTable, key_of

from ..driver.checks import check_nbytes
from ..errors import CorruptionDetected, InvalidRequest, OutOfMemory

__all__ = ["RECLAIM_BATCH", "RECLAIM_WAKE_BYTES", "ContextCore"]

#: A dropped handle of at least this many bytes wakes its device actor at once.
RECLAIM_WAKE_BYTES = 1 << 20
#: This many dropped handles waiting wake the device actor.
RECLAIM_BATCH = 32



cdef Py_ssize_t _WAKE_BYTES = RECLAIM_WAKE_BYTES
cdef object _ASYNC_ALLOCATE = AsyncCore.allocate
cdef object _ASYNC_DEALLOCATE = AsyncCore.deallocate
cdef object _CACHE_ALLOCATE = CacheCore.allocate
cdef object _CACHE_DEALLOCATE = CacheCore.deallocate
cdef Py_ssize_t _BATCH = RECLAIM_BATCH


cdef bint _own(object bound, object owner, object method) except -1:
    # ``bound`` is the compiled class's ``method`` bound to ``owner``, not replaced: a Cython
    # function's bound method or a method descriptor's bound builtin, compared as such (the same
    # function and the same object).
    return getattr(bound, "__self__", None) is owner and bound == method.__get__(owner, type(owner))


cdef inline object _ptr(object block):
    # A resource's own block type read in C; any other block (an adaptor's) through Python.
    if type(block) is DeviceBlock:
        return (<DeviceBlock>block).ptr
    return block.ptr


cdef class ContextCore:
    """State and hot paths of a ``DeviceContext`` (the Python subclass in
    :mod:`xlog_actors.actors.device_context`, which documents the rest).

    Fields: ``runtime`` (the generation's runtime), ``generation``, ``state_ref`` (a weak
    reference to the device state), ``token`` (the state's token when the context was built),
    ``open``; the live blocks (see the module docstring, and :meth:`live_blocks`); and the handle
    class it builds.

    Thread rule: any thread.
    """

    def __init__(self, runtime, generation, state_ref, token, handle_type):
        """Args:
            runtime: the generation's runtime (its ``allocate``/``deallocate`` are used).
            generation: the generation number.
            state_ref: a weak reference to the device state.
            token: the state's token now.
            handle_type: the ``GpuRef`` class (a subclass of ``HandleCore``).
        Thread rule: the device actor's thread.
        """
        self.runtime = runtime
        self._bind_runtime()
        self.generation = generation
        self.state_ref = state_ref
        self.token = token
        self._cell = cell_of(state_ref())
        self._blocks = PtrTable()
        self.open = True
        self._handle_type = handle_type
        self.reclaims = deque()
        self.wake_pending = False

    def rebind_runtime(self):
        """Read the runtime's ``allocate`` and ``deallocate`` again, after something replaced
        them on the runtime (they are read once, when the context is built). Thread rule: any
        thread, while no allocation or free of this context runs."""
        self._bind_runtime()

    cdef _bind_runtime(self):
        cdef CacheCore was = self._cache
        allocate, deallocate = self.runtime.allocate, self.runtime.deallocate
        self._allocate = allocate
        self._deallocate = deallocate
        # The stream-ordered resource's own methods, unreplaced: called in C, without the call
        # protocol (about 400 instructions per allocate + free).
        owner = getattr(allocate, "__self__", None)
        if (isinstance(owner, AsyncCore) and _own(allocate, owner, _ASYNC_ALLOCATE)
                and _own(deallocate, owner, _ASYNC_DEALLOCATE)):
            self._async = <AsyncCore>owner
        else:
            self._async = None
        # A block cache on top (``"async+cache"``), likewise.
        if (isinstance(owner, CacheCore) and _own(allocate, owner, _CACHE_ALLOCATE)
                and _own(deallocate, owner, _CACHE_DEALLOCATE)):
            self._cache = <CacheCore>owner
        else:
            self._cache = None
        if was is not None and self._cache is None:
            # The cache no longer answers for what is live: the table does, from here on.
            for block in was._live_list():
                self._track(block)

    @property
    def runtime_in_c(self):
        """True when allocation and free call the stream-ordered resource's (or a block cache's)
        compiled bodies directly (the runtime's ``allocate``/``deallocate`` are an ``AsyncCore``'s
        or a ``CacheCore``'s own, as read at construction or by :meth:`rebind_runtime`). Thread
        rule: any thread."""
        return self._async is not None or self._cache is not None

    def is_current(self):
        """True while this is the device's usable context: open, and the state unchanged since
        it was built (no rebuild, shutdown or poisoning). Thread rule: any thread."""
        return context_current(self) == 1

    def allocate(self, nbytes, stream, tag):
        """Allocate one block of this generation and wrap it in a handle.

        Args:
            nbytes: a positive int.
            stream: the stream the allocation is ordered on.
            tag: what it is for.
        Returns:
            the handle.
        Raises:
            InvalidRequest, StreamMisuse: a bad argument.
            OutOfMemory: with the stack's figures added by ``_out_of_memory``.
        Thread rule: any thread.
        """
        try:
            return self._alloc(nbytes, stream, tag)
        except OutOfMemory as exc:
            raise self._out_of_memory(exc) from None

    cdef object _alloc(self, object nbytes, object stream, object tag):
        # An ``OutOfMemory`` leaves raw: the callers add the stack's figures (``_out_of_memory``),
        # so that the hot path enters no exception handler of its own.
        # The cache first (the client's usual stack): it answers for what is live itself. A
        # runtime is the cache's or the stream-ordered resource's, never both.
        if self._cache is not None:
            block = self._cache._alloc_c(nbytes, stream, tag)
        else:
            if self._async is not None:
                block = self._async._alloc_c(nbytes, stream, tag)
            else:
                block = self._allocate(nbytes, stream, tag)
            self._track(block)
        # The fields borrowed: fixed for the context's life, which the call is part of.
        return new_handle_with(<PyObject*>self._handle_type, block, self, <PyObject*>self.generation,
                               <PyObject*>self.state_ref, <PyObject*>self.token, <PyObject*>self._cell)

    cdef int _track(self, object block) except -1:
        cdef uint64_t key
        if not key_of(_ptr(block), &key):
            self._deallocate(block)
            raise InvalidRequest(
                f"device context of generation {self.generation}: the runtime handed out a block whose "
                f"ptr is no int address in [0, 2**64) ({_ptr(block)!r}); it was given back"
            )
        try:
            self._blocks.insert(key, block)
        except BaseException:
            # The table could not grow (MemoryError): give the block back, so nothing leaks.
            self._deallocate(block)
            raise
        return 0

    def allocate_many(self, sizes, stream, tag):
        """Allocate one block per size, all or none, and wrap each in a handle.

        Args:
            sizes: a list or tuple of positive ints (all checked before any allocation).
            stream: the stream the allocations are ordered on.
            tag: what they are for.
        Returns:
            one handle per size, in order.
        Raises:
            InvalidRequest: ``sizes`` is no list or tuple, or a size is no positive int.
            StreamMisuse, OutOfMemory (with the stack's figures): as :meth:`allocate`; blocks
                allocated before a failure are freed again.
        Thread rule: any thread.
        """
        if not isinstance(sizes, (list, tuple)):
            raise InvalidRequest(f"AllocateMany needs a list or tuple of sizes, got {type(sizes).__name__}")
        for size in sizes:
            if type(size) is not int or size <= 0:
                check_nbytes(size)
        allocate = self._allocate
        blocks = []
        try:
            for size in sizes:
                blocks.append(allocate(size, stream, tag))
        except BaseException as exc:
            deallocate = self._deallocate
            for block in blocks:
                deallocate(block)
            if isinstance(exc, OutOfMemory):
                raise self._out_of_memory(exc) from None
            raise
        handles = []
        cls, generation, state_ref, token = self._handle_type, self.generation, self.state_ref, self.token
        cell = self._cell
        i, n = 0, len(blocks)
        try:
            while i < n:
                block = blocks[i]
                if self._cache is None:
                    self._track(block)  # gives ``block`` back itself when it fails
                i += 1
                handles.append(new_handle_with(<PyObject*>cls, block, self, <PyObject*>generation,
                                               <PyObject*>state_ref, <PyObject*>token, <PyObject*>cell))
        except BaseException:
            # The handles made so far free their blocks as they go (on the raise); a block whose
            # handle could not be made went back through ``_unmade``, and one that failed to be
            # tracked was given back by ``_track``. Give back those not reached.
            if len(handles) == i:
                i += 1  # blocks[i] failed to be tracked
            deallocate = self._deallocate
            for block in blocks[i:]:
                deallocate(block)
            raise
        return handles

    def _unmade(self, block):
        """Take back ``block``, allocated for a handle that could not be made (no memory for
        it): freed as its handle's free would, so the failed allocation leaves nothing behind.
        ``new_handle_with`` calls it before the error goes on.

        Args:
            block: the block.
        Raises:
            what :meth:`free` raises.
        Thread rule: the thread that allocated ``block``.
        """
        self._free(block)

    def free(self, block):
        """Free ``block`` if it is still one of this context's.

        Args:
            block: the block to free.
        Returns:
            True when it was freed; False when it was not this context's (already freed, or
            the context is closed).
        Raises:
            CorruptionDetected: a guard found its canaries overwritten (freed all the same).
            ResourceError: the resource refused; the block stays this context's.
        Thread rule: any thread.
        """
        return self._free(block)

    cdef object _free(self, object block):
        cdef uint64_t key
        cdef PyObject* found = NULL
        if not self.open:
            return False
        # The table first (an empty one, the cache's case, is not hashed into); a block it does
        # not hold is the cache's to answer for, where there is one.
        if self._blocks._used and key_of(_ptr(block), &key):
            found = self._blocks.find(key)
        if found == NULL:
            return self._cache is not None and self._cache._release(block, False) == 1
        live = <object>found
        if live is not block and live.generation != block.generation:
            return False
        try:
            if self._async is not None:
                self._async._dealloc_c(block)
            elif self._cache is not None:
                self._cache._dealloc_c(block)
            else:
                self._deallocate(block)
        except CorruptionDetected:
            # Raised after the block was freed: it is no longer ours either way.
            self._blocks.remove_if(key, live)
            raise
        # Only after the resource took it back: a failed deallocate leaves the block ours. Only
        # our own entry (see the module docstring).
        self._blocks.remove_if(key, live)
        return True

    def live_count(self):
        """The number of blocks handed out as handles of this generation and not yet freed (0
        once the context is closed).

        Thread rule: any thread.
        """
        if not self.open:
            return 0
        if self._cache is not None:
            return self._cache._live_count()  # the table's leftovers are the cache's too
        return self._blocks._used

    def live_blocks(self):
        """The blocks handed out as handles of this generation and not yet freed, as a new list
        (in no particular order).

        Thread rule: any thread.
        """
        if self._cache is not None:
            return self._cache._live_list()
        return self._blocks.values()

    def forget_blocks(self):
        """Forget every live block without freeing it (the context is closing: they were freed,
        or went with the context). Thread rule: any thread."""
        self._blocks.clear()

    def reclaim(self, block, wake=False):
        """Hand the free of ``block`` to the owning actor (safe from any thread, GC included):
        queue it, and wake the actor (the subclass's ``_send_wake``) when it must.

        Frees are batched like a caching allocator's: the actor drains the queue before every
        message it handles and every ``GetStats``, so a small block waits at most for the
        device's next message, and a wake-up (which costs the actor a whole message) is sent only
        for a large block or a full batch. That bounds what waits to ``RECLAIM_BATCH`` blocks
        under ``RECLAIM_WAKE_BYTES`` each. ``drain_reclaims`` clears ``wake_pending`` *before* it
        empties the queue, so a block appended after that is either drained by it or sends a new
        wake-up.

        Args:
            block: the block whose last handle went away.
            wake: wake the actor now, whatever the block's size.
        Thread rule: any thread, a garbage collector's included.
        """
        if not self.open:
            return
        reclaims = self.reclaims
        reclaims.append(block)
        if not self.wake_pending and (wake or block.nbytes >= _WAKE_BYTES or len(reclaims) >= _BATCH):
            self.wake_pending = True
            self._send_wake(block)

    def drain_reclaims(self):
        """Free every block ``reclaim`` queued. A free that fails puts its block back at the
        head of the queue for the next drain and raises.

        Raises:
            CorruptionDetected: reported, not retried. ResourceError: the free failed.
        Thread rule: the device actor's thread, or an asker's thread that the actor's inbox lets
        serve an allocation while the actor is idle (``caller_inbox``): two drains at once each
        take distinct blocks (``popleft`` is atomic) and frees are thread-safe.
        """
        self.wake_pending = False
        reclaims = self.reclaims
        while reclaims:
            block = reclaims.popleft()
            try:
                self._free(block)
            except CorruptionDetected:
                raise  # freed all the same: reported, not retried
            except BaseException:
                reclaims.appendleft(block)
                raise
