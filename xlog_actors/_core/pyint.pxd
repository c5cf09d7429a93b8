# CPython's int objects read and written in place, for the few hot paths where a conversion call
# costs more than the work around it: a table key from an address (ptr_table), a cache's size
# from a one-digit int (cache_core), a generation renewed on a cache hit (blocks.pxd). Shared so
# that the int layout of each CPython version is written down once: a version that moves it is
# one edit here, not one per module. A .pxd, not a header: the sdist carries the Cython sources
# and no .h (MANIFEST.in).

from libc.stdint cimport uint64_t
from cpython.object cimport PyObject

cdef extern from *:
    """
    /* An int's digit count, sign and digits. Up to CPython 3.11 the size is the object's size,
       its sign the size's (so a non-negative int's size is its digit count); from 3.12 to 3.14
       both are in the value's tag (the digit count above its three low bits, the sign in its two
       lowest: 0 positive, 1 zero, 2 negative). The digits follow either. Macros, so that a build
       laid out otherwise (PyPy) still compiles what does not expand them. */
    #if PY_VERSION_HEX >= 0x030C0000
    #define xa_int_ndigits(o) ((Py_ssize_t)(((PyLongObject *)(o))->long_value.lv_tag >> 3))
    #define xa_int_negative(o) ((((PyLongObject *)(o))->long_value.lv_tag & 3) == 2)
    #define xa_int_zero(o) ((((PyLongObject *)(o))->long_value.lv_tag & 3) == 1)
    #define xa_int_digits(o) (((PyLongObject *)(o))->long_value.ob_digit)
    #else
    #define xa_int_ndigits(o) Py_SIZE(o)  /* of a non-negative int only */
    #define xa_int_negative(o) (Py_SIZE(o) < 0)
    #define xa_int_zero(o) (Py_SIZE(o) == 0)
    #define xa_int_digits(o) (((PyLongObject *)(o))->ob_digit)
    #endif

    /* True when `o`'s one reference is the caller's borrowed one (only a GIL build can say). */
    #ifdef Py_GIL_DISABLED
    #define xa_only_ref(o) 0
    #else
    #define xa_only_ref(o) (Py_REFCNT(o) == 1)
    #endif

    /* Rewrite `obj`, a positive int instance, to `n` in place, when `n` has exactly as many
       digits as it (1: done; 0: not, nothing changed). Only the digits are written: size and
       sign stay. An int caches no hash, so the object is then `n` in every respect; the caller
       makes sure nobody else can see it change (its one reference is the caller's). Checked
       against the type call when blocks.pyx loads. One digit, the usual case, is written with no
       loop. Never on PyPy or from 3.15 on, whose layout is not known here (0: the caller makes
       a new int). */
    static inline int xa_int_set(PyObject *obj, unsigned long long n) {
    #if defined(PYPY_VERSION) || PY_VERSION_HEX >= 0x030F0000
        (void)obj; (void)n;
        return 0;
    #else
        Py_ssize_t size = xa_int_ndigits(obj);
        digit *d = xa_int_digits(obj);
        Py_ssize_t need = 0, i;
        unsigned long long m = n;
        if (n != 0 && n <= PyLong_MASK) {
            if (size != 1) return 0;
            d[0] = (digit)n;
            return 1;
        }
        while (m) { need++; m >>= PyLong_SHIFT; }
        if (need != size) return 0;
        for (i = 0; i < size; i++) { d[i] = (digit)(n & PyLong_MASK); n >>= PyLong_SHIFT; }
        return 1;
    #endif
    }

    /* `v`, an exact int, as a key without a call when its digits are read directly: 1 for 0,
       one digit or two (every device address with 30-bit digits), 0 for a negative one; -1
       where it is not read this way (the conversion call then, about 35 instructions): on PyPy,
       and from 3.15 on, whose layout is not known here. */
    static inline int xa_small_u64(PyObject *v, uint64_t *out) {
    #if defined(PYPY_VERSION) || PY_VERSION_HEX >= 0x030F0000
        return -1;
    #else
        Py_ssize_t size;
        const digit *d = xa_int_digits(v);
        if (xa_int_negative(v)) return 0;
        size = xa_int_zero(v) ? 0 : xa_int_ndigits(v);
        if (size == 2) { *out = (uint64_t)d[0] | ((uint64_t)d[1] << PyLong_SHIFT); return 1; }
        if (size == 1) { *out = (uint64_t)d[0]; return 1; }
        if (size == 0) { *out = 0; return 1; }
        return -1;
    #endif
    }

    /* 1 and its value in `*n` when `o`, an exact int, is positive and fits one of its digits
       (every size a cache keeps in practice), read in place; else 0 (the caller converts it):
       the conversion call was about 25 instructions of a hit. From 3.12 on through CPython's
       own (unstable) accessors of the same tag, which CPython keeps right past 3.14. */
    static inline int xa_small_positive(PyObject *o, long long *n) {
    #if PY_VERSION_HEX >= 0x030C0000
        Py_ssize_t v;
        if (!PyUnstable_Long_IsCompact((PyLongObject *)o)) return 0;
        v = PyUnstable_Long_CompactValue((PyLongObject *)o);
        if (v <= 0) return 0;
        *n = (long long)v;
        return 1;
    #else
        if (xa_int_negative(o) || xa_int_ndigits(o) != 1) return 0;
        *n = (long long)xa_int_digits(o)[0];
        return 1;
    #endif
    }
    """
    bint xa_only_ref(PyObject* o) noexcept
    bint xa_int_set(PyObject* obj, unsigned long long n) noexcept
    int xa_small_u64(object v, uint64_t* out) noexcept
    bint xa_small_positive(PyObject* o, long long* n) noexcept
