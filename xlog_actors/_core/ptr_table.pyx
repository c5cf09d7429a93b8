# cython: language_level=3, boundscheck=False, wraparound=False
"""``PtrTable``: device address -> object, an open-addressing hash table in C.

Why not a dict: a context's block table takes an insert, a look-up and a delete per allocation and
free, on int keys; a dict spent about 850 instructions on them per pair (hashing the int object,
the generic look-up for non-str keys, the dummy entries deletions leave and the resizes they force),
this table about 100. Keys are the addresses as C integers (a block's ``ptr``); slots are probed
linearly from a Fibonacci hash of the address without its low (alignment) bits, and a delete
shifts the following slots back, so there are no tombstones and a look-up stops at the first empty
slot. The table doubles at half full and never shrinks (a context's table lives as long as its
generation).

Invariants: ``_used`` is the number of non-empty slots; each non-empty slot holds a strong
reference. Values are never visited by the garbage collector: what the tables hold (blocks)
never refers back to their owners, so they take part in no cycle.

Thread rule: every method runs with the GIL held and calls no Python code between its reads and
writes of the slots (a value's release, which may run a finalizer, comes after), so concurrent
callers need no lock, as with a dict.
"""

from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, free
from cpython.object cimport PyObject
from cpython.exc cimport PyErr_Clear, PyErr_Occurred
from cpython.ref cimport Py_INCREF, Py_XDECREF

from .pyint cimport xa_small_u64

__all__ = ["PtrTable", "fail_a_grow"]

cdef extern from "Python.h":
    # Declared here without Cython's error check: key_of clears the error itself. The unsigned
    # long one (64 bits on the LP64 systems this builds on, checked below): it converts by a loop
    # over the digits, where PyLong_AsUnsignedLongLong goes through a byte array (about 200
    # instructions for a two-digit address).
    unsigned long _as_u64 "PyLong_AsUnsignedLong"(object value) noexcept


if sizeof(unsigned long) != 8:
    raise ImportError("xlog_actors._core.ptr_table needs a 64-bit unsigned long (an LP64 system)")


cdef Py_ssize_t _FIRST_CAPACITY = 64  # a power of two
cdef int _FIRST_SHIFT = 58  # 64 - log2(_FIRST_CAPACITY)
# Fault injection (tests): grows left to succeed before one fails, as a failed calloc would; -1:
# off. Read only when a table grows, so it costs the hot paths nothing.
cdef Py_ssize_t _grows_to_pass = -1


def fail_a_grow(Py_ssize_t after=0):
    """Fault injection for tests: the grow of any table ``after`` grows from now raises
    ``MemoryError``, as when ``calloc`` fails (the table is left as it was); ``after=-1``
    disarms it.

    Args:
        after: how many grows succeed first.
    Thread rule: any thread, with the GIL.
    """
    global _grows_to_pass
    _grows_to_pass = after


cdef inline Py_ssize_t _home(uint64_t key, int shift) noexcept:
    return <Py_ssize_t>(((key >> 4) * <uint64_t>0x9E3779B97F4A7C15ULL) >> shift)


cdef bint key_of(object ptr, uint64_t* out) noexcept:
    """``ptr`` as a table key: True for an exact ``int`` in [0, 2**64); anything else is no key
    (and leaves no error set)."""
    cdef int small
    if type(ptr) is not int:
        return False
    small = xa_small_u64(ptr, out)
    if small >= 0:
        return small == 1
    out[0] = _as_u64(ptr)
    if out[0] == <uint64_t>-1 and PyErr_Occurred() != NULL:
        PyErr_Clear()  # negative, or too large
        return False
    return True


cdef class PtrTable:
    """Address -> object (see the module docstring).

    Thread rule: any thread, with the GIL.
    """

    def __cinit__(self):
        self._slots = <PtrSlot*>calloc(_FIRST_CAPACITY, sizeof(PtrSlot))
        if self._slots == NULL:
            raise MemoryError("PtrTable: cannot allocate its slots")
        self._mask = _FIRST_CAPACITY - 1
        self._shift = _FIRST_SHIFT
        self._used = 0

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self._slots != NULL:
            for i in range(self._mask + 1):
                if self._slots[i].value != NULL:
                    Py_XDECREF(self._slots[i].value)
            free(self._slots)

    cdef PtrSlot* _slot(self, uint64_t key) noexcept:
        """The slot holding ``key``, or the empty slot where it would go (one probe for both)."""
        cdef Py_ssize_t i = _home(key, self._shift)
        cdef PtrSlot* slot
        while True:
            slot = &self._slots[i]
            if slot.value == NULL or slot.key == key:
                return slot
            i = (i + 1) & self._mask

    cdef PyObject* find(self, uint64_t key) noexcept:
        """The value at ``key`` (borrowed), or NULL."""
        return self._slot(key).value

    cdef int insert(self, uint64_t key, object value) except -1:
        """Put ``value`` at ``key``, replacing what was there."""
        cdef PtrSlot* slot
        cdef PyObject* old
        if (self._used + 1) * 2 > self._mask + 1:
            self._grow()
        slot = self._slot(key)
        Py_INCREF(value)
        old = slot.value
        slot.key = key
        slot.value = <PyObject*>value
        if old == NULL:
            self._used += 1
        else:
            Py_XDECREF(old)  # last: a finalizer it runs sees the table consistent
        return 0

    cdef int add(self, uint64_t key, object value) except -1:
        """Put ``value`` at ``key`` unless the key is there already, in one probe: 1 when it
        went in, 0 when the key was taken (nothing changed)."""
        cdef PtrSlot* slot
        if (self._used + 1) * 2 > self._mask + 1:
            self._grow()
        slot = self._slot(key)
        if slot.value != NULL:
            return 0
        Py_INCREF(value)
        slot.key = key
        slot.value = <PyObject*>value
        self._used += 1
        return 1

    cdef bint remove_if(self, uint64_t key, object expected) noexcept:
        """Remove ``key`` if its value is ``expected`` (the same object); True when removed."""
        cdef Py_ssize_t i = _home(key, self._shift)
        cdef Py_ssize_t j, home
        cdef PyObject* found
        while True:
            if self._slots[i].value == NULL:
                return False
            if self._slots[i].key == key:
                break
            i = (i + 1) & self._mask
        found = self._slots[i].value
        if found != <PyObject*>expected:
            return False
        # Shift back every following slot that may sit at i (its home is not in (i, j]).
        j = i
        while True:
            j = (j + 1) & self._mask
            if self._slots[j].value == NULL:
                break
            home = _home(self._slots[j].key, self._shift)
            if (i <= j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                self._slots[i] = self._slots[j]
                i = j
        self._slots[i].value = NULL
        self._used -= 1
        Py_XDECREF(found)  # the caller holds ``expected``: never the last reference here
        return True

    cdef int _grow(self) except -1:
        global _grows_to_pass
        cdef Py_ssize_t old_capacity = self._mask + 1
        cdef Py_ssize_t i, j
        cdef PtrSlot* old = self._slots
        cdef PtrSlot* slots
        if _grows_to_pass >= 0:
            _grows_to_pass -= 1
            if _grows_to_pass < 0:
                raise MemoryError(f"PtrTable: cannot grow to {old_capacity * 2} slots (injected)")
        slots = <PtrSlot*>calloc(old_capacity * 2, sizeof(PtrSlot))
        if slots == NULL:
            raise MemoryError(f"PtrTable: cannot grow to {old_capacity * 2} slots")
        self._slots = slots
        self._mask = old_capacity * 2 - 1
        self._shift -= 1
        for i in range(old_capacity):
            if old[i].value != NULL:
                j = _home(old[i].key, self._shift)
                while slots[j].value != NULL:
                    j = (j + 1) & self._mask
                slots[j] = old[i]
        free(old)
        return 0

    # -- the Python face: for the actor's statistics, a context's close, and tests -------------
    def __len__(self):
        """The number of entries. Thread rule: any thread."""
        return self._used

    def get(self, ptr, default=None):
        """The value at address ``ptr``, or ``default``.

        Args:
            ptr: an int address (anything else is never a key).
            default: what a missing key gives.
        Thread rule: any thread.
        """
        cdef uint64_t key
        cdef PyObject* found
        if not key_of(ptr, &key):
            return default
        found = self.find(key)
        return default if found == NULL else <object>found

    def put(self, ptr, value):
        """Set the value at address ``ptr``.

        Raises:
            TypeError: ``ptr`` is not an int in [0, 2**64).
        Thread rule: any thread.
        """
        cdef uint64_t key
        if not key_of(ptr, &key):
            raise TypeError(f"PtrTable: a key is an int address in [0, 2**64), got {ptr!r}")
        self.insert(key, value)

    def pop_if(self, ptr, expected):
        """Remove address ``ptr`` if its value is ``expected`` (the same object).

        Returns:
            True when removed.
        Thread rule: any thread.
        """
        cdef uint64_t key
        if not key_of(ptr, &key):
            return False
        return self.remove_if(key, expected)

    def items(self):
        """``(address, value)`` pairs, as a new list (in slot order). Thread rule: any thread."""
        cdef Py_ssize_t i
        return [(self._slots[i].key, <object>self._slots[i].value)
                for i in range(self._mask + 1) if self._slots[i].value != NULL]

    def values(self):
        """The values, as a new list (in slot order, not insertion order). Thread rule: any thread."""
        cdef Py_ssize_t i
        return [<object>self._slots[i].value for i in range(self._mask + 1) if self._slots[i].value != NULL]

    def clear(self):
        """Remove every entry. Thread rule: any thread."""
        cdef Py_ssize_t i
        cdef list held = self.values()  # released after the slots are empty: finalizers see it clear
        for i in range(self._mask + 1):
            if self._slots[i].value != NULL:
                Py_XDECREF(self._slots[i].value)
                self._slots[i].value = NULL
        self._used = 0
        del held
