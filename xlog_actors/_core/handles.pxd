# The compiled state of a GpuRef; see handles.pyx.

cdef class TokenCell:
    cdef public object token


cdef class HandleCore:
    cdef readonly object _block
    cdef readonly object _generation
    cdef readonly object _state
    cdef object _token
    cdef TokenCell _cell
    cdef readonly object _context
    cdef readonly object _last_write
    cdef readonly bint _released
    cdef object __weakref__

cdef HandleCore new_handle(type cls, object block, object context)
cdef HandleCore new_handle_with(type cls, object block, object context, object generation, object state_ref,
                                object token, TokenCell cell)

cdef TokenCell cell_of(object state)
