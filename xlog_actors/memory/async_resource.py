"""``AsyncCudaResource``: stream-ordered allocation with cross-stream dependency tracking.

The rules:

* ``allocate(n, stream)`` is ordered on ``stream`` (``cuMemAllocAsync``); the block's first
  producer is the allocation itself, so a consumer on another stream waits for an
  *allocation-ready fence* before touching the bytes.
* Per block: ``last_write`` (the stream and event of the most recent write, or of the allocation)
  and ``reads`` (the read events recorded since). ``prepare_block_use`` queues the minimal waits
  before a launch: a read waits on ``last_write``; a write waits on ``last_write`` and on every
  read; waits on the using stream itself are skipped. ``finish_block_use`` records after the
  launch: a write replaces ``last_write`` and clears the reads (its prepare already waited on
  them), a read is added. ``record_block_use`` is finish-with-READ.
* ``deallocate`` validates ``(ptr, generation)`` first (the ABA guard), makes the allocation
  stream wait on every cross-stream event, then queues the free there. Any failure leaves the
  block live and every counter unchanged.
* ``bytes_outstanding() == live_bytes() + pending_free_bytes()``: a queued free counts until
  ``reap_pending`` synchronized its stream; a reap releases only what it synchronized and keeps
  failed and unvisited streams for the next reap.

Two economies, because an event per allocation would double the allocator's cost:

* The allocation-ready fence is recorded lazily, on the allocation stream, the first time a
  consumer on another stream prepares a use. It then covers the allocation and whatever was
  queued on that stream since: never less than an eager fence, at times more. A block used only
  on its own stream never costs an event.
* Events come from an :class:`EventPool`; a block keeps at most one read event per stream
  (a later read on the same stream re-records it in place, which subsumes the earlier one).

The body is compiled (:mod:`xlog_actors._core.async_core`, which also holds the rules'
implementation notes); this module is its public face.

Thread rules: one lock (a C-level one, uncontended on CUDA) guards the live map, the per-block
state, the pending map and both byte counters, so they always move together. Waits and records
are enqueued under it (they never block the host); the stream-ordered allocation itself and every
stream synchronization run outside it.
"""

from __future__ import annotations

from .._core.async_core import AsyncCore
from ..driver.protocol import Driver
from ..errors import InvalidRequest
from .resource import DeviceMemoryResource
from .stream_pool import StreamPool

__all__ = ["AsyncCudaResource"]


class AsyncCudaResource(AsyncCore, DeviceMemoryResource):
    """Stream-ordered allocator with cross-stream tracking; see the module docstring for every
    rule and the lock.

    ``device_ordinal``, ``driver`` and ``stream_pool`` are read-only properties. Allocation,
    free, reap, the tracking hooks and the diagnostics (``live_bytes``, ``pending_free_bytes``,
    ``pending_per_stream_total``, ``pending_use_event_count``, ``events_created``,
    ``live_blocks``) are compiled; each has its own docstring.

    Thread rule: every method may be called from any thread at any time.
    """

    __slots__ = ()

    def __init__(self, driver: Driver, ordinal: int, stream_pool: StreamPool) -> None:
        """An empty resource on device ``ordinal`` of ``driver``, ordering its work on the streams
        of ``stream_pool``.

        Args:
            driver: the driver that owns the device.
            ordinal: the device's ordinal.
            stream_pool: the device's stream pool; it must belong to the same device.
        Raises:
            InvalidRequest: ``stream_pool`` belongs to another device.
        Thread rule: any thread.
        """
        if stream_pool.device_ordinal != ordinal:
            raise InvalidRequest(
                f"AsyncCudaResource: stream pool of device {stream_pool.device_ordinal} given for device {ordinal}"
            )
        super().__init__(driver, ordinal, stream_pool)

    def supports_block_use_tracking(self) -> bool:
        """True: the tracking hooks really track. Thread rule: any thread."""
        return True

    def describe(self) -> str:
        """``"async"``. Thread rule: any thread."""
        return "async"
