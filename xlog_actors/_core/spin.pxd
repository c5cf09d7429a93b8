# cython: language_level=3
# What the spinning waits share (doorbell, fdwait, call_lane): the monotonic clock, a yield of the
# CPU, and poll for one descriptor, all callable with the GIL released.

from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd* fds, unsigned long nfds, int timeout)
    short POLLIN

cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef inline double now() noexcept nogil:
    """``CLOCK_MONOTONIC`` in seconds."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9
