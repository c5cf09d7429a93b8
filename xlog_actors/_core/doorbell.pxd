# cython: language_level=3
# The Doorbell's count, for compiled code that rings it with the GIL released (fdwait).

cdef extern from *:
    """
    static inline unsigned long long xlog_bell_load(unsigned long long* p) {
        return __atomic_load_n(p, __ATOMIC_ACQUIRE);
    }
    static inline void xlog_bell_ring(unsigned long long* p) {
        __atomic_add_fetch(p, 1ULL, __ATOMIC_RELEASE);
    }
    """
    unsigned long long xlog_bell_load(unsigned long long* p) nogil
    void xlog_bell_ring(unsigned long long* p) nogil


cdef class Doorbell:
    cdef unsigned long long _count
