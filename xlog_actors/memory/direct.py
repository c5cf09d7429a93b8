"""``DirectCudaResource``: one synchronous driver allocation per call, the sanitizer backend.

The body is compiled (:mod:`xlog_actors._core.direct_core`); this module is its public face."""

from __future__ import annotations

from .._core.direct_core import DirectCore
from .resource import DeviceMemoryResource

__all__ = ["DirectCudaResource"]


class DirectCudaResource(DirectCore, DeviceMemoryResource):
    """``cuMemAlloc``/``cuMemFree`` per call: no pool, no suballocation, so Compute Sanitizer
    sees every allocation's true bounds.

    ``DirectCudaResource(driver, ordinal)`` is an empty resource on device ``ordinal`` of
    ``driver`` (the ordinal is checked by the driver on the first allocation). The ``stream``
    given to ``allocate`` is recorded on the block but binds nothing: the free is ``cuMemFree``,
    which synchronizes the device first. Cross-stream tracking is not offered (the hooks raise
    ``StreamMisuse``): code that needs it runs on ``AsyncCudaResource``. ``allocate``,
    ``deallocate``, ``bytes_outstanding`` and ``live_blocks`` are compiled; each has its own
    docstring.

    Thread rule: every method may be called from any thread at any time. One lock guards the
    live map and the byte counter; the driver is called outside it.
    """

    __slots__ = ()

    def describe(self) -> str:
        """``"direct"``. Thread rule: any thread."""
        return "direct"
