# cython: language_level=3
"""``wait_readable``: spin, the GIL released, until a file descriptor can be read, for a bounded
time.

Why: the isolated device's two pipe readers (the parent's reply reader, the child's frame reader)
sleep in ``read`` between frames, and on the GPU machines a woken thread takes 30 to 230 µs to
run again; an isolated ``Allocate`` crosses two of them. A reader that expects a frame soon (a
reply to an ask in flight, the next ask of a burst) spins here first, like ``doorbell.Doorbell``
does for a thread's counter: a ``poll`` of the descriptor with no timeout per turn, yielding the
CPU on every turn, and blocks in its ordinary read only when the time is up.

Invariants: returns True as soon as a read would not block (data, the end of the pipe, or an
error the read then reports), False when ``seconds`` passed first; it never reads.

Thread rule: any thread; releases the GIL while it spins.
"""

from .doorbell cimport Doorbell, xlog_bell_ring
from .spin cimport POLLIN, now, poll, pollfd, sched_yield


def wait_readable(int fd, double seconds, Doorbell bell=None) -> bool:
    """Spin, the GIL released, until ``fd`` can be read without blocking or ``seconds`` passed.

    Args:
        fd: an open file descriptor.
        seconds: the longest spin; 0 or less looks once.
        bell: rung once the GIL is released, before the first look: a thread waiting on it for
            what this thread just did then takes the GIL at once, instead of waking only to wait
            for this thread to let go of it (a futex sleep and wake, tens of µs on a VM).
    Returns:
        Whether a read would not block now (data, end of file, or an error the read reports).
    Thread rule: any thread; yields the CPU on every turn.
    """
    cdef pollfd p
    cdef double deadline
    cdef int ready
    cdef unsigned long long* count = NULL
    if bell is not None:
        count = &bell._count
    p.fd = fd
    p.events = POLLIN
    p.revents = 0
    with nogil:
        if count != NULL:
            xlog_bell_ring(count)
        ready = poll(&p, 1, 0)
        if ready == 0 and seconds > 0:
            deadline = now() + seconds
            while True:
                sched_yield()
                ready = poll(&p, 1, 0)
                if ready != 0 or now() >= deadline:
                    break
    return ready != 0
