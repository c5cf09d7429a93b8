# The compiled half of a device context; see context_core.pyx.
from cpython.object cimport PyObject
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
    cdef _bind_runtime(self)
    cdef object _alloc(self, object nbytes, object stream, object tag)
    cdef object _free(self, object block)
    cdef int _track(self, object block) except -1


cdef extern from *:
    """
    /* 1 when `ref`, a plain weak reference, still has its object, 0 when not; -1 when `ref` is
       no plain weak reference (the caller calls it). Up to CPython 3.12 the reference's field
       is read in place (the GET_OBJECT macro, no call); later through PyWeakref_GetObject. */
    static inline int xa_ref_alive(PyObject *ref) {
        if (!PyWeakref_CheckRef(ref)) return -1;
    #if PY_VERSION_HEX < 0x030D0000
        return PyWeakref_GET_OBJECT(ref) != Py_None;
    #else
        return PyWeakref_GetObject(ref) != Py_None;
    #endif
    }
    """
    int xa_ref_alive(PyObject* ref) noexcept


cdef extern from *:
    """
    /* The context's block cache's compiled release of `b` (not strict), through its vtable, with
       its result left to the caller: 1 freed, 0 not live there, -1 with the error set. */
    #define xa_context_cache_release(c, b) ((c)->_cache->__pyx_vtab->_release((c)->_cache, (b), 0))
    """
    int xa_context_cache_release(ContextCore c, PyObject* block) noexcept


cdef inline int context_release(ContextCore c, PyObject* block) noexcept:
    # ``c._free(block)`` for a context whose block cache answers for what is live (its table
    # empty: see the .pyx's docstring), inlined into the client's free, with no call of ``_free``
    # and no bool made: 1 freed, 0 not this context's, -1 with the error set; -2 where the cache
    # does not answer alone (no cache, or blocks in the table): the caller calls ``_free``.
    # ``block`` is borrowed from the caller, who holds it for the call.
    if not c.open:
        return 0
    if c._cache is None or c._blocks._used:
        return -2
    return xa_context_cache_release(c, block)


cdef inline int context_current(ContextCore c) except -1:
    # ``c.is_current()``, inlined into its callers (the client's fast paths check it two or three
    # times a call): open, the state's token unchanged, the state alive (its weak reference read
    # in C, with no call protocol).
    cdef int alive
    if not c.open or c._cell.token is not c.token:
        return 0
    alive = xa_ref_alive(<PyObject*>c.state_ref)
    if alive >= 0:
        return alive
    return c.state_ref() is not None
