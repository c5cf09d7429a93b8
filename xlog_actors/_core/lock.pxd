# A C-level lock for the compiled resources; see async_core.pyx's module docstring for why.

from cpython.pythread cimport (
    NOWAIT_LOCK,
    WAIT_LOCK,
    PyThread_acquire_lock,
    PyThread_release_lock,
    PyThread_type_lock,
)


cdef inline void lock_acquire(PyThread_type_lock lock) noexcept:
    # Uncontended (the usual case: a holder on the CUDA path never lets the GIL go), it is one
    # atomic operation. Contended, it waits with the GIL released, so the holder can finish.
    if not PyThread_acquire_lock(lock, NOWAIT_LOCK):
        with nogil:
            PyThread_acquire_lock(lock, WAIT_LOCK)


cdef inline void lock_release(PyThread_type_lock lock) noexcept:
    PyThread_release_lock(lock)
