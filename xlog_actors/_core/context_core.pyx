# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled half of ``DeviceContext``: the allocate and free bookkeeping that the device
actor and every ``DeviceClient`` share, per generation of a device's context.

``blocks`` maps the address of every block handed out as a handle of this generation (and not
yet freed) to that block. Its updates are single dict operations made with the GIL held and no
Python code in between, so they need no lock: in particular ``_drop`` removes an entry only if
it is still the block just freed (once ``deallocate`` returned, another thread may already hold
the same address, stream-ordered reuse, and a plain pop would drop *its* entry).

Dropped handles: ``reclaim`` queues the block of a handle whose last reference went (from any
thread, a garbage collector's included) and wakes the device actor only for a large block or a
full batch; the actor frees the queue (``drain_reclaims``) before every message it handles.

The runtime's ``allocate`` and ``deallocate`` are read once, when the context is built (an
attribute lookup and a bound-method fetch per call were about 350 of the 2,200 instructions this
layer added to an allocate + free); code that replaces them on the runtime afterwards (tests,
instrumentation) calls :meth:`ContextCore.rebind_runtime`.

Thread rule: ``allocate``/``free``/``is_current``/``reclaim`` may run on any thread;
``drain_reclaims`` on the device actor's thread only.
"""

from collections import deque

from cpython.weakref cimport PyWeakref_CheckRef, PyWeakref_GetObject

from .blocks cimport DeviceBlock
from .handles cimport cell_of, new_handle_with

from ..driver.checks import check_nbytes
from ..errors import CorruptionDetected, InvalidRequest, OutOfMemory

__all__ = ["RECLAIM_BATCH", "RECLAIM_WAKE_BYTES", "ContextCore"]

#: A dropped handle of at least this many bytes wakes its device actor at once.
RECLAIM_WAKE_BYTES = 1 << 20
#: This many dropped handles waiting wake the device actor.
RECLAIM_BATCH = 32

cdef Py_ssize_t _WAKE_BYTES = RECLAIM_WAKE_BYTES
cdef Py_ssize_t _BATCH = RECLAIM_BATCH


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
    ``blocks`` (see the module docstring), ``open``; and the handle class it builds.

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
        self._allocate = runtime.allocate
        self._deallocate = runtime.deallocate
        self.generation = generation
        self.state_ref = state_ref
        self.token = token
        self._cell = cell_of(state_ref())
        self.blocks = {}
        self.open = True
        self._handle_type = handle_type
        self.reclaims = deque()
        self.wake_pending = False

    cdef bint _current(self):
        if not self.open:
            return False
        if self._cell.token is not self.token:
            return False
        if PyWeakref_CheckRef(self.state_ref):  # read in C, with no call protocol
            return <object>PyWeakref_GetObject(self.state_ref) is not None
        return self.state_ref() is not None

    def rebind_runtime(self):
        """Read the runtime's ``allocate`` and ``deallocate`` again, after something replaced
        them on the runtime (they are read once, when the context is built). Thread rule: any
        thread, while no allocation or free of this context runs."""
        self._allocate = self.runtime.allocate
        self._deallocate = self.runtime.deallocate

    def is_current(self):
        """True while this is the device's usable context: open, and the state unchanged since
        it was built (no rebuild, shutdown or poisoning). Thread rule: any thread."""
        return self._current()

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
        return self._alloc(nbytes, stream, tag)

    cdef object _alloc(self, object nbytes, object stream, object tag):
        try:
            block = self._allocate(nbytes, stream, tag)
        except OutOfMemory as exc:
            raise self._out_of_memory(exc) from None
        self.blocks[_ptr(block)] = block
        return new_handle_with(self._handle_type, block, self, self.generation, self.state_ref, self.token, self._cell)

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
        table = self.blocks
        handles = []
        cls, generation, state_ref, token = self._handle_type, self.generation, self.state_ref, self.token
        cell = self._cell
        for block in blocks:
            table[_ptr(block)] = block
            handles.append(new_handle_with(cls, block, self, generation, state_ref, token, cell))
        return handles

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
        ptr = _ptr(block)
        live = self.blocks.get(ptr)
        if live is None or not self.open:
            return False
        if live is not block and live.generation != block.generation:
            return False
        try:
            self._deallocate(block)
        except CorruptionDetected:
            # Raised after the block was freed: it is no longer ours either way.
            self._drop(ptr, live)
            raise
        # Only after the resource took it back: a failed deallocate leaves the block ours.
        self._drop(ptr, live)
        return True

    cdef _drop(self, object ptr, object live):
        # Only our own entry (see the module docstring).
        if self.blocks.get(ptr) is live:
            del self.blocks[ptr]

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
