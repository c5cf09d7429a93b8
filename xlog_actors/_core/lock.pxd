# A C-level lock for the compiled resources and the history ring; see async_core.pyx's module
# docstring for why a lock at all.
#
# One int and atomic operations: taking it free is one compare-and-swap (about 10 instructions;
# the PyThread lock it replaced cost about 150 per take and give, a semaphore behind a call).
# It is not reentrant. Held, it is waited for with the GIL released (the holder may need the
# GIL to finish: the host driver's calls are Python), yielding the CPU, then sleeping 50 us
# between looks once the wait is long; the CUDA path never holds it across a GIL release, so
# there it is never waited for.

from posix.time cimport nanosleep, timespec

cdef extern from *:
    """
    static inline int xa_lock_try(int *lock) {
        int free_ = 0;
        return __atomic_compare_exchange_n(lock, &free_, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
    }
    static inline void xa_lock_give(int *lock) { __atomic_store_n(lock, 0, __ATOMIC_RELEASE); }
    """
    bint xa_lock_try(int* lock) nogil
    void xa_lock_give(int* lock) nogil

cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef inline void _lock_wait(int* lock) noexcept:
    cdef int looks = 0
    cdef timespec pause
    pause.tv_sec = 0
    pause.tv_nsec = 50_000
    with nogil:
        while not xa_lock_try(lock):
            looks += 1
            if looks < 100:
                sched_yield()
            else:
                nanosleep(&pause, NULL)


cdef inline void lock_acquire(int* lock) noexcept:
    if not xa_lock_try(lock):
        _lock_wait(lock)


cdef inline void lock_release(int* lock) noexcept:
    xa_lock_give(lock)
