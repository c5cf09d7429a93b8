# The compiled state of a GpuRef; see handles.pyx.
from cpython.object cimport PyObject


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
# ``cls``, ``generation``, ``state_ref``, ``token`` and ``cell`` (a TokenCell) borrowed: see the .pyx.
cdef HandleCore new_handle_with(PyObject* cls, object block, object context, PyObject* generation,
                                PyObject* state_ref, PyObject* token, PyObject* cell)

cdef TokenCell cell_of(object state)
