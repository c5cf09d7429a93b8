# A map from device addresses to objects, in C; see ptr_table.pyx.

from libc.stdint cimport uint64_t
from cpython.object cimport PyObject


cdef struct PtrSlot:
    uint64_t key
    PyObject* value  # a strong reference; NULL: the slot is empty


cdef class PtrTable:
    cdef PtrSlot* _slots
    cdef Py_ssize_t _mask
    cdef int _shift
    cdef Py_ssize_t _used
    cdef PtrSlot* _slot(self, uint64_t key) noexcept
    cdef PyObject* find(self, uint64_t key) noexcept
    cdef int insert(self, uint64_t key, object value) except -1
    cdef int add(self, uint64_t key, object value) except -1
    cdef bint remove_if(self, uint64_t key, object expected) noexcept
    cdef int _grow(self) except -1


cdef bint key_of(object ptr, uint64_t* out) noexcept
