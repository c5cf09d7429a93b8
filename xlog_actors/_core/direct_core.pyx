# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled body of ``DirectCudaResource``: one synchronous driver allocation per call.

One C-level lock (``ResourceCore``'s) guards the live map (a ``PtrTable``: address -> block) and
the byte counter; the driver is called outside it.
"""

from .blocks cimport DeviceBlock, new_block, next_generation
from .history_ring cimport HISTORY_ALLOC, HISTORY_FREE
from .lock cimport lock_acquire, lock_release
from .ptr_table cimport PtrTable, key_of
from libc.stdint cimport uint64_t
from cpython.object cimport PyObject
from .resource_core cimport ResourceCore, record_history

from ..driver.checks import check_device, check_nbytes, unknown_block
from ..driver.limits import ALIGNMENT
from ..errors import DriverError
from .blocks import AllocTag, BlockState, StreamId

__all__ = ["DirectCore"]

cdef object _LIVE = BlockState.LIVE
cdef object _ALIGNMENT = ALIGNMENT
cdef object _DEFAULT_STREAM = StreamId.DEFAULT
cdef object _UNTAGGED = AllocTag.UNTAGGED


cdef class DirectCore(ResourceCore):
    """The state and hot paths of ``DirectCudaResource``.

    Thread rule: every method may be called from any thread at any time.
    """

    cdef PtrTable _live
    cdef long long _bytes

    def __init__(self, driver, ordinal):
        """An empty resource on device ``ordinal`` of ``driver``.

        Args:
            driver: the driver that owns the device.
            ordinal: the device's ordinal (checked by the driver on the first allocation).
        Thread rule: any thread.
        """
        ResourceCore.__init__(self, driver, ordinal)
        self._live = PtrTable()
        self._bytes = 0

    def allocate(self, nbytes, stream=_DEFAULT_STREAM, tag=_UNTAGGED):
        """Allocate ``nbytes`` synchronously.

        Args:
            nbytes: a positive ``int``.
            stream: recorded on the block; orders nothing.
            tag: what the allocation is for.
        Returns:
            A live block aligned to 256 bytes, with a new generation.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive ``int``, or the ordinal is not a device
                of the driver.
            OutOfMemory: the driver cannot satisfy the request.
            DriverError: the driver failed, or handed out a pointer already live (then the new
                allocation was given back and the map is as it was).
        Thread rule: any thread; the driver call runs outside the lock.
        """
        cdef DeviceBlock block
        cdef bint collision
        cdef uint64_t key
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_nbytes(nbytes)
        ptr = self._ops.alloc(nbytes)
        if not key_of(ptr, &key):
            self._ops.free(ptr)
            raise DriverError(
                f"DirectCudaResource on device {self._ordinal}: the driver returned {ptr!r}, no int address; "
                f"it was given back"
            )
        block = new_block(ptr, self._ordinal, stream, nbytes, _ALIGNMENT, tag, next_generation(), _LIVE)
        lock_acquire(&self._lock)
        try:
            collision = not self._live.add(key, block)
        except BaseException:
            # The map could not grow (MemoryError): it is as it was; so must the driver be.
            lock_release(&self._lock)
            self._ops.free(ptr)
            raise
        if not collision:
            self._bytes += <long long>nbytes
        lock_release(&self._lock)
        if collision:
            # The driver handed out an address we believe is live: our map or the driver is
            # wrong. Give the new allocation back and leave the map as it was.
            self._ops.free(ptr)
            raise DriverError(
                f"DirectCudaResource on device {self._ordinal}: pointer collision on alloc ({ptr:#x} is already live)"
            )
        record_history(self, block, HISTORY_ALLOC)
        return block

    def deallocate(self, block):
        """Free ``block`` synchronously (``cuMemFree`` waits for the device first).

        Args:
            block: a live block of this resource.
        Raises:
            InvalidRequest: ``block`` is of another device.
            UseAfterFree: no block with this ``(ptr, generation)`` is live.
            DriverError: the driver failed; the block stays live and counted.
        Thread rule: any thread; the block leaves the map under the lock before the driver is
        called outside it, so a concurrent second free of it is refused.
        """
        cdef DeviceBlock live
        cdef uint64_t key
        cdef PyObject* slot_value
        if type(block) is DeviceBlock and (<DeviceBlock>block).device_ordinal == self._ordinal:
            ptr = (<DeviceBlock>block).ptr
            generation = (<DeviceBlock>block).generation
        else:
            check_device("DirectCudaResource.deallocate", self._ordinal, block)
            ptr = block.ptr
            generation = block.generation
        lock_acquire(&self._lock)
        try:
            slot_value = self._live.find(key) if key_of(ptr, &key) else NULL
            found = <object>slot_value if slot_value != NULL else None
            if found is None or ((<DeviceBlock>found).generation is not generation
                                 and (<DeviceBlock>found).generation != generation):
                raise unknown_block(
                    "DirectCudaResource.deallocate",
                    self._ordinal,
                    block,
                    None if found is None else int((<DeviceBlock>found).generation),
                )
            live = <DeviceBlock>found
            self._live.remove_if(key, live)
            self._bytes -= <long long>live.nbytes
        finally:
            lock_release(&self._lock)
        try:
            self._ops.free(ptr)
        except BaseException:
            lock_acquire(&self._lock)
            try:
                self._live.insert(key, live)
                self._bytes += <long long>live.nbytes
            finally:
                lock_release(&self._lock)
            raise
        record_history(self, block, HISTORY_FREE)

    def bytes_outstanding(self):
        """Bytes of the live blocks (a free completes before ``deallocate`` returns, so nothing
        is pending).

        Returns:
            The counter (one read).
        Thread rule: any thread.
        """
        return self._bytes

    def live_blocks(self):
        """The live blocks as they were handed out (no ages: allocation times are not recorded).

        Returns:
            A new list, taken under the lock.
        Thread rule: any thread.
        """
        lock_acquire(&self._lock)
        try:
            return self._live.values()
        finally:
            lock_release(&self._lock)
