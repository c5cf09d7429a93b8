# The memory history's compiled record; see history_ring.pyx.

from libc.stdint cimport int32_t, int64_t, uint64_t

from cpython.object cimport PyObject


# Event.action: an allocation, a free, an allocation a block cache served from the blocks it
# keeps (live, as an allocation), a cached block given back to the cache's upstream (no live block)
cdef enum:
    HISTORY_ALLOC = 0
    HISTORY_FREE = 1
    HISTORY_CACHE_HIT = 2
    HISTORY_TRIM = 3


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


# the file-name cache's cells (see HistoryRing._skips)
cdef enum:
    _FILE_CACHE = 256


cdef class HistoryRing:
    cdef int _lock  # lock.pxd's; zeroed (free) when the object is made
    cdef Event* _ring
    cdef Py_ssize_t _cap
    cdef Py_ssize_t _head
    cdef Py_ssize_t _count
    cdef long long _recorded
    # live blocks: a slot per block, found through an open-addressing table of slot indices
    cdef Event* _slots
    cdef int32_t* _slot_next
    cdef Py_ssize_t _slot_cap
    cdef int32_t _slot_free
    cdef Py_ssize_t _live_count
    cdef int32_t* _live_tab
    cdef Py_ssize_t _live_tab_cap
    cdef Py_ssize_t _live_filled
    # interned stacks: id -> frames, key bytes and hash; an open-addressing table of ids
    cdef list _stacks
    cdef list _stack_keys
    cdef uint64_t* _stack_hashes
    cdef Py_ssize_t _stack_hash_cap
    cdef int32_t* _stack_tab
    cdef Py_ssize_t _stack_tab_cap
    cdef dict _tag_ids
    cdef list _tags
    cdef object _last_tag
    cdef int32_t _last_tag_id
    cdef dict _note_ids
    cdef list _notes
    cdef readonly dict _origins
    cdef dict _skip_cache
    cdef object _is_runtime
    cdef int _max_frames
    cdef PyObject* _file_names[_FILE_CACHE]
    cdef char _file_skips[_FILE_CACHE]

    cdef int record(self, object block, int action) except -1
    cdef int _commit(self, Event* ev) except -1
    cdef void _push(self, Event* ev) noexcept
    cdef int32_t _take_slot(self) except -1
    cdef Py_ssize_t _find_live(self, uint64_t ptr, int32_t device) noexcept
    cdef void _insert_live(self, int32_t slot) noexcept
    cdef void _remove_live(self, Py_ssize_t cell) noexcept
    cdef int _rebuild_live(self, Py_ssize_t need) except -1
    cdef int32_t _find_stack(self, void** buf, Py_ssize_t n, uint64_t h) noexcept
    cdef int32_t _add_stack(self, void** buf, Py_ssize_t n, uint64_t h, tuple frames) except -1
    cdef void _place_stack(self, int32_t sid) noexcept
    cdef int _rebuild_stacks(self, Py_ssize_t need) except -1
    cdef int32_t _tag_id(self, object tag) except -1
    cdef int _skips(self, PyObject* code) except -1
    cdef int _skips_new(self, PyObject* name, Py_ssize_t i) except -1
    cdef Py_ssize_t _walk_fast(self, void** buf) except -1
    cdef Py_ssize_t _walk_frames(self, void** buf) except -1
    cdef void _copy_newest(self, Event* out, Py_ssize_t n) noexcept
