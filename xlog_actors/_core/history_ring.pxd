# The memory history's compiled record; see history_ring.pyx.

from libc.stdint cimport int32_t, int64_t, uint64_t

from cpython.object cimport PyObject
from cpython.pythread cimport PyThread_type_lock


# Event.action
cdef enum:
    HISTORY_ALLOC = 0
    HISTORY_FREE = 1


cdef struct Event:
    int64_t time_ns
    int64_t nbytes
    int64_t stream
    int64_t generation
    uint64_t ptr
    int32_t device
    int32_t action
    int32_t tag_id
    int32_t stack_id
    int32_t note_id


cdef class HistoryRing:
    cdef PyThread_type_lock _lock
    cdef Event* _ring
    cdef Py_ssize_t _cap
    cdef Py_ssize_t _head
    cdef Py_ssize_t _count
    cdef long long _recorded
    cdef Event* _slots
    cdef int32_t* _slot_next
    cdef Py_ssize_t _slot_cap
    cdef int32_t _slot_free
    cdef Py_ssize_t _live_count
    cdef dict _live
    cdef dict _tag_ids
    cdef list _tags
    cdef dict _stack_ids
    cdef list _stacks
    cdef dict _note_ids
    cdef list _notes
    cdef readonly dict _origins
    cdef dict _skip_cache
    cdef object _is_runtime
    cdef int _max_frames
    cdef void** _walk

    cdef int record(self, object block, int action) except -1
    cdef void _push(self, Event* ev) noexcept
    cdef Py_ssize_t _take_slot(self) except -1
    cdef void _give_slot(self, Py_ssize_t slot) noexcept
    cdef int32_t _intern(self, dict ids, list values, object key, object value) except -1
    cdef int32_t _stack_here(self) except -1
    cdef bint _skips(self, PyObject* code) except -1
    cdef Py_ssize_t _walk_fast(self, void** buf) except -1
    cdef Py_ssize_t _walk_frames(self, void** buf) except -1
    cdef int32_t _intern_frames(self, tuple frames) except -1
    cdef void _copy_newest(self, Event* out, Py_ssize_t n) noexcept
