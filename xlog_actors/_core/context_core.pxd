# The compiled half of a device context; see context_core.pyx.
from .handles cimport TokenCell

cdef class ContextCore:
    cdef public object runtime
    cdef object _allocate
    cdef object _deallocate
    cdef public object generation
    cdef public object state_ref
    cdef public object token
    cdef TokenCell _cell
    cdef public dict blocks
    cdef public bint open
    cdef type _handle_type
    cdef public object reclaims
    cdef public bint wake_pending
    cdef bint _current(self)
    cdef object _alloc(self, object nbytes, object stream, object tag)
    cdef object _free(self, object block)
    cdef _drop(self, object ptr, object live)
