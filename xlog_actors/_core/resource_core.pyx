# cython: language_level=3, boundscheck=False, wraparound=False
"""``ResourceCore``: what both compiled resources (``AsyncCore``, ``DirectCore``) hold: the
driver and ordinal they serve, the driver calls they make (``ops``), their C-level lock (see
``async_core.pyx`` for why a lock at all, and why it is uncontended on CUDA) and the memory
history they report to.

Thread rule: every method may be called from any thread at any time.
"""

from .history_ring cimport HistoryRing
from .ops cimport ops_for

__all__ = ["ResourceCore"]


cdef class ResourceCore:
    """The base of the compiled resources (see the module docstring).

    Thread rule: every method may be called from any thread at any time.
    """

    def __init__(self, driver, ordinal):
        """Serve device ``ordinal`` of ``driver``, with no history.

        Args:
            driver: the driver that owns the device.
            ordinal: the device's ordinal.
        Thread rule: any thread.
        """
        self._driver = driver
        self._ordinal = ordinal
        self._ops = ops_for(driver, ordinal)
        self._history = None
        self._ring = None

    @property
    def device_ordinal(self):
        """The ordinal of the device served. Thread rule: any thread."""
        return self._ordinal

    @property
    def driver(self):
        """The driver of the device served. Thread rule: any thread."""
        return self._driver

    @property
    def history(self):
        """The memory history recording this resource's allocations and frees, or None (off,
        the default). Thread rule: any thread."""
        return self._history

    def set_history(self, history):
        """Record every allocation and free from now on into ``history`` (None: stop).

        ``history`` gets ``record_alloc(block)`` after each allocation and ``record_free(block)``
        after each free that succeeded, in the calling thread, outside the resource's lock; a
        ``HistoryRing`` (``MemoryHistory``) is called in C, without a Python call. Switched off,
        a call costs one pointer compare.

        Args:
            history: an object with ``record_alloc`` and ``record_free``, or None.
        Thread rule: any thread; calls already running may still record into the one before.
        """
        self._ring = history if isinstance(history, HistoryRing) else None
        self._history = history
