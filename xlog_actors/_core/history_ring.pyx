# cython: language_level=3, boundscheck=False, wraparound=False
"""``HistoryRing``: the memory history's record, kept as C structs so that recording an event
builds no Python object on the common path; ``memory.MemoryHistory`` is its Python face.

One event is an ``Event`` struct (time, action, device, stream, size, address, generation and
three interned ids: tag, stack, note) in a bounded ring. Blocks still live are kept apart, one
struct per block in a slot array found through a dict from (device, address) to slot, so that a
snapshot lists every live block even after its allocation left the ring.

The stack of an event is walked where it is recorded: on CPython 3.11 over the interpreter's own
frame records (``_PyInterpreterFrame``, read through the internal header as debuggers do), which
materialises no frame object; elsewhere through ``sys._getframe`` and ``f_back``. Frames whose
file the history's ``is_runtime`` says are the runtime's own are skipped (decided once per file
name, cached in the history's dict), and at most ``max_frames`` are kept. The kept (code object,
instruction offset) pairs are interned: their bytes (pointers and offsets) key a dict to a stack
id, and the tuple of pairs is built only the first time a stack is seen. The table holds a strong
reference to each code object it keys, so no live key can name a freed code object's address.
Tags and notes are interned the same way. Everything is resolved back to objects only when the
history is read (``entries``, ``live_entries``).

Invariants: ``0 <= count <= cap``; a slot is used exactly while the live dict maps a key to it;
interned ids only grow until ``clear``. No allocation of a garbage-collected object happens while
the ring's lock is held (a collection could run a finaliser that frees a block and records into
this very ring, on this thread), so everything that builds such objects runs before the lock.

Thread rule: every method, any thread, any time; events from several threads are kept in the order
they took the lock.
"""

cimport cython
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.dict cimport PyDict_DelItem, PyDict_GetItem, PyDict_SetItem, PyDict_Size
from cpython.long cimport PyLong_AsLong, PyLong_FromSsize_t, PyLong_FromUnsignedLongLong
from cpython.pythread cimport PyThread_allocate_lock, PyThread_free_lock, PyThread_get_thread_ident
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, intptr_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy
from posix.time cimport CLOCK_REALTIME, clock_gettime, timespec

from .blocks cimport DeviceBlock
from .lock cimport lock_acquire, lock_release

import sys

__all__ = ["FAST_FRAME_WALK", "HistoryRing"]

cdef extern from *:
    """
    #if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
    #define Py_BUILD_CORE 1
    #include "internal/pycore_frame.h"
    #undef Py_BUILD_CORE
    #define XL_FAST_FRAMES 1
    static inline _PyInterpreterFrame *xl_complete(_PyInterpreterFrame *f) {
        while (f != NULL && _PyFrame_IsIncomplete(f)) f = f->previous;
        return f;
    }
    static inline void *xl_top(void) { return xl_complete(PyThreadState_Get()->cframe->current_frame); }
    static inline void *xl_back(void *c) { return xl_complete(((_PyInterpreterFrame *)c)->previous); }
    static inline PyObject *xl_code(void *c) { return (PyObject *)((_PyInterpreterFrame *)c)->f_code; }
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

#: Whether stacks are walked over the interpreter's frame records (CPython 3.11) rather than
#: through frame objects.
FAST_FRAME_WALK = bool(XL_FAST_FRAMES)
cdef bint _fast_walk = XL_FAST_FRAMES

cdef enum:
    # the most frames a walk keeps in the caller's C stack; more are walked into a heap buffer
    _STACK_FRAMES = 64
    # a live key is one int while the address fits in 52 bits and the ordinal in 12
    _DEVICE_BITS = 12

cdef tuple _ACTIONS = ("alloc", "free")
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


cdef inline object _live_key(int32_t device, uint64_t ptr):
    if 0 <= device < (1 << _DEVICE_BITS) and ptr < (<uint64_t>1 << (64 - _DEVICE_BITS)):
        return PyLong_FromUnsignedLongLong((ptr << _DEVICE_BITS) | <uint64_t>device)
    return (device, ptr)


cdef class HistoryRing:
    """The compiled record under ``memory.MemoryHistory`` (see the module docstring).

    ``HistoryRing(max_entries, max_frames, skip_cache, is_runtime)``: ``skip_cache`` is a dict
    from file name to whether that file's frames are skipped, ``is_runtime(filename)`` decides
    (and fills the cache) for a file not in it yet.

    Thread rule: every method, any thread, any time.
    """

    def __cinit__(self, *args, **kwargs):
        self._lock = PyThread_allocate_lock()
        if self._lock == NULL:
            raise MemoryError("HistoryRing: cannot allocate its lock")
        self._slot_free = -1

    def __dealloc__(self):
        free(self._ring)
        free(self._slots)
        free(self._slot_next)
        if self._lock != NULL:
            PyThread_free_lock(self._lock)

    def __init__(self, Py_ssize_t max_entries, int max_frames, dict skip_cache, object is_runtime):
        """
        Args:
            max_entries: the ring's bound (positive; the caller checked it).
            max_frames: the most frames kept per event (positive).
            skip_cache: file name -> whether its frames are the runtime's own.
            is_runtime: ``is_runtime(filename) -> bool`` for a file the cache lacks.
        Raises:
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

    cdef int record(self, object block, int action) except -1:
        cdef Event ev
        cdef DeviceBlock b
        cdef PyObject* found
        cdef Py_ssize_t slot
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
        ev.stack_id = self._stack_here()
        ev.tag_id = self._intern(self._tag_ids, self._tags, tag, tag)
        key = _live_key(ev.device, ev.ptr)
        ev.time_ns = _now_ns()
        lock_acquire(self._lock)
        try:
            self._push(&ev)
            found = PyDict_GetItem(self._live, key)
            if action == HISTORY_ALLOC:
                if found != NULL:
                    # the address was live already (its free went unrecorded): the new block
                    # takes over its slot
                    self._slots[PyLong_AsLong(<object>found)] = ev
                else:
                    slot = self._take_slot()
                    self._slots[slot] = ev
                    PyDict_SetItem(self._live, key, PyLong_FromSsize_t(slot))
            elif found != NULL:
                slot = PyLong_AsLong(<object>found)
                # another thread may already have been handed the address again and recorded it
                if self._slots[slot].generation == ev.generation:
                    PyDict_DelItem(self._live, key)
                    self._give_slot(slot)
        finally:
            lock_release(self._lock)
        return 0

    cdef void _push(self, Event* ev) noexcept:
        self._ring[self._head] = ev[0]
        self._head += 1
        if self._head == self._cap:
            self._head = 0
        if self._count < self._cap:
            self._count += 1
        self._recorded += 1

    cdef Py_ssize_t _take_slot(self) except -1:
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
        self._slot_next[i] = -2  # used
        self._live_count += 1
        return i

    cdef void _give_slot(self, Py_ssize_t slot) noexcept:
        self._slot_next[slot] = self._slot_free
        self._slot_free = <int32_t>slot
        self._live_count -= 1

    cdef int32_t _intern(self, dict ids, list values, object key, object value) except -1:
        cdef PyObject* found = PyDict_GetItem(ids, key)
        cdef Py_ssize_t new_id
        if found != NULL:
            return <int32_t>PyLong_AsLong(<object>found)
        lock_acquire(self._lock)
        try:
            found = PyDict_GetItem(ids, key)  # another thread may have interned it meanwhile
            if found != NULL:
                return <int32_t>PyLong_AsLong(<object>found)
            new_id = len(values)
            values.append(value)
            PyDict_SetItem(ids, key, PyLong_FromSsize_t(new_id))
            return <int32_t>new_id
        finally:
            lock_release(self._lock)

    cdef int32_t _stack_here(self) except -1:
        cdef void* local[2 * _STACK_FRAMES]
        cdef void** buf = local
        cdef Py_ssize_t n
        cdef PyObject* found
        if PyDict_Size(self._origins):
            found = PyDict_GetItem(self._origins, PyThread_get_thread_ident())
            if found != NULL:
                return self._intern_frames(<tuple><object>found)
        if self._max_frames > _STACK_FRAMES:
            buf = <void**>malloc(2 * self._max_frames * sizeof(void*))
            if buf == NULL:
                raise MemoryError("HistoryRing: cannot allocate a stack buffer")
        try:
            n = self._walk_fast(buf) if _fast_walk else self._walk_frames(buf)
            # the key is built before any allocation that could collect garbage (and run a
            # finaliser that records on this thread): the code objects in buf are borrowed
            key = PyBytes_FromStringAndSize(<char*>buf, n * 2 * sizeof(void*))
            found = PyDict_GetItem(self._stack_ids, key)
            if found != NULL:
                return <int32_t>PyLong_AsLong(<object>found)
            frames = tuple([(<object>buf[2 * i], <intptr_t>buf[2 * i + 1]) for i in range(n)])
            return self._intern(self._stack_ids, self._stacks, key, frames)
        finally:
            if buf != local:
                free(buf)

    cdef bint _skips(self, PyObject* code) except -1:
        cdef PyObject* filename = xl_filename(code)
        cdef PyObject* found = PyDict_GetItem(self._skip_cache, <object>filename)
        if found != NULL:
            return <object>found is True
        return bool(self._is_runtime(<object>filename))

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

    cdef int32_t _intern_frames(self, tuple frames) except -1:
        cdef Py_ssize_t n = len(frames), i
        cdef bytearray raw = bytearray(n * 2 * sizeof(void*))
        cdef void** buf = <void**><char*>raw
        for i in range(n):
            code, lasti = frames[i]
            buf[2 * i] = <void*>code
            buf[2 * i + 1] = <void*><intptr_t>lasti
        return self._intern(self._stack_ids, self._stacks, bytes(raw), frames)

    def forget_device(self, int ordinal, str reason):
        """Record a free, with an empty stack and ``reason`` as its note, for every block of
        device ``ordinal`` still live here: their memory went at once, without a free per block
        (a context rebuilt, or a device stopped for good).

        Returns:
            how many blocks were forgotten.
        Thread rule: any thread.
        """
        cdef PyObject* found
        cdef Py_ssize_t slot, n = 0
        cdef Event ev
        cdef int32_t note_id = self._intern(self._note_ids, self._notes, reason, reason)
        items = list(self._live.items())
        cdef int64_t now = _now_ns()
        lock_acquire(self._lock)
        try:
            for key, value in items:
                found = PyDict_GetItem(self._live, key)
                if found == NULL or PyLong_AsLong(<object>found) != PyLong_AsLong(value):
                    continue
                slot = PyLong_AsLong(value)
                if self._slots[slot].device != ordinal:
                    continue
                ev = self._slots[slot]
                ev.action = HISTORY_FREE
                ev.time_ns = now
                ev.stack_id = 0
                ev.note_id = note_id
                self._push(&ev)
                PyDict_DelItem(self._live, key)
                self._give_slot(slot)
                n += 1
        finally:
            lock_release(self._lock)
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
        lock_acquire(self._lock)
        keep = min(self._count, max_entries)
        self._copy_newest(ring, keep)
        old = self._ring
        self._ring = ring
        self._cap = max_entries
        self._count = keep
        self._head = keep % max_entries
        lock_release(self._lock)
        free(old)

    cdef void _copy_newest(self, Event* out, Py_ssize_t n) noexcept:
        # the newest n events, oldest first (under the lock)
        cdef Py_ssize_t first = (self._head - n) % self._cap, part
        if first < 0:
            first += self._cap
        part = min(n, self._cap - first)
        memcpy(out, self._ring + first, part * sizeof(Event))
        memcpy(out + part, self._ring, (n - part) * sizeof(Event))

    def clear(self):
        """Forget every event and live block, and the interned stacks. Thread rule: any thread."""
        cdef Py_ssize_t i
        # id 0 of the stack and note tables is the empty one (a free recorded for a whole device)
        old = (self._live, self._tag_ids, self._tags, self._stack_ids, self._stacks, self._note_ids, self._notes)
        live, tag_ids, tags, stack_ids, stacks, note_ids, notes = {}, {}, [], {b"": 0}, [()], {"": 0}, [""]
        lock_acquire(self._lock)
        self._live, self._tag_ids, self._tags = live, tag_ids, tags
        self._stack_ids, self._stacks, self._note_ids, self._notes = stack_ids, stacks, note_ids, notes
        self._head = self._count = 0
        self._recorded = 0
        for i in range(self._slot_cap):
            self._slot_next[i] = <int32_t>(i + 1) if i + 1 < self._slot_cap else -1
        self._slot_free = 0 if self._slot_cap else -1
        self._live_count = 0
        lock_release(self._lock)
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
        cdef Py_ssize_t n, m = 0, i, total
        lock_acquire(self._lock)
        n = self._count
        total = n + self._live_count
        copy = <Event*>malloc(max(total, 1) * sizeof(Event))
        if copy == NULL:
            lock_release(self._lock)
            raise MemoryError("HistoryRing: cannot copy the history")
        self._copy_newest(copy, n)
        for i in range(self._slot_cap):
            if self._slot_next[i] == -2:
                copy[n + m] = self._slots[i]
                m += 1
        tags, stacks, notes = self._tags, self._stacks, self._notes
        recorded, cap = self._recorded, self._cap
        lock_release(self._lock)
        try:
            events = [_as_tuple(&copy[i], tags, stacks, notes) for i in range(n)]
            live = [_as_tuple(&copy[n + i], tags, stacks, notes) for i in range(m)]
        finally:
            free(copy)
        return events, live, recorded, cap

    @property
    def live_blocks(self):
        """Blocks live now. Thread rule: any thread."""
        return self._live_count


cdef tuple _as_tuple(Event* e, list tags, list stacks, list notes):
    return (e.time_ns, _ACTIONS[e.action], e.device, e.stream, tags[e.tag_id], e.nbytes, e.ptr,
            stacks[e.stack_id], notes[e.note_id], e.generation)
