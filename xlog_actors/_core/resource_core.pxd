# What both compiled resources hold; see resource_core.pyx.

from .history_ring cimport HistoryRing
from .ops cimport DriverOps


cdef class ResourceCore:
    cdef readonly object _driver
    cdef readonly object _ordinal
    cdef DriverOps _ops
    cdef int _lock  # lock.pxd's; zeroed (free) when the object is made
    cdef object _history
    cdef HistoryRing _ring
