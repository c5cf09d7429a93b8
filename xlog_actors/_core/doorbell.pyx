# cython: language_level=3
"""``Doorbell``: a counter that one thread rings and another waits on by spinning with the GIL
released, for a bounded time.

Why: on the GPU machines a thread blocked on a lock or a condition takes 150 to 230 µs to run
again once woken (a virtual machine's idle cores), and then runs several times slower for a while;
CUDA's own synchronize never pays that, because it spins. A waiter that expects its wake-up soon
(an actor between two messages of a pipeline, a caller waiting for a short reply) spins here
first, yielding the CPU on every turn, and blocks the ordinary way only when the time is up.

Invariants: the count only grows, by one per ``ring``; a wait returns True exactly when the
count differs from the value the caller saw, so a ring between the caller's look and its wait is
never missed.

Thread rule: any thread; ``ring`` and ``count`` are atomic; ``wait`` releases the GIL.
"""

from .spin cimport now, sched_yield


cdef class Doorbell:
    """A ring counter to spin on. See the module docstring.

    Thread rule: any thread.
    """

    def ring(self) -> None:
        """Add one to the count (release ordering: what the ringer wrote before is visible to a
        waiter that sees the new count). Thread rule: any thread."""
        xlog_bell_ring(&self._count)

    @property
    def count(self) -> int:
        """The count now. Thread rule: any thread."""
        return xlog_bell_load(&self._count)

    def wait(self, unsigned long long seen, double seconds) -> bool:
        """Spin, the GIL released, until the count differs from ``seen`` or ``seconds`` passed.

        Args:
            seen: the count the caller read before it found nothing to do.
            seconds: the longest spin; 0 or less returns at once.
        Returns:
            Whether the count moved (something was rung since ``seen``).
        Thread rule: any thread; yields the CPU on every turn.
        """
        cdef double deadline
        cdef bint moved = xlog_bell_load(&self._count) != seen
        if moved or seconds <= 0:
            return moved
        with nogil:
            deadline = now() + seconds
            while True:
                if xlog_bell_load(&self._count) != seen:
                    moved = True
                    break
                if now() >= deadline:
                    break
                sched_yield()
        return moved
