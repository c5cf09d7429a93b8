"""``StreamPool``: the streams of one device context, named by :class:`StreamId`."""

from __future__ import annotations

import itertools
import logging
import threading

from .._core.async_core import StreamsVersion
from ..driver.protocol import Driver, Stream
from .block import StreamId
from .device_bound import DeviceBound

__all__ = ["StreamPool"]

logger = logging.getLogger("xlog_actors.memory")


class StreamPool(DeviceBound):
    """Maps :class:`StreamId` to the driver's streams of one device.

    ``StreamId.DEFAULT`` resolves to a dedicated non-blocking stream the pool creates up front
    (not CUDA's legacy NULL stream, whose implicit synchronization the host driver does not
    model and non-blocking streams ignore anyway). ``acquire()`` creates a new stream. Ids are
    never reused.

    Thread rule: every method may be called from any thread at any time. ``resolve`` and
    ``ids`` read the map without a lock (single dict operations, atomic under the GIL);
    ``acquire`` and ``close`` change it under a lock, and create or close streams outside it.
    """

    #: ``StreamId.DEFAULT``, the stream every pool has from its creation.
    DEFAULT = StreamId.DEFAULT

    def __init__(self, driver: Driver, ordinal: int) -> None:
        """A pool holding only the default stream, created now on device ``ordinal``.

        Args:
            driver: the driver that owns the device.
            ordinal: the device's ordinal.
        Raises:
            InvalidRequest: ``ordinal`` is not a device of ``driver``.
            DriverError: the driver could not create the stream.
        Thread rule: any thread.
        """
        super().__init__(driver, ordinal)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        # Keyed by the very objects callers pass (``StreamId.DEFAULT``, the ids ``acquire``
        # returns): a look-up then matches the key by identity, without comparing an int subclass
        # to an int (about 80 instructions per look-up, two per allocate + free).
        self._streams: dict[int, Stream] = {StreamId.DEFAULT: driver.create_stream(ordinal)}
        self._version = StreamsVersion()

    def acquire(self) -> StreamId:
        """Create a new non-blocking stream of this device.

        Returns:
            Its id, never used before in this pool.
        Raises:
            DriverError: the driver could not create the stream; nothing changed.
        Thread rule: any thread.
        """
        stream = self._driver.create_stream(self._ordinal)
        with self._lock:
            sid = StreamId(next(self._ids))
            self._streams[sid] = stream
        return sid

    def resolve(self, stream_id: StreamId) -> Stream | None:
        """The stream ``stream_id`` names.

        Args:
            stream_id: an id from this pool.
        Returns:
            The driver's stream, or None for an id the pool does not know (never acquired, or the
            pool was closed).
        Thread rule: any thread (lock-free).
        """
        return self._streams.get(stream_id)

    @property
    def streams(self) -> dict[int, Stream]:
        """The id -> stream map itself (read-only by convention): hot paths look streams up in
        it directly. It is the same dict for the life of the pool. Thread rule: any thread may
        read it; only the pool changes it."""
        return self._streams

    @property
    def streams_version(self) -> StreamsVersion:
        """The pool's version (:class:`~xlog_actors._core.async_core.StreamsVersion`): changed
        whenever a stream leaves :attr:`streams` (``close``), never by ``acquire``, which only
        adds one. A fast path that found a stream in the map may keep it while the version is
        unchanged. Thread rule: any thread may read it; only the pool changes it."""
        return self._version

    def ids(self) -> list[StreamId]:
        """The ids of the open streams.

        Returns:
            A new list, ``StreamId.DEFAULT`` first until the pool is closed.
        Thread rule: any thread.
        """
        return [StreamId(i) for i in list(self._streams)]

    def close(self) -> None:
        """Close every stream of the pool (after their queued work). Idempotent.

        A stream that cannot be closed (its context is gone) is logged at debug level and
        skipped: nothing is raised.

        Thread rule: any thread; a stream resolved before the close may still be used until it
        is closed.
        """
        with self._lock:
            streams = list(self._streams.values())
            # In place: resources hold this very dict for their lock-free lookups.
            self._streams.clear()
            # After the clear: a fast path that read the old version before it uses its stream
            # as one resolved before the close (see the thread rule); from here on it looks again.
            self._version.value += 1
        for stream in streams:
            try:
                stream.close()
            except Exception as exc:  # noqa: BLE001 - a stream of a dead context has nothing to close
                logger.debug("device %d: closing %r: %r", self._ordinal, stream, exc)
