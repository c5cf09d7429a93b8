# The compiled half of a device context; see context_core.pyx.
from .async_core cimport AsyncCore
from .cache_core cimport CacheCore
from .handles cimport TokenCell
from .ptr_table cimport PtrTable

cdef class ContextCore:
    cdef public object runtime
    cdef object _allocate
    cdef object _deallocate
    cdef AsyncCore _async  # the runtime's resource when its methods are called in C, else None
    cdef CacheCore _cache  # the same, for a block cache on top of the stack
    cdef public object generation
    cdef public object state_ref
    cdef public object token
    cdef TokenCell _cell
    cdef PtrTable _blocks  # the live blocks, where the cache does not say them (see the .pyx)
    cdef public bint open
    cdef type _handle_type
    cdef public object reclaims
    cdef public bint wake_pending
    cdef bint _current(self)
    cdef _bind_runtime(self)
    cdef object _alloc(self, object nbytes, object stream, object tag)
    cdef object _free(self, object block)
    cdef int _track(self, object block) except -1
