# The compiled body of AsyncCudaResource; see async_core.pyx. Declared here so that the device
# context (context_core.pyx) calls its allocation and free in C.

from libc.stdint cimport uint64_t

from .ops cimport DriverOps
from .ptr_table cimport PtrTable
from .resource_core cimport ResourceCore


cdef class EventPool:
    cdef DriverOps _ops
    cdef list _free
    cdef dict _shares  # id(event) -> holders past the first, for events several blocks hold
    cdef readonly Py_ssize_t created
    cdef object take(self)
    cdef share(self, object event)
    cdef release(self, object event)


cdef class _Pending:
    cdef long long nbytes


cdef class _Entry:
    cdef object generation
    cdef long long nbytes
    cdef object stream
    cdef object tag
    cdef double created
    # Stream and event of the last write; None while the allocation is the only producer and its
    # fence has not been needed yet (it is recorded lazily on ``stream``).
    cdef object lw_stream
    cdef object lw_event
    # read events since the last write, at most one per stream; None when empty
    cdef dict reads


cdef class StreamsVersion:
    cdef public unsigned long long value


cdef class AsyncCore(ResourceCore):
    cdef object _stream_pool
    cdef object _streams
    cdef StreamsVersion _streams_version  # the pool's, or None (a pool without one)
    cdef EventPool _events
    cdef PtrTable _live  # address -> _Entry
    cdef long long _live_bytes
    cdef dict _pending  # stream id -> _Pending
    cdef long long _pending_bytes
    cdef object _alloc_c(self, object nbytes, object stream, object tag)
    cdef object _dealloc_c(self, object block)
    cdef object _stream_of(self, object sid)
    cdef _Entry _checked_entry(self, str owner, object block_id, object ptr, uint64_t* key)
    cdef object _resolve_use(self, str owner, object block_id, object use_stream)
    cdef object _recorded_event(self, object stream)
    cdef _prepare_locked(self, _Entry entry, object stream, object use_stream, object access)
    cdef object _finish_locked(self, _Entry entry, object stream, object use_stream, object access, object shared)
    cdef int use_blocks(self, list blocks, object use_stream, tuple accesses, bint finish) except -1
