# What both compiled resources hold; see resource_core.pyx.

from posix.time cimport clock_gettime, timespec

from .history_ring cimport HISTORY_ALLOC, HistoryRing
from .ops cimport DriverOps


cdef extern from "<time.h>":
    # Linux's coarse monotonic clock: a read of the kernel's tick (a few ns instead of about 20);
    # block ages in memory reports need no better than its millisecond-scale resolution.
    int CLOCK_MONOTONIC_COARSE


# When a block was made or handed out again, in seconds: one clock for every compiled resource, so
# the ages a report shows compare across them.
cdef inline double block_clock() noexcept:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef class ResourceCore:
    cdef readonly object _driver
    cdef readonly object _ordinal
    cdef DriverOps _ops
    cdef int _lock  # lock.pxd's; zeroed (free) when the object is made
    cdef object _history
    cdef HistoryRing _ring


# Report ``block``'s allocation or free (``action``: HISTORY_ALLOC or HISTORY_FREE) to the
# resource's memory history, if one is set: a HistoryRing in C, any other history through its
# record_alloc/record_free. Both resources call it after the operation succeeded, in the calling
# thread, outside their lock; switched off it costs one pointer compare (it is inlined).
cdef inline int record_history(ResourceCore core, object block, int action) except -1:
    if core._history is None:
        return 0
    if core._ring is not None:
        core._ring.record(block, action)
    elif action == HISTORY_ALLOC:
        core._history.record_alloc(block)
    else:
        core._history.record_free(block)
    return 0
