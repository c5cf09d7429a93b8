# cython: language_level=3, boundscheck=False, wraparound=False
"""``HistoryRing``: the memory history's record, kept as C structs so that recording an event
builds no Python object on the common path; ``memory.MemoryHistory`` is its Python face.

One event is an ``Event`` struct (time, action, device, stream, size, address, generation and
three interned ids: tag, stack, note) in a bounded ring. Blocks still live are kept apart, one
struct per block in a slot array found through an open-addressing table keyed by (device,
address), so that a snapshot lists every live block even after its allocation left the ring.

The stack of an event is walked where it is recorded: on CPython 3.11 to 3.13 over the
interpreter's own frame records (``_PyInterpreterFrame``, read through the internal header of the
version built against, as profilers do), which materialises no frame object; elsewhere (3.10, 3.14
and later, whose layouts were not checked, or Python headers without the internal ones) through
``sys._getframe`` and ``f_back``. Frames whose
file the history's ``is_runtime`` says are the runtime's own are skipped (decided once per file
name: the history's dict, and a small table of file-name objects this ring holds references to),
and at most ``max_frames`` are kept. The kept (code object, instruction offset) pairs are interned:
their words (pointers and offsets), hashed in C, are looked up in an open-addressing table of stack
ids and compared with the stored key bytes; the tuple of pairs is built only the first time a
stack is seen. The stored tuples hold a strong reference to each code object their keys name, so no
stored key can match a new code object at a freed one's address. Tags are interned through a dict
behind a one-entry cache (the last tag seen), notes through a dict. Everything is resolved back to
objects only when the history is read (``entries``).

Invariants: ``0 <= count <= cap``; a slot is used (``slot_next == -2``) exactly while the live
table holds its index; interned ids only grow until ``clear``. No garbage-collected object is
allocated while the ring's lock is held (a collection could run a finaliser that frees a block and
records into this very ring, on this thread, and the lock is not re-entrant): what builds such
objects (a new stack's tuple, a new tag's id) runs between two holds of the lock.

The module is past 400 lines because the ring, the live-block table and the stack table share the
``Event`` layout and one lock with one rule (nothing that can collect garbage while it is held):
apart, each would have to export its internals to the others.

Thread rule: every method, any thread, any time; events from several threads are kept in the order
they took the lock. The file-name table is read and written outside the lock, under the GIL (no
Python code runs between its reads and writes).
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem, PyDict_SetItem, PyDict_Size
from cpython.list cimport PyList_GET_ITEM
from cpython.long cimport PyLong_AsLong, PyLong_FromSsize_t
from cpython.pythread cimport PyThread_get_thread_ident
from cpython.ref cimport Py_INCREF, Py_XDECREF, PyObject
from libc.stdint cimport int32_t, int64_t, intptr_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy
from posix.time cimport CLOCK_REALTIME, clock_gettime, timespec

from .blocks cimport DeviceBlock
from .lock cimport lock_acquire, lock_release

import sys

__all__ = ["FAST_FRAME_WALK", "HistoryRing"]

cdef extern from *:
    """
    #if defined(__has_include)
    #if __has_include("internal/pycore_frame.h")
    #define XL_HAS_FRAME_HEADER 1
    #endif
    #endif
    #if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000 && defined(XL_HAS_FRAME_HEADER)
    #define Py_BUILD_CORE 1
    #include "internal/pycore_frame.h"
    #undef Py_BUILD_CORE
    #define XL_FAST_FRAMES 1
    #if PY_VERSION_HEX >= 0x030D0000
    #define XL_CURRENT(ts) ((ts)->current_frame)
    #define XL_CODE(f) ((f)->f_executable)
    #else
    #define XL_CURRENT(ts) ((ts)->cframe->current_frame)
    #define XL_CODE(f) ((PyObject *)(f)->f_code)
    #endif
    /* the next frame that has begun to run Python code (as frame.f_back would give) */
    static inline _PyInterpreterFrame *xl_complete(_PyInterpreterFrame *f) {
        while (f != NULL && (!PyCode_Check(XL_CODE(f)) || _PyFrame_IsIncomplete(f))) f = f->previous;
        return f;
    }
    static inline void *xl_top(void) { return xl_complete(XL_CURRENT(PyThreadState_Get())); }
    static inline void *xl_back(void *c) { return xl_complete(((_PyInterpreterFrame *)c)->previous); }
    static inline PyObject *xl_code(void *c) { return XL_CODE((_PyInterpreterFrame *)c); }
    static inline intptr_t xl_lasti(void *c) {
        return (intptr_t)_PyInterpreterFrame_LASTI((_PyInterpreterFrame *)c) * (intptr_t)sizeof(_Py_CODEUNIT);
    }
    #else
    #define XL_FAST_FRAMES 0
    static inline void *xl_top(void) { return NULL; }
    static inline void *xl_back(void *c) { (void)c; return NULL; }
    static inline PyObject *xl_code(void *c) { (void)c; return NULL; }
    static inline intptr_t xl_lasti(void *c) { (void)c; return 0; }
    #endif
    static inline PyObject *xl_filename(PyObject *code) { return ((PyCodeObject *)code)->co_filename; }
    """
    bint XL_FAST_FRAMES
    void* xl_top()
    void* xl_back(void* cursor)
    PyObject* xl_code(void* cursor)
    intptr_t xl_lasti(void* cursor)
    PyObject* xl_filename(PyObject* code)

#: Whether stacks are walked over the interpreter's frame records (CPython 3.11 to 3.13) rather
#: than through frame objects.
FAST_FRAME_WALK = bool(XL_FAST_FRAMES)
cdef bint _fast_walk = XL_FAST_FRAMES

cdef enum:
    # the most frames a walk keeps in the caller's C stack; more are walked into a heap buffer
    _STACK_FRAMES = 64
    # table cells: no entry yet / an entry removed (the live table only)
    _EMPTY = -1
    _REMOVED = -2
    # a slot_next value: the slot holds a live block
    _USED = -2

cdef tuple _ACTIONS = ("alloc", "free", "cache_hit", "trim")
_getframe = sys._getframe


def _force_frame_objects(bint on):
    """Walk through frame objects even where the interpreter's records could be read (tests
    run both walks on one interpreter). Thread rule: any thread, between recordings."""
    global _fast_walk
    _fast_walk = XL_FAST_FRAMES and not on


cdef inline int64_t _now_ns() noexcept:
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline uint64_t _mix(uint64_t h, uint64_t word) noexcept:
    h ^= word
    h *= 0x9E3779B97F4A7C15ULL
    return h ^ (h >> 29)


cdef inline uint64_t _hash_words(void** words, Py_ssize_t n) noexcept:
    cdef uint64_t h = <uint64_t>n
    cdef Py_ssize_t i
    for i in range(n):
        h = _mix(h, <uint64_t><uintptr_t>words[i])
    return h


cdef inline uint64_t _live_hash(uint64_t ptr, int32_t device) noexcept:
    return _mix(_mix(<uint64_t>device, ptr >> 8), ptr)


cdef int32_t* _new_table(Py_ssize_t cap) except NULL:
    cdef int32_t* tab = <int32_t*>malloc(cap * sizeof(int32_t))
    cdef Py_ssize_t i
    if tab == NULL:
        raise MemoryError("HistoryRing: cannot grow a table")
    for i in range(cap):
        tab[i] = _EMPTY
    return tab



cdef class HistoryRing:
    """The compiled record under ``memory.MemoryHistory`` (see the module docstring).

    ``HistoryRing(max_entries, max_frames, skip_cache, is_runtime)``: ``skip_cache`` is a dict
    from file name to whether that file's frames are skipped, ``is_runtime(filename)`` decides
    (and fills the cache) for a file not in it yet.

    Thread rule: every method, any thread, any time.
    """

    def __cinit__(self, *args, **kwargs):
        self._slot_free = -1

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(_FILE_CACHE):
            Py_XDECREF(self._file_names[i])
        free(self._ring)
        free(self._slots)
        free(self._slot_next)
        free(self._live_tab)
        free(self._stack_tab)
        free(self._stack_hashes)

    def __init__(self, Py_ssize_t max_entries, int max_frames, dict skip_cache, object is_runtime):
        """
        Args:
            max_entries: the ring's bound (positive; the caller checked it).
            max_frames: the most frames kept per event (positive).
            skip_cache: file name -> whether its frames are the runtime's own.
            is_runtime: ``is_runtime(filename) -> bool`` for a file the cache lacks.
        Raises:
            ValueError: a bound is not positive, or the ring was initialised already.
            MemoryError: the ring cannot be allocated.
        Thread rule: any thread, once, before the ring is shared.
        """
        if max_entries <= 0 or max_frames <= 0 or self._ring != NULL:
            raise ValueError("HistoryRing: positive bounds, initialised once")
        self._ring = <Event*>malloc(max_entries * sizeof(Event))
        if self._ring == NULL:
            raise MemoryError(f"HistoryRing: cannot allocate {max_entries} events")
        self._cap = max_entries
        self._max_frames = max_frames
        self._skip_cache = skip_cache
        self._is_runtime = is_runtime
        self._origins = {}
        self.clear()

    # -- recording ----------------------------------------------------------------------------
    def record_alloc(self, block):
        """Record an allocation (the resource calls it, in the allocating thread, after the
        allocation succeeded).

        Args:
            block: the block allocated (``ptr``, ``device_ordinal``, ``alloc_stream``, ``nbytes``,
                ``tag``, ``generation``).
        Thread rule: any thread.
        """
        self.record(block, HISTORY_ALLOC)

    def record_free(self, block):
        """Record a successful free (queued on its stream for a stream-ordered resource).

        Args:
            block: the block freed.
        Thread rule: any thread.
        """
        self.record(block, HISTORY_FREE)

    def record_cache_hit(self, block):
        """Record an allocation a block cache served from the blocks it keeps (live from now on,
        as an allocation).

        Args:
            block: the block handed out.
        Thread rule: any thread.
        """
        self.record(block, HISTORY_CACHE_HIT)

    def record_trim(self, block):
        """Record a cached block given back to the cache's upstream (the user freed it before:
        no live block changes).

        Args:
            block: the cached block given back.
        Thread rule: any thread.
        """
        self.record(block, HISTORY_TRIM)

    cdef int record(self, object block, int action) except -1:
        cdef Event ev
        cdef DeviceBlock b
        cdef PyObject* found
        cdef void* local[2 * _STACK_FRAMES]
        cdef void** buf = local
        cdef Py_ssize_t n
        cdef uint64_t h
        cdef tuple origin = None
        if self._ring == NULL:
            raise ValueError("HistoryRing: not initialised")
        if type(block) is DeviceBlock:
            b = <DeviceBlock>block
            ev.ptr = b.ptr
            ev.device = b.device_ordinal
            ev.stream = b.alloc_stream
            ev.nbytes = b.nbytes
            ev.generation = b.generation
            tag = b.tag
        else:
            ev.ptr = block.ptr
            ev.device = block.device_ordinal
            ev.stream = block.alloc_stream
            ev.nbytes = block.nbytes
            ev.generation = block.generation
            tag = block.tag
        ev.action = action
        ev.note_id = 0
        if PyDict_Size(self._origins):
            found = PyDict_GetItem(self._origins, PyThread_get_thread_ident())
            if found != NULL:
                origin = <tuple><object>found
        n = len(origin) if origin is not None else self._max_frames
        if n > _STACK_FRAMES:
            buf = <void**>malloc(2 * n * sizeof(void*))
            if buf == NULL:
                raise MemoryError("HistoryRing: cannot allocate a stack buffer")
        try:
            if origin is not None:
                n = _origin_words(origin, buf)
            elif _fast_walk:
                n = self._walk_fast(buf)
            else:
                n = self._walk_frames(buf)
            h = _hash_words(buf, 2 * n)
            ev.time_ns = _now_ns()
            lock_acquire(&self._lock)
            try:
                ev.stack_id = self._find_stack(buf, n, h)
                ev.tag_id = self._last_tag_id if tag is self._last_tag else -1
                if ev.stack_id >= 0 and ev.tag_id >= 0:
                    self._commit(&ev)
                    return 0
            finally:
                lock_release(&self._lock)
            # a stack or a tag seen for the first time: interned between two holds of the lock
            if ev.stack_id < 0:
                ev.stack_id = self._add_stack(buf, n, h, origin)
            if ev.tag_id < 0:
                ev.tag_id = self._tag_id(tag)
            lock_acquire(&self._lock)
            try:
                self._commit(&ev)
            finally:
                lock_release(&self._lock)
            return 0
        finally:
            if buf != local:
                free(buf)

    cdef int _commit(self, Event* ev) except -1:
        # Under the lock: the event into the ring, and the live table brought up to date.
        cdef Py_ssize_t cell = self._find_live(ev.ptr, ev.device)
        cdef int32_t slot
        if ev.action == HISTORY_ALLOC or ev.action == HISTORY_CACHE_HIT:
            if cell >= 0:
                # the address was live already (its free went unrecorded): the new block takes
                # over its slot
                self._slots[self._live_tab[cell]] = ev[0]
            else:
                # every step that can fail (growing) comes before the first change
                if 2 * (self._live_filled + 1) > self._live_tab_cap:
                    self._rebuild_live(1 + self._live_count)
                slot = self._take_slot()
                self._slots[slot] = ev[0]
                self._insert_live(slot)
        elif cell >= 0 and ev.action == HISTORY_FREE:
            slot = self._live_tab[cell]
            # another thread may already have been handed the address again and recorded it
            if self._slots[slot].generation == ev.generation:
                self._remove_live(cell)
        self._push(ev)
        return 0

    cdef void _push(self, Event* ev) noexcept:
        self._ring[self._head] = ev[0]
        self._head += 1
        if self._head == self._cap:
            self._head = 0
        if self._count < self._cap:
            self._count += 1
        self._recorded += 1

    # -- live blocks (under the lock) -------------------------------------------------------
    cdef int32_t _take_slot(self) except -1:
        cdef Py_ssize_t i, cap
        cdef Event* slots
        cdef int32_t* nxt
        if self._slot_free < 0:
            cap = 64 if self._slot_cap == 0 else 2 * self._slot_cap
            slots = <Event*>realloc(self._slots, cap * sizeof(Event))
            if slots == NULL:
                raise MemoryError("HistoryRing: cannot grow the live blocks")
            self._slots = slots
            nxt = <int32_t*>realloc(self._slot_next, cap * sizeof(int32_t))
            if nxt == NULL:
                raise MemoryError("HistoryRing: cannot grow the live blocks")
            self._slot_next = nxt
            for i in range(self._slot_cap, cap):
                nxt[i] = <int32_t>(i + 1) if i + 1 < cap else -1
            self._slot_free = <int32_t>self._slot_cap
            self._slot_cap = cap
        i = self._slot_free
        self._slot_free = self._slot_next[i]
        self._slot_next[i] = _USED
        return <int32_t>i

    cdef Py_ssize_t _find_live(self, uint64_t ptr, int32_t device) noexcept:
        cdef Py_ssize_t mask = self._live_tab_cap - 1, i
        cdef int32_t s
        if self._live_tab_cap == 0:
            return -1
        i = <Py_ssize_t>(_live_hash(ptr, device) & <uint64_t>mask)
        while True:
            s = self._live_tab[i]
            if s == _EMPTY:
                return -1
            if s >= 0 and self._slots[s].ptr == ptr and self._slots[s].device == device:
                return i
            i = (i + 1) & mask

    cdef void _insert_live(self, int32_t slot) noexcept:
        # ``slot``'s key is not in the table (the caller looked) and the table has room
        cdef Py_ssize_t mask, i
        mask = self._live_tab_cap - 1
        i = <Py_ssize_t>(_live_hash(self._slots[slot].ptr, self._slots[slot].device) & <uint64_t>mask)
        while self._live_tab[i] >= 0:
            i = (i + 1) & mask
        if self._live_tab[i] == _EMPTY:
            self._live_filled += 1
        self._live_tab[i] = slot
        self._live_count += 1

    cdef void _remove_live(self, Py_ssize_t cell) noexcept:
        cdef int32_t slot = self._live_tab[cell]
        self._live_tab[cell] = _REMOVED
        self._slot_next[slot] = self._slot_free
        self._slot_free = slot
        self._live_count -= 1

    cdef int _rebuild_live(self, Py_ssize_t need) except -1:
        # a table at most a quarter full of ``need`` blocks, without the removed cells
        cdef Py_ssize_t cap = 64, i, j, mask
        cdef int32_t* tab
        while cap < 4 * need:
            cap *= 2
        tab = _new_table(cap)
        mask = cap - 1
        for i in range(self._slot_cap):
            if self._slot_next[i] == _USED:
                j = <Py_ssize_t>(_live_hash(self._slots[i].ptr, self._slots[i].device) & <uint64_t>mask)
                while tab[j] != _EMPTY:
                    j = (j + 1) & mask
                tab[j] = <int32_t>i
        free(self._live_tab)
        self._live_tab = tab
        self._live_tab_cap = cap
        self._live_filled = self._live_count
        return 0

    # -- interning ----------------------------------------------------------------------------
    cdef int32_t _find_stack(self, void** buf, Py_ssize_t n, uint64_t h) noexcept:
        # Under the lock: the id of the stack of ``n`` (code, offset) word pairs, -1 if new.
        cdef Py_ssize_t mask = self._stack_tab_cap - 1, i, nbytes = n * 2 * sizeof(void*)
        cdef int32_t sid
        cdef PyObject* key
        if n == 0:
            return 0
        if self._stack_tab_cap == 0:
            return -1
        i = <Py_ssize_t>(h & <uint64_t>mask)
        while True:
            sid = self._stack_tab[i]
            if sid == _EMPTY:
                return -1
            if self._stack_hashes[sid] == h:
                key = PyList_GET_ITEM(self._stack_keys, sid)
                if PyBytes_GET_SIZE(<object>key) == nbytes and memcmp(
                    PyBytes_AS_STRING(<object>key), buf, nbytes
                ) == 0:
                    return sid
            i = (i + 1) & mask

    cdef int32_t _add_stack(self, void** buf, Py_ssize_t n, uint64_t h, tuple frames) except -1:
        # Outside the lock: the key and the frames (new objects); then, under it, the table.
        cdef Py_ssize_t i, sid, cap
        cdef uint64_t* hashes
        key = PyBytes_FromStringAndSize(<char*>buf, n * 2 * sizeof(void*))
        if frames is None:
            frames = tuple([(<object>buf[2 * i], <intptr_t>buf[2 * i + 1]) for i in range(n)])
        lock_acquire(&self._lock)
        try:
            sid = self._find_stack(buf, n, h)  # another thread may have added it meanwhile
            if sid >= 0:
                return <int32_t>sid
            sid = len(self._stacks)
            if sid >= self._stack_hash_cap:
                cap = 64 if self._stack_hash_cap == 0 else 2 * self._stack_hash_cap
                hashes = <uint64_t*>realloc(self._stack_hashes, cap * sizeof(uint64_t))
                if hashes == NULL:
                    raise MemoryError("HistoryRing: cannot grow the stack table")
                self._stack_hashes = hashes
                self._stack_hash_cap = cap
            if 2 * (sid + 1) > self._stack_tab_cap:
                self._rebuild_stacks(sid + 1)
            self._stacks.append(frames)
            self._stack_keys.append(key)
            self._stack_hashes[sid] = h
            self._place_stack(<int32_t>sid)
            return <int32_t>sid
        finally:
            lock_release(&self._lock)

    cdef void _place_stack(self, int32_t sid) noexcept:
        cdef Py_ssize_t mask = self._stack_tab_cap - 1
        cdef Py_ssize_t i = <Py_ssize_t>(self._stack_hashes[sid] & <uint64_t>mask)
        while self._stack_tab[i] != _EMPTY:
            i = (i + 1) & mask
        self._stack_tab[i] = sid

    cdef int _rebuild_stacks(self, Py_ssize_t need) except -1:
        cdef Py_ssize_t cap = 64, sid
        while cap < 4 * need:
            cap *= 2
        free(self._stack_tab)
        self._stack_tab = _new_table(cap)
        self._stack_tab_cap = cap
        for sid in range(1, len(self._stacks)):  # id 0, the empty stack, is not in the table
            self._place_stack(<int32_t>sid)
        return 0

    cdef int32_t _tag_id(self, object tag) except -1:
        # Outside the lock: the tag's id (a new one made under the lock), then remembered as the
        # last tag seen.
        cdef PyObject* found
        cdef Py_ssize_t tid
        lock_acquire(&self._lock)
        try:
            found = PyDict_GetItem(self._tag_ids, tag)
            if found != NULL:
                tid = PyLong_AsLong(<object>found)
            else:
                tid = len(self._tags)
                self._tags.append(tag)
                PyDict_SetItem(self._tag_ids, tag, PyLong_FromSsize_t(tid))
            self._last_tag = tag
            self._last_tag_id = <int32_t>tid
            return <int32_t>tid
        finally:
            lock_release(&self._lock)

    # -- the stack ----------------------------------------------------------------------------
    cdef int _skips(self, PyObject* code) except -1:
        cdef PyObject* name = xl_filename(code)
        cdef Py_ssize_t i = <Py_ssize_t>((<uintptr_t>name >> 4) % _FILE_CACHE)
        if self._file_names[i] == name:
            return self._file_skips[i]
        return self._skips_new(name, i)

    cdef int _skips_new(self, PyObject* name, Py_ssize_t i) except -1:
        # The table holds a reference to each name it keeps, so a name's address cannot be
        # reused by another string while it is there.
        cdef PyObject* found = PyDict_GetItem(self._skip_cache, <object>name)
        cdef PyObject* old
        cdef bint skip = (<object>found is True) if found != NULL else bool(self._is_runtime(<object>name))
        Py_INCREF(<object>name)
        old = self._file_names[i]
        self._file_names[i] = name
        self._file_skips[i] = skip
        Py_XDECREF(old)
        return skip

    cdef Py_ssize_t _walk_fast(self, void** buf) except -1:
        cdef void* cursor = xl_top()
        cdef PyObject* code
        cdef Py_ssize_t n = 0
        while cursor != NULL and n < self._max_frames:
            code = xl_code(cursor)
            if not self._skips(code):
                buf[2 * n] = <void*>code
                buf[2 * n + 1] = <void*>xl_lasti(cursor)
                n += 1
            cursor = xl_back(cursor)
        return n

    cdef Py_ssize_t _walk_frames(self, void** buf) except -1:
        # Frame objects keep their code alive; the frames walked are those of this call's own
        # stack, alive until it returns, so the borrowed code pointers stay valid meanwhile.
        cdef Py_ssize_t n = 0
        frame = _getframe(0)
        while frame is not None and n < self._max_frames:
            code = frame.f_code
            if not self._skips(<PyObject*>code):
                buf[2 * n] = <void*>code
                buf[2 * n + 1] = <void*><intptr_t>frame.f_lasti
                n += 1
            frame = frame.f_back
        return n

    def forget_device(self, int ordinal, str reason):
        """Record a free, with an empty stack and ``reason`` as its note, for every block of
        device ``ordinal`` still live here: their memory went at once, without a free per block
        (a context rebuilt, or a device stopped for good).

        Returns:
            how many blocks were forgotten.
        Thread rule: any thread.
        """
        cdef Py_ssize_t slot, n = 0, cell
        cdef Event ev
        cdef PyObject* found
        cdef int32_t note_id
        found = PyDict_GetItem(self._note_ids, reason)
        if found == NULL:
            lock_acquire(&self._lock)
            try:
                note_id = <int32_t>len(self._notes)
                self._notes.append(reason)
                PyDict_SetItem(self._note_ids, reason, PyLong_FromSsize_t(note_id))
            finally:
                lock_release(&self._lock)
        else:
            note_id = <int32_t>PyLong_AsLong(<object>found)
        cdef int64_t now = _now_ns()
        lock_acquire(&self._lock)
        try:
            for slot in range(self._slot_cap):
                if self._slot_next[slot] != _USED or self._slots[slot].device != ordinal:
                    continue
                ev = self._slots[slot]
                ev.action = HISTORY_FREE
                ev.time_ns = now
                ev.stack_id = 0
                ev.note_id = note_id
                cell = self._find_live(ev.ptr, ev.device)
                if cell >= 0:  # always: a used slot is in the table
                    self._remove_live(cell)
                self._push(&ev)
                n += 1
        finally:
            lock_release(&self._lock)
        return n

    # -- settings ---------------------------------------------------------------------------
    @property
    def max_entries(self):
        """The ring's bound. Thread rule: any thread."""
        return self._cap

    @property
    def max_frames(self):
        """The most frames kept per event. Thread rule: any thread."""
        return self._max_frames

    def resize(self, Py_ssize_t max_entries):
        """Change the ring's bound, keeping the newest events that fit.

        Args:
            max_entries: the new bound (positive; the caller checked it).
        Raises:
            ValueError: the bound is not positive; nothing changes.
            MemoryError: the new ring cannot be allocated; nothing changes.
        Thread rule: any thread.
        """
        cdef Event* ring
        cdef Event* old
        cdef Py_ssize_t keep
        if max_entries <= 0:
            raise ValueError("HistoryRing.resize: a positive bound")
        ring = <Event*>malloc(max_entries * sizeof(Event))
        if ring == NULL:
            raise MemoryError(f"HistoryRing: cannot allocate {max_entries} events")
        lock_acquire(&self._lock)
        keep = min(self._count, max_entries)
        self._copy_newest(ring, keep)
        old = self._ring
        self._ring = ring
        self._cap = max_entries
        self._count = keep
        self._head = keep % max_entries
        lock_release(&self._lock)
        free(old)

    cdef void _copy_newest(self, Event* out, Py_ssize_t n) noexcept:
        # the newest n events, oldest first (under the lock)
        cdef Py_ssize_t first = self._head - n, part
        if first < 0:
            first += self._cap
        part = min(n, self._cap - first)
        memcpy(out, self._ring + first, part * sizeof(Event))
        memcpy(out + part, self._ring, (n - part) * sizeof(Event))

    def clear(self):
        """Forget every event and live block, and the interned stacks and tags.

        Thread rule: any thread.
        """
        cdef Py_ssize_t i
        # id 0 of the stack and note tables is the empty one (a free recorded for a whole device)
        old = (self._tag_ids, self._tags, self._stacks, self._stack_keys, self._note_ids, self._notes)
        tag_ids, tags, stacks, stack_keys, note_ids, notes = {}, [], [()], [b""], {"": 0}, [""]
        lock_acquire(&self._lock)
        self._tag_ids, self._tags, self._last_tag, self._last_tag_id = tag_ids, tags, None, -1
        self._stacks, self._stack_keys, self._note_ids, self._notes = stacks, stack_keys, note_ids, notes
        for i in range(self._stack_tab_cap):
            self._stack_tab[i] = _EMPTY
        for i in range(self._live_tab_cap):
            self._live_tab[i] = _EMPTY
        for i in range(self._slot_cap):
            self._slot_next[i] = <int32_t>(i + 1) if i + 1 < self._slot_cap else -1
        self._slot_free = 0 if self._slot_cap else -1
        self._live_count = self._live_filled = 0
        self._head = self._count = 0
        self._recorded = 0
        lock_release(&self._lock)
        del old

    # -- reading ----------------------------------------------------------------------------
    def __len__(self):
        """Events in the ring. Thread rule: any thread."""
        return self._count

    @property
    def recorded(self):
        """Events recorded since the history was made or cleared, those that left the ring
        included. Thread rule: any thread."""
        return self._recorded

    @property
    def live_blocks(self):
        """Blocks live now. Thread rule: any thread."""
        return self._live_count

    def entries(self):
        """The events in the ring, oldest first, then the blocks live now, each as a tuple
        ``(time_ns, action, device, stream, tag, nbytes, ptr, frames, note, generation)``
        (``frames``: (code object, instruction offset) pairs, innermost first), with the
        number of events recorded and the ring's bound.

        Returns:
            ``(events, live, recorded, max_entries)``, all of one instant.
        Raises:
            MemoryError: the copy cannot be allocated.
        Thread rule: any thread.
        """
        cdef Event* copy
        cdef Py_ssize_t n, m = 0, i
        lock_acquire(&self._lock)
        n = self._count
        copy = <Event*>malloc(max(n + self._live_count, 1) * sizeof(Event))
        if copy == NULL:
            lock_release(&self._lock)
            raise MemoryError("HistoryRing: cannot copy the history")
        self._copy_newest(copy, n)
        for i in range(self._slot_cap):
            if self._slot_next[i] == _USED:
                copy[n + m] = self._slots[i]
                m += 1
        tags, stacks, notes = self._tags, self._stacks, self._notes
        recorded, cap = self._recorded, self._cap
        lock_release(&self._lock)
        try:
            events = [_as_tuple(&copy[i], tags, stacks, notes) for i in range(n)]
            live = [_as_tuple(&copy[n + i], tags, stacks, notes) for i in range(m)]
        finally:
            free(copy)
        return events, live, recorded, cap


cdef Py_ssize_t _origin_words(tuple frames, void** buf) except -1:
    # the (code, offset) words of a stack captured elsewhere (``capture_frames``)
    cdef Py_ssize_t i
    for i in range(len(frames)):
        code, lasti = frames[i]
        buf[2 * i] = <void*>code
        buf[2 * i + 1] = <void*><intptr_t>lasti
    return len(frames)


cdef tuple _as_tuple(Event* e, list tags, list stacks, list notes):
    return (e.time_ns, _ACTIONS[e.action], e.device, e.stream, tags[e.tag_id], e.nbytes, e.ptr,
            stacks[e.stack_id], notes[e.note_id], e.generation)
