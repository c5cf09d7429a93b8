# What both compiled resources hold; see resource_core.pyx.

from cpython.pythread cimport PyThread_type_lock

from .history_ring cimport HistoryRing
from .ops cimport DriverOps


cdef class ResourceCore:
    cdef readonly object _driver
    cdef readonly object _ordinal
    cdef DriverOps _ops
    cdef PyThread_type_lock _lock
    cdef object _history
    cdef HistoryRing _ring
